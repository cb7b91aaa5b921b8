#!/usr/bin/env bash
# Two checkouts of hpcgnn, alternating: the same training run on the same shards from each,
# ROUNDS times (old first in odd rounds, new first in even) after one untimed run of each, on
# shared memory; prints each run's median step,
# training time, wall-clock with evaluation, accuracies and peak resident memory, then the
# per-round ratios new / old.
#
#   bash bench/ab.sh OLD_REV [ROUNDS]        # e.g. bash bench/ab.sh HEAD 4
#
# OLD_REV is checked out into a temporary git worktree; "new" is this working tree. Environment:
# DATASET (cora), PARTS (4, also the rank count), PARTITIONER (metis), CONFIG
# (configs/cora.toml), SCHEDULE (a schedule's name in configs/schedules, e.g. sample-all, or a
# path; default none: full communication), SETS (extra --set options, e.g. "--set
# model.hidden=64"). Needs the project's .venv; an idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
NEW=$PWD
OLD_REV=${1:?usage: bash bench/ab.sh OLD_REV [ROUNDS]}
ROUNDS=${2:-4}
DATASET=${DATASET:-cora} PARTS=${PARTS:-4} PARTITIONER=${PARTITIONER:-metis}
CONFIG=${CONFIG:-$NEW/configs/cora.toml} SETS=${SETS:-} SCHEDULE=${SCHEDULE:-}
if [ -n "$SCHEDULE" ]; then            # both sides read this tree's schedule file
    [ -f "$SCHEDULE" ] || SCHEDULE=$NEW/configs/schedules/$SCHEDULE.toml
    [ -f "$SCHEDULE" ] || { echo "bench/ab.sh: no schedule $SCHEDULE" >&2; exit 2; }
    SETS="--schedule $(realpath "$SCHEDULE") $SETS"
fi
WORK=$(mktemp -d /tmp/hpcgnn-ab.XXXXXX)
PY=$NEW/.venv/bin/python MPIEXEC=$NEW/.venv/bin/mpiexec
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
git worktree add -q --detach "$WORK/old" "$OLD_REV"
trap 'git worktree remove --force "$WORK/old"; rm -rf "$WORK"' EXIT
echo "old: $(git -C "$WORK/old" rev-parse --short HEAD); new: $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' + uncommitted changes')"
"$PY" -m preprocess --dataset "$DATASET" --parts "$PARTS" --partitioner "$PARTITIONER" \
    --out "$WORK/shards" --force -q
run() {   # run VERSION NAME: one training run from that checkout; its log on failure
    local src=$NEW; [ "$1" = old ] && src=$WORK/old
    # shellcheck disable=SC2086
    (cd "$src" && export PYTHONPATH=$src && "$MPIEXEC" -n "$PARTS" "$PY" -m mpi4py -m hpcgnn \
        train --shards "$WORK/shards" --config "$CONFIG" --out "$WORK/$2" --force $SETS \
        >"$WORK/$2.log" 2>&1) || { cat "$WORK/$2.log"; exit 1; }
}
for v in old new; do                   # which package each side imports (not the installed one)
    src=$NEW; [ "$v" = old ] && src=$WORK/old
    (cd "$src" && PYTHONPATH=$src "$PY" -c "import hpcgnn; print('$v imports', hpcgnn.__file__)")
done
run old warm-old; run new warm-new     # untimed: builds each checkout's C kernels, warms caches
for i in $(seq 1 "$ROUNDS"); do        # the order alternates: old first in odd rounds
    order="old new"; [ $((i % 2)) = 0 ] && order="new old"
    for v in $order; do run "$v" "run-$v-$i"; done
done
"$PY" - "$WORK" "$ROUNDS" <<'EOF'
import json, math, sys
work, rounds = sys.argv[1], int(sys.argv[2])
keys = ("epoch_time_s_median", "train_time_s", "wall_time_s")
print("| round | run | median step (ms) | training (s) | with evaluation (s) | test acc | final | peak RSS (MiB) |")
print("|---:|---|---:|---:|---:|---:|---:|---:|")
ratios = {k: [] for k in keys}
for i in range(1, rounds + 1):
    s = {v: json.load(open(f"{work}/run-{v}-{i}/summary.json")) for v in ("old", "new")}
    for v in ("old", "new"):
        r = s[v]
        print(f"| {i} | {v} | {1e3 * r['epoch_time_s_median']:.2f} | {r['train_time_s']:.2f} | "
              f"{r['wall_time_s']:.2f} | {r['test_acc']:.4f} | {r['final_test_acc']:.4f} | {r['peak_rss_bytes'] >> 20} |")
    for k in keys:
        ratios[k].append(s["new"][k] / s["old"][k])
print()
for k in keys:
    g = math.exp(sum(map(math.log, ratios[k])) / rounds)
    print(f"new / old, {k}: geometric mean {g:.3f}, rounds {', '.join(f'{x:.3f}' for x in ratios[k])}")
EOF
