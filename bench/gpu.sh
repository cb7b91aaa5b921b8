#!/usr/bin/env bash
# The GPU path, end to end, on a machine with CUDA: what MPI and torch see, the GPU tests, Cora
# trained on the GPU at 1 and 2 ranks (host staging, and device buffers when the MPI is
# CUDA-aware) against the CPU run, every codec on CUDA (the fused Triton kernels and the torch
# path, launches counted, against the measured copy bandwidth), the counter-based dropout against
# torch's, and the epoch benchmark against PyG on the same GPU (SAGE, and GAT against PyG's
# GATConv; hpcgnn also on its torch path, HPCGNN_TRITON=0).
#
#   bash bench/gpu.sh OUT_DIR [EPOCH_SPEC]      # EPOCH=0: without the epoch benchmark
#   SECTIONS=info,bench bash bench/gpu.sh OUT_DIR   # some of: info tests cora bench network aware
#
# Uses the venv python in $PY (default: .venv/bin/python). Offline machines: build that venv
# over the site's torch with bench/gpu-venv.sh and the wheels in .whl/ it names.
# Section 'aware' (not in the default) runs the CUDA-aware checks with $PY_AWARE (default
# .venv-cuda/bin/python, the venv of env/cuda-aware-openmpi.sh build): hpcgnn info, the GPU
# exchange and staging tests (device buffers handed to MPI against the staged path, bit for
# bit), and Cora on 2 ranks staged against CUDA-aware, timed. Section 'network' (not in the
# default; root) runs bench/network.py with GPU ranks behind the emulated link (NET_RANKS,
# NET_RATES, NET_EPOCHS).
# Every step runs even when one before it fails; the exit status counts the failed steps.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-runs/gpu}
spec=${2:-csbm:nodes=500000,classes=8,degree=20,homophily=0.8,features=128,seed=0}
PY=${PY:-.venv/bin/python}
MPIEXEC=$(dirname "$PY")/mpiexec
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
SECTIONS=,${SECTIONS:-info,tests,cora,bench},
want() { [[ $SECTIONS == *",$1,"* ]]; }
rm -f "$out/.failed"
step() { echo; echo "=== $1"; local what=$1; shift; local t0=$SECONDS; "$@"; local rc=$?;
         echo "--- rc $rc, $((SECONDS - t0)) s ($what)"; [[ $rc == 0 ]] || echo "$what" >> "$out/.failed"; }
# JOBS=N: the Cora trainings run N at a time (correctness only; their times are not reported)
bg() { if (( ${JOBS:-1} > 1 )); then while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n; done; "$@" & else "$@"; fi; }

if want info; then
step "info" $PY -m hpcgnn info
step "triton" $PY -c 'import torch, triton; print("triton", triton.__version__, "torch", torch.__version__, "cuda", torch.version.cuda)'
step "ompi_info cuda" bash -c "$(dirname "$PY")/ompi_info --parsable --all 2>/dev/null | grep -i -E 'cuda|accelerator' | head -20"
step "nvidia-smi" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
want tests && step "GPU tests (the Triton kernels among them, compiled)" $PY -m pytest -q -ra -m gpu ${XDIST:-} tests/
want tests && step "Triton kernels compile for this GPU's arch" $PY tests/_compile_kernels.py \
    "$($PY -c 'import torch; a, b = torch.cuda.get_device_capability(); print(10 * a + b)')"
if want cora || want aware; then
[[ -f shards/gpu-cora-2/meta.json ]] || $PY -m preprocess --dataset cora --parts 2 --partitioner metis --out shards/gpu-cora-2 --force -q
[[ -f shards/gpu-cora-1/meta.json ]] || $PY -m preprocess --dataset cora --parts 1 --partitioner metis --out shards/gpu-cora-1 --force -q
[[ -f shards/gpu-cora-4/meta.json ]] || $PY -m preprocess --dataset cora --parts 4 --partitioner metis --out shards/gpu-cora-4 --force -q
fi
train() {  # ranks shards device run [extra...]
    local n=$1 sh=$2 dev=$3 run=$4; shift 4
    "${MPIEXEC}" -n "$n" --oversubscribe $PY -m mpi4py -m hpcgnn train --shards "$sh" --config "${CFG:-configs/cora.toml}" \
        --device "$dev" --out "$out/$run" --force "$@" > "$out/$run.log" 2>&1 && $PY -m hpcgnn summary "$out/$run"
}
if want cora; then
bg step "Cora, 1 rank, cpu" train 1 shards/gpu-cora-1 cpu cora-cpu-1
bg step "Cora, 1 rank, cuda" train 1 shards/gpu-cora-1 cuda cora-cuda-1
HPCGNN_CUDA_AWARE=0 bg step "Cora, 2 ranks, cuda, staged through host memory" train 2 shards/gpu-cora-2 cuda cora-cuda-2-staged
bg step "Cora, 2 ranks, cuda, as the library says" train 2 shards/gpu-cora-2 cuda cora-cuda-2
for s in configs/schedules/*.toml; do
    name=$(basename "$s" .toml)
    bg step "Cora, 2 ranks, cuda, schedule $name" train 2 shards/gpu-cora-2 cuda "cora-cuda-2-$name" --schedule "$s"
done
bg step "Cora, 2 ranks, cuda, Sylvie (staleness 1 + 1-bit)" train 2 shards/gpu-cora-2 cuda cora-cuda-2-sylvie \
    --schedule configs/schedules/quant1-all.toml --set train.staleness=1
bg step "Cora, 2 ranks, cpu, Sylvie (staleness 1 + 1-bit)" train 2 shards/gpu-cora-2 cpu cora-cpu-2-sylvie \
    --schedule configs/schedules/quant1-all.toml --set train.staleness=1
bg step "Cora, 2 ranks, cuda, CAGNET 1.5D (c = 1)" train 2 shards/gpu-cora-2 cuda cora-cuda-2-15d \
    --set parallel.algorithm=1.5d
bg step "Cora, 2 ranks over 4 parts, cuda" train 2 shards/gpu-cora-4 cuda cora-cuda-2of4
CFG=configs/cora-gat.toml bg step "Cora GAT, 1 rank, cpu" train 1 shards/gpu-cora-1 cpu gat-cpu-1
CFG=configs/cora-gat.toml bg step "Cora GAT, 1 rank, cuda" train 1 shards/gpu-cora-1 cuda gat-cuda-1
CFG=configs/cora-gat.toml bg step "Cora GAT, 2 ranks, cuda" train 2 shards/gpu-cora-2 cuda gat-cuda-2
CFG=configs/retexo.toml bg step "Cora RETEXO, 1 rank, cpu" train 1 shards/gpu-cora-1 cpu retexo-cpu-1
CFG=configs/retexo.toml bg step "Cora RETEXO, 1 rank, cuda" train 1 shards/gpu-cora-1 cuda retexo-cuda-1
CFG=configs/retexo.toml bg step "Cora RETEXO, 2 ranks, cuda" train 2 shards/gpu-cora-2 cuda retexo-cuda-2
wait
step "losses: cuda against cpu" $PY - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def losses(run):
    return [json.loads(l)["loss"] for l in (out / run / "metrics.jsonl").read_text().splitlines()]
ref = losses("cora-cpu-1")
worst = 0.0
refs = {"sylvie": "cora-cpu-2-sylvie", "gat": "gat-cpu-1", "retexo": "retexo-cpu-1"}
for run in ("cora-cuda-1", "cora-cuda-2-staged", "cora-cuda-2", "cora-cuda-2-15d", "cora-cuda-2of4",
            "cora-cuda-2-sylvie", "gat-cuda-1", "gat-cuda-2", "retexo-cuda-1", "retexo-cuda-2"):
    ref = losses(next((v for k, v in refs.items() if k in run), "cora-cpu-1"))
    got = losses(run)
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref))
    if not run.endswith("sylvie"):     # 1-bit codes may flip on fp32 differences: reported only
        worst = max(worst, rel)
    print(f"{run}: {len(got)} epochs, max relative loss difference to the cpu run {rel:.2e}")
sys.exit(0 if worst < 1e-4 else 1)
EOF
fi
if want bench; then
# QUICK=1 (a short lease): the Triton codec path only, and the SAGE epoch on 1 rank only (no
# torch path, no 2-rank schedules); GAT on both of its paths; GCN as always
if [[ ${QUICK:-0} == 1 ]]; then codec_paths=triton; sage_args=(--ranks 1)
else codec_paths=triton,torch; sage_args=(--torch-path --schedules quant2-all,full); fi
step "a codec call's cost layer by layer, cuda (launcher, compiled handle, allocation)" $PY bench/launch_cost.py \
    --out "$out/launch-cost"
step "codec throughput, cuda ($codec_paths)" $PY bench/codecs.py --device cuda \
    --paths "$codec_paths" --repeat 50 --out "$out/codecs-cuda"
step "dropout, cuda (fused counter kernel, torch hash path, F.dropout)" $PY bench/dropout.py \
    --device cuda --repeat 50 --out "$out/dropout-cuda"
[[ ${EPOCH:-1} == 0 ]] || step "epoch benchmark, cuda (hpcgnn, PyG)" $PY bench/epoch.py --device cuda --dataset "$spec" \
    --epochs 10 --results "$out" --shards-root shards/gpu-epoch --profile "${sage_args[@]}"
[[ ${EPOCH:-1} == 0 ]] || step "epoch benchmark, cuda, GAT (hpcgnn 1 rank, PyG GATConv)" $PY bench/epoch.py --device cuda \
    --arch gat --dataset "$spec" --ranks 1 --epochs 10 --results "$out/gat" --shards-root shards/gpu-epoch --profile
[[ ${EPOCH:-1} == 0 ]] || HPCGNN_GAT_SPMM=0 step "epoch benchmark, cuda, GAT on its per-edge messages path (HPCGNN_GAT_SPMM=0)" \
    $PY bench/epoch.py --device cuda --arch gat --dataset "$spec" --ranks 1 --epochs 10 --skip-pyg \
    --results "$out/gat-messages" --shards-root shards/gpu-epoch
[[ ${EPOCH:-1} == 0 ]] || step "epoch benchmark, cuda, GCN (hpcgnn 1 rank, PyG GCNConv)" $PY bench/epoch.py --device cuda \
    --arch gcn --dataset "$spec" --ranks 1 --epochs 10 --results "$out/gcn" --shards-root shards/gpu-epoch --profile
fi
if want network; then   # root: private network namespaces; the ranks share the node's GPU(s)
step "cluster-network benchmark, GPU ranks" $PY bench/network.py --device cuda --ranks ${NET_RANKS:-2 4} \
    --rates ${NET_RATES:-10 25 100 none shm} --schedules floor full quant2-all quant1-all@s1 \
    --epochs ${NET_EPOCHS:-50} --eval-every 50 --work "$out/network-runs" --out "$out/network-cuda"
fi
if want aware; then
    PY_AWARE=${PY_AWARE:-.venv-cuda/bin/python}
    step "info, CUDA-aware venv" $PY_AWARE -m hpcgnn info
    # the timed pair first (short), then the tests (the seven training cases take minutes)
    for aware in 0 1; do
        PY=$PY_AWARE MPIEXEC=$(dirname "$PY_AWARE")/mpiexec HPCGNN_CUDA_AWARE=$aware \
            step "Cora, 2 ranks, cuda, HPCGNN_CUDA_AWARE=$aware, CUDA-aware Open MPI" \
            train 2 shards/gpu-cora-2 cuda "cora-aware-$aware" --schedule configs/schedules/quant2-all.toml
    done
    step "CUDA-aware against staged: bytes and losses bit for bit, epoch times" $PY - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
runs = {a: [json.loads(l) for l in (Path(sys.argv[1]) / f"cora-aware-{a}" / "metrics.jsonl").read_text().splitlines()]
        for a in "01"}
for a, recs in runs.items():
    print(f"HPCGNN_CUDA_AWARE={a}: median epoch {1e3 * statistics.median(r['epoch_s'] for r in recs[1:]):.2f} ms, "
          f"median comm {1e3 * statistics.median(r['comm_s'] for r in recs[1:]):.2f} ms")
same = [(r0["loss"], r0["bytes_sent"]) == (r1["loss"], r1["bytes_sent"]) for r0, r1 in zip(runs["0"], runs["1"])]
print(f"{sum(same)} of {len(same)} epochs equal bit for bit")
sys.exit(0 if all(same) and len(same) == len(runs["0"]) else 1)
EOF
    HPCGNN_TEST_CUDA_OMPI_PYTHON=$PY_AWARE step "GPU exchange and staging tests, device buffers to MPI" \
        $PY_AWARE -m pytest -q -ra ${XDIST:-} tests/test_cuda_aware.py tests/test_comm_gpu.py tests/test_staging_gpu.py
fi
wait
fails=$(cat "$out/.failed" 2>/dev/null | wc -l)
echo; echo "gpu.sh: $fails step(s) failed"; cat "$out/.failed" 2>/dev/null
exit "$fails"
