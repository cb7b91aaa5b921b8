#!/usr/bin/env bash
# The study's `learned` cell (issues 13, 23): Cora, 4 METIS parts, VARCO slope 5 (128 -> 1),
# configs/cora.toml (200 epochs), seeds 0-2: full communication, truncate, and learned (the
# encoder/decoder applied only while the exchange compresses, as VARCO's code applies them).
# Prints: method seed test_acc(best val) final_test_acc bytes_sent/bytes_full
#   bash bench/learned_cell.sh [WORK_DIR] ["full truncate learned"]
# The variants that found the cause (the pair at ratio 1, frozen, a smaller codec lr) are in
# bench/learned_diagnose.py.
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
  for m in ${2:-full truncate learned}; do
    sched=(); sets=(--set train.seed=$seed)
    case $m in truncate) sched=(--schedule configs/schedules/varco.toml);;
      learned) sched=(--schedule "$work/learned.toml");; esac
    mpiexec -n 4 --oversubscribe python -m mpi4py -m hpcgnn train --shards $S --config configs/cora.toml --out "$work"/$m-$seed --force "${sched[@]}" "${sets[@]}" >/dev/null 2>"$work"/$m-$seed.err || echo FAIL $m $seed
    python -c "import json;s=json.load(open('"$work"/$m-$seed/summary.json'));print('$m',$seed,s['test_acc'],s['final_test_acc'],round(s['bytes_sent']/s['bytes_full'],3))"
  done
done
