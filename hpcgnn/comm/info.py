"""What ``python -m hpcgnn info`` reports: the MPI library (and the file it was loaded from),
whether it is CUDA-aware and how that was decided (``gpu.cuda_awareness``), what Open MPI's
``ompi_info`` says it was built with, the devices and torch; started on several ranks (inside a
job, to check the binding), what each rank runs on (``rank_facts``)."""
from __future__ import annotations

import os
import re
import socket
import subprocess

import torch

from hpcgnn.comm import gpu

OMPI_INFO_TIMEOUT_S = 60
_BUILT = re.compile(r"^mca:\w+:base:param:(?:opal|mpi)_built_with_cuda_support:value:(\w+)$", re.M)


def describe() -> dict[str, str]:
    import mpi4py
    from mpi4py import MPI
    major, minor = MPI.Get_version()
    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    aware = gpu.cuda_awareness()
    libs = gpu.mpi_library_paths()
    built = aware.built
    if built is None:       # HPCGNN_CUDA_AWARE decided: what the library says is still shown
        built = gpu._flag(gpu._loaded_mpi_libraries(), "opal_built_with_cuda_support")
    out = {
        "mpi library": gpu.mpi_library(),
        "loaded from": ", ".join(libs) if libs else "(not visible in /proc/self/maps)",
        "mpi standard": f"{major}.{minor}",
        "mpi4py": mpi4py.__version__,
        "cuda-aware mpi": "yes" if aware.aware else "no",
        "decided by": aware.how,
        "built with cuda": _yes_no(built),
    }
    if gpu.mpi_library().startswith("Open MPI"):
        out["ompi_info"] = ompi_info_cuda(libs)
    out.update({
        "torch": torch.__version__,
        "cuda": f"{torch.version.cuda} available" if cuda else "not available",
        "devices": ", ".join(devices) if devices else "cpu only",
        "threads": str(torch.get_num_threads()),
        "world size": str(MPI.COMM_WORLD.Get_size()),
    })
    return out


def _yes_no(value: bool | None) -> str:
    return "unknown (the library does not say)" if value is None else ("yes" if value else "no")


def ompi_info_cuda(lib_paths: list[str]) -> str:
    """``opal_built_with_cuda_support`` as the ``ompi_info`` beside the loaded libmpi reports it
    (``ompi_info --parsable --all``), or why it could not be asked."""
    libmpi = next((p for p in lib_paths if os.path.basename(p).startswith("libmpi.so")), None)
    if libmpi is None:
        return "not asked (libmpi not found in /proc/self/maps)"
    tool = os.path.normpath(os.path.join(os.path.dirname(libmpi), "..", "bin", "ompi_info"))
    if not os.access(tool, os.X_OK):
        return f"not asked (no {tool})"
    try:
        proc = subprocess.run([tool, "--parsable", "--all"], capture_output=True, text=True,
                              timeout=OMPI_INFO_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{tool} failed: {exc}"
    m = _BUILT.search(proc.stdout)
    if m is None:
        return (f"{tool} --parsable --all names no built_with_cuda_support parameter "
                f"(rc {proc.returncode})")
    return f"built_with_cuda_support = {m.group(1)} ({tool} --parsable --all)"


def rank_facts() -> dict[str, str]:
    """Where this rank runs: its host, the CPUs it may run on, torch's threads, the GPUs it is
    given (``CUDA_VISIBLE_DEVICES``, as ``jobs/lib/bind.sh`` leaves it) and those torch sees."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:                      # not Linux
        cpus = os.cpu_count() or 0
    cuda = torch.cuda.is_available()
    seen = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    return {"host": socket.gethostname(), "cpus": str(cpus), "threads": str(torch.get_num_threads()),
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"),
            "devices": ", ".join(seen) if seen else "cpu only"}

