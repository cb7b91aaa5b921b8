"""Launch real MPI ranks from a test: the venv's ``mpiexec``, a timeout, no stdin.

Every multi-rank test goes through ``run_mpi`` so a deadlock fails the test (``timeout``)
instead of hanging CI, and so the settings for this kind of machine (root allowed, more ranks
than cores, one thread per rank) live in one place. The venv's ``mpiexec`` may be Open MPI's
(``bash env/setup.sh``) or MPICH's Hydra (``HPCGNN_MPI=mpich``): ``mpi_family()`` asks it
(``mpiexec --version``) and ``mpi_command`` passes only that family's flags — Open MPI needs
``--oversubscribe`` for more ranks than cores, Hydra oversubscribes by itself and rejects it.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

MPIEXEC = Path(sys.executable).parent / "mpiexec"
REPO = Path(__file__).resolve().parent.parent

MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    "OMP_NUM_THREADS": "1",
    # Open MPI's libfabric components (the PyPI wheel's ofi BTL and MTL) spend about 1 s of
    # MPI_Init probing for a fabric that one machine does not have (4 ranks: 1.7 s -> 0.5 s to
    # a first Barrier here); the ranks of a test talk through shared memory anyway
    "OMPI_MCA_btl": "^ofi",
    "OMPI_MCA_mtl": "^ofi",
}


def mpi_env(env: dict | None = None) -> dict:
    """The environment for an mpiexec launch: ours, then MPI_ENV, then the caller's ``env``."""
    out = dict(os.environ)
    out.update(MPI_ENV)
    out.update(env or {})
    return out


# The launcher flags each family needs here (more ranks than cores; root is allowed by MPI_ENV).
FAMILY_FLAGS = {"openmpi": ["--oversubscribe"], "mpich": []}


@functools.lru_cache(maxsize=None)
def mpi_family(mpiexec: str | os.PathLike = MPIEXEC) -> str:
    """'openmpi' or 'mpich' (MPICH's Hydra, also MVAPICH and Intel MPI), from
    ``mpiexec --version``; raises RuntimeError naming the launcher when it is neither."""
    try:
        out = subprocess.run([str(mpiexec), "--version"], capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL, env=mpi_env())
    except OSError as exc:
        raise RuntimeError(f"{mpiexec}: cannot run it ({exc}); make the venv with env/setup.sh") from exc
    text = out.stdout + out.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "Intel(R) MPI" in text:
        return "mpich"
    raise RuntimeError(f"{mpiexec} --version names neither Open MPI nor MPICH's Hydra:\n{text[:500]}")


# the libmpi soname of each family: a library built with MPI (PT-Scotch: Debian's is Open MPI's)
# is linked against one of them, mpi4py loads the venv's
LIBMPI = {"openmpi": "libmpi.so.40", "mpich": "libmpi.so.12"}


def other_mpi_of(library: str | os.PathLike) -> str | None:
    """The libmpi soname ``library`` is linked against when it is another family's than the
    venv's (Debian's PT-Scotch in a venv made with HPCGNN_MPI=mpich), else None."""
    data, ours = Path(os.path.realpath(library)).read_bytes(), LIBMPI[mpi_family()]
    if ours.encode() + b"\0" in data:
        return None
    return next((s for s in LIBMPI.values() if s.encode() + b"\0" in data), None)


def mpi_command(nranks: int, args: list[str]) -> list[str]:
    """``mpiexec -n N [family flags] python -m mpi4py ARGS`` with the venv's interpreter."""
    return [str(MPIEXEC), "-n", str(nranks), *FAMILY_FLAGS[mpi_family()],
            sys.executable, "-m", "mpi4py", *[str(a) for a in args]]


def run_mpi(nranks: int, args: list[str], timeout: float, env: dict | None = None,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``args`` (what follows ``python -m mpi4py``, e.g. ``["-m", "hpcgnn", "train", ...]``)
    on ``nranks`` ranks; returns the CompletedProcess (text stdout/stderr captured).

    Raises ``subprocess.TimeoutExpired`` when the job outlives ``timeout`` seconds.
    """
    for attempt in (1, 2):
        proc = subprocess.run(mpi_command(nranks, args), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout,
                              env=mpi_env(env), cwd=str(cwd or REPO))
        if not launcher_failed(proc) or attempt == 2:
            return proc
    return proc


LAUNCHER_FAILURES = ("The PMIx server's listener thread failed to start",)
"""What Open MPI's launcher (prterun) says when it fails before starting any rank: seen once in
about 900 launches of a CI run on a loaded 2-core machine (rc 213, nothing of ours ran). Such a
launch is tried once more; anything a rank did is never retried."""


LAUNCHER_RC = 213      # prterun's exit status when it failed before starting any rank


def start_until(start: Callable[[], subprocess.Popen], ready: Callable[[], bool],
                timeout: float = 90, poll: float = 0.1) -> subprocess.Popen:
    """A background job: ``start()`` it and wait until ``ready()``; one whose launcher failed
    before any rank ran (exit ``LAUNCHER_RC`` before it was ready: ``LAUNCHER_FAILURES``; a
    background job's output is not read here) is started once more, as ``run_mpi`` does.
    ``ready`` is asked every ``poll`` seconds. Returns the running job; AssertionError when it
    ended early otherwise, or timed out."""
    proc = start()
    for attempt in (1, 2):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if ready():
                return proc
            if proc.poll() is not None:
                break
            time.sleep(poll)
        else:
            raise AssertionError(f"not ready after {timeout} s")
        if proc.returncode != LAUNCHER_RC or attempt == 2:
            raise AssertionError(f"job ended early (exit {proc.returncode}): {proc.communicate()[0]}")
        proc = start()
    return proc


def launcher_failed(proc: subprocess.CompletedProcess) -> bool:
    return (proc.returncode != 0 and not proc.stdout and "[rank " not in proc.stderr
            and any(m in proc.stderr for m in LAUNCHER_FAILURES))


def injected_command(nranks: int, module: str, fault: str, args: list[str]) -> list[str]:
    """``mpiexec`` running ``python -m MODULE ARGS`` on ``nranks`` ranks WITHOUT the mpi4py
    runner (as a user may), every rank first running ``fault``: Python code that injects a bug
    (e.g. an exception on one rank) into the real program. A ``module`` of the form
    ``pkg.mod:func`` is a console script's entry point (pyproject's ``[project.scripts]``),
    called as pip's generated script calls it: ``sys.exit(func())``."""
    if ":" in module:
        mod, func = module.split(":")
        code = (f"{fault}\nimport importlib, sys\nsys.argv = [{func!r}, *sys.argv[1:]]\n"
                f"sys.exit(importlib.import_module({mod!r}).{func}())\n")
    else:
        code = (f"{fault}\nimport runpy, sys\nsys.argv = [{module!r}, *sys.argv[1:]]\n"
                f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    return [str(MPIEXEC), "-n", str(nranks), *FAMILY_FLAGS[mpi_family()], sys.executable,
            "-c", code, *[str(a) for a in args]]


def run_injected(nranks: int, module: str, fault: str, args: list[str], timeout: float,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """``injected_command``'s job, run to its end (``env``: more environment variables)."""
    return subprocess.run(injected_command(nranks, module, fault, args), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, env=mpi_env(env),
                          cwd=str(REPO))
