"""GPU specifics of the exchange: which device a rank uses, whether the MPI library is
CUDA-aware, and how buffers reach MPI (directly after a stream sync, or through pinned host
staging buffers).

CUDA-awareness is detected in this order: the ``HPCGNN_CUDA_AWARE`` setting (0/1), Open MPI's
``MPIX_Query_cuda_support`` extension, MPICH's ``MPIX_GPU_query_support``; otherwise False.
"""
from __future__ import annotations

import ctypes
import os

import torch

ENV_CUDA_AWARE = "HPCGNN_CUDA_AWARE"


def pick_device(local_rank: int, want: str = "auto") -> torch.device:
    """The device of a rank: GPU ``local_rank % n_gpus`` when CUDA is there (or asked), else CPU."""
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' asked for, but torch sees no CUDA device; "
                           "use --device cpu or install a CUDA build of torch")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def mpi_is_cuda_aware() -> bool:
    """Whether device pointers may be handed to this MPI library."""
    setting = os.environ.get(ENV_CUDA_AWARE)
    if setting is not None:
        return setting.strip() == "1"
    lib = _libmpi()
    if lib is None:
        return False
    if hasattr(lib, "MPIX_Query_cuda_support"):          # Open MPI extension
        return bool(lib.MPIX_Query_cuda_support())
    if hasattr(lib, "MPIX_GPU_query_support"):           # MPICH >= 4
        flag = ctypes.c_int(0)
        return lib.MPIX_GPU_query_support(0, ctypes.byref(flag)) == 0 and bool(flag.value)
    return False


def _libmpi() -> ctypes.CDLL | None:
    """The MPI shared library mpi4py loaded (found in /proc/self/maps), or None."""
    from mpi4py import MPI  # noqa: F401  (loads libmpi)
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(("libmpi.so", "libmpich")):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def to_mpi(t: torch.Tensor, cuda_aware: bool, pinned: dict | None = None, slot: str = ""):
    """A buffer MPI can read for tensor ``t``: a numpy view (CPU), the device tensor itself
    after a stream sync (CUDA-aware MPI), or a pinned host copy (``pinned[slot]`` reused)."""
    if t.device.type == "cpu":
        return t.numpy()
    torch.cuda.current_stream(t.device).synchronize()   # MPI must see finished kernels
    if cuda_aware:
        return t
    host = _pinned(pinned, slot, t)
    host.copy_(t)
    return host.numpy()


def recv_buffer(n: int, dtype: torch.dtype, device: torch.device, cuda_aware: bool,
                pinned: dict | None = None, slot: str = "") -> tuple[torch.Tensor, object]:
    """(tensor, MPI buffer) to receive ``n`` elements: the same memory on CPU or CUDA-aware
    MPI, else a pinned host tensor to be copied to ``device`` with ``from_mpi``."""
    if device.type == "cpu":
        t = torch.empty(n, dtype=dtype)
        return t, t.numpy()
    if cuda_aware:
        t = torch.empty(n, dtype=dtype, device=device)
        return t, t
    host = _pinned(pinned, slot, torch.empty(0, dtype=dtype), n)
    return host, host.numpy()


def from_mpi(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The received tensor on ``device`` (a copy from pinned host memory when staged)."""
    if t.device == device:
        return t
    return t.to(device, non_blocking=False)


def _pinned(cache: dict | None, slot: str, like: torch.Tensor, n: int | None = None) -> torch.Tensor:
    n = like.numel() if n is None else n
    buf = None if cache is None else cache.get(slot)
    if buf is None or buf.numel() < n or buf.dtype != like.dtype:
        buf = torch.empty(max(n, 1), dtype=like.dtype, pin_memory=True)
        if cache is not None:
            cache[slot] = buf
    return buf[:n]
