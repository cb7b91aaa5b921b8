#!/usr/bin/env bash
# The study's `learned` cell again (issue 13): Cora, 4 METIS parts, VARCO slope 5 (128 -> 1),
# seeds 0-2; full communication, truncate, learned (codec not weight-decayed, the default since
# train.weight_decay_codec), and learned with its modules decayed (the old behaviour).
# Prints: method seed test_acc(best val) final_test_acc bytes_sent/bytes_full
#   bash bench/learned_cell.sh [WORK_DIR]
set -u
cd "$(dirname "$0")/.."
source .venv/bin/activate
work=${1:-/tmp/hpcgnn-learned-cell}
mkdir -p "$work"
sed 's/codec = "truncate"/codec = "learned"/' configs/schedules/varco.toml > "$work/learned.toml"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
S=shards/cora-4
python -m preprocess verify $S >/dev/null 2>&1 || python -m preprocess --dataset cora --parts 4 --partitioner metis --out $S --force -q
for seed in 0 1 2; do
  for m in full truncate learned learned-wd; do
    sched=(); sets=(--set train.seed=$seed)
    case $m in truncate) sched=(--schedule configs/schedules/varco.toml);;
      learned) sched=(--schedule "$work/learned.toml");;
      learned-wd) sched=(--schedule "$work/learned.toml"); sets+=(--set train.weight_decay_codec=true);; esac
    mpiexec -n 4 --oversubscribe python -m mpi4py -m hpcgnn train --shards $S --config configs/cora.toml --out "$work"/$m-$seed --force "${sched[@]}" "${sets[@]}" >/dev/null 2>"$work"/$m-$seed.err || echo FAIL $m $seed
    python -c "import json;s=json.load(open('"$work"/$m-$seed/summary.json'));print('$m',$seed,s['test_acc'],s['final_test_acc'],round(s['bytes_sent']/s['bytes_full'],3))"
  done
done
