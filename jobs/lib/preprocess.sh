# The body of jobs/preprocess.sbatch (sourced after common.sh): reuse, or partition and verify.

# Does OUT_DIR's meta.json describe DATASET in PARTS parts with the asked partitioner, seed and
# --symmetrize (a set written before meta.json recorded it counts as not symmetrised), and an
# npz:/h5:/metis-graph: input file of the size and modification time it was read at?
# Prints the first difference; exit 0 when there is none.
hpcgnn_same_settings() {
    python - "$@" <<'PY'
import argparse, json, sys
dataset, parts, out, *rest = sys.argv[1:]
ap = argparse.ArgumentParser(add_help=False)
ap.add_argument("--partitioner", default="metis")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--symmetrize", action="store_true")
asked, _ = ap.parse_known_args(rest)
meta = json.load(open(f"{out}/meta.json"))
meta.setdefault("symmetrize", False)    # sets written before meta.json recorded it
want = {"dataset": dataset, "num_parts": int(parts), "partitioner": asked.partitioner, "seed": asked.seed,
        "symmetrize": asked.symmetrize}
for key, value in want.items():
    if meta.get(key) != value:
        print(f"{out}/meta.json has {key}={meta.get(key)!r}, this job asks for {value!r}")
        sys.exit(1)
from hpcgnn.data.datasets import parse_spec
from preprocess.write import input_stamp   # the input file's size and mtime (None: other specs)
now, then = input_stamp(dataset), meta.get("input")   # sets written before it lack "input"
if now is not None and then is not None and now != then:
    print(f"{parse_spec(dataset)[1]['path']} changed since the set in {out} was written (size, "
          f"modification time {then['size']}, {then['mtime_ns']} then, {now['size']}, "
          f"{now['mtime_ns']} now)")
    sys.exit(1)
PY
}

has_arg() { local want=$1; shift; for a in "$@"; do [[ $a == "$want" ]] && return 0; done; return 1; }

# The --partitioner among the preprocess args (metis when none is given).
partitioner_arg() {
    local found=metis
    while [[ $# -gt 0 ]]; do
        case $1 in --partitioner) found=${2:-}; shift ;; --partitioner=*) found=${1#--partitioner=} ;; esac
        shift
    done
    echo "$found"
}

hpcgnn_preprocess_main() {
    local dataset=$1 parts=$2 out=$3; shift 3
    hpcgnn_env
    hpcgnn_keep_log "${HPCGNN_RUNS:-runs}/logs" "${SLURM_JOB_NAME:-hpcgnn-prep}-$(hpcgnn_job_ref).out"
    local force=() why
    if [[ -f $out/meta.json ]] && python -m preprocess verify -q "$out" >&2; then
        if why=$(hpcgnn_same_settings "$dataset" "$parts" "$out" "$@"); then
            hpcgnn_say "reusing the verified shard set in $out ($dataset, $parts parts)"
            return 0
        fi
        has_arg --force "$@" || hpcgnn_die "$why; pass --force to rewrite it, or choose another OUT_DIR"
    elif [[ -d $out ]] && compgen -G "$out/part-*.h5" >/dev/null; then
        hpcgnn_say "$out holds a shard set that does not verify (an interrupted run?): rewriting it"
        has_arg --force "$@" || force=(--force)
    fi
    local ntasks=${SLURM_NTASKS:-1} partitioner
    partitioner=$(partitioner_arg "$@")
    if (( ntasks > 1 )); then   # the distributed path: PT-Scotch or random across the ranks
        [[ $partitioner == ptscotch || $partitioner == random ]] || hpcgnn_die "the job has $ntasks tasks, but --partitioner $partitioner runs in one process: submit with --ntasks=1, or pass --partitioner ptscotch (or random) to partition across the $ntasks ranks"
        hpcgnn_launcher
        hpcgnn_say "partitioning $dataset into $parts parts on $ntasks ranks ($partitioner) -> $out"
        "${LAUNCH[@]}" python -m mpi4py -m preprocess --dataset "$dataset" --parts "$parts" \
            --out "$out" "${force[@]}" "$@"
    else
        hpcgnn_say "partitioning $dataset into $parts parts -> $out"
        python -m preprocess --dataset "$dataset" --parts "$parts" --out "$out" "${force[@]}" "$@"
    fi
    python -m preprocess verify "$out"
}
