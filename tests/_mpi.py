"""Launch real MPI ranks from a test: the venv's ``mpiexec``, a timeout, no stdin.

Every multi-rank test goes through ``run_mpi`` so a deadlock fails the test (``timeout``)
instead of hanging CI, and so the Open MPI settings for this kind of machine (root allowed,
more ranks than cores, one thread per rank) live in one place.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MPIEXEC = Path(sys.executable).parent / "mpiexec"
REPO = Path(__file__).resolve().parent.parent

MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    "OMP_NUM_THREADS": "1",
}


def mpi_env(env: dict | None = None) -> dict:
    """The environment for an mpiexec launch: ours, then MPI_ENV, then the caller's ``env``."""
    out = dict(os.environ)
    out.update(MPI_ENV)
    out.update(env or {})
    return out


def mpi_command(nranks: int, args: list[str]) -> list[str]:
    """``mpiexec -n N --oversubscribe python -m mpi4py ARGS`` with the venv's interpreter."""
    return [str(MPIEXEC), "-n", str(nranks), "--oversubscribe",
            sys.executable, "-m", "mpi4py", *[str(a) for a in args]]


def run_mpi(nranks: int, args: list[str], timeout: float, env: dict | None = None,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``args`` (what follows ``python -m mpi4py``, e.g. ``["-m", "hpcgnn", "train", ...]``)
    on ``nranks`` ranks; returns the CompletedProcess (text stdout/stderr captured).

    Raises ``subprocess.TimeoutExpired`` when the job outlives ``timeout`` seconds.
    """
    return subprocess.run(mpi_command(nranks, args), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout,
                          env=mpi_env(env), cwd=str(cwd or REPO))
