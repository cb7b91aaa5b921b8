"""GPU specifics of the exchange: which device a rank uses, whether the MPI library is
CUDA-aware (and how that was decided), and how buffers reach MPI (the device buffer itself
after a stream sync, or page-locked host staging buffers kept across epochs).

CUDA-awareness is decided by the first rule that applies (``cuda_awareness``):

1. ``HPCGNN_CUDA_AWARE`` = 1 or 0 (the user's word, for libraries whose answer is wrong);
2. Open MPI: ``MPIX_Query_cuda_support()`` (its ``cuda`` extension). Open MPI 5 answers at run
   time (is its CUDA accelerator component in use); Open MPI 4 answers what it was compiled
   with, and its run-time switch ``opal_cuda_support`` (an MCA parameter, on by default in a
   CUDA build; MPI_Init turns it off when libcuda.so.1 cannot be loaded) must be on too.
   ``opal_built_with_cuda_support`` is read for the report. Without the extension, Open MPI 4
   is its compile-time flag and the switch; Open MPI 5 is assumed not CUDA-aware;
3. MPICH family: ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)``, a run-time answer; Cray
   MPICH without it: ``MPICH_GPU_SUPPORT_ENABLED=1``;
4. otherwise no query is available: assumed not CUDA-aware.

Staging (no CUDA-aware MPI): a device buffer is copied into a page-locked host buffer on the
current stream and handed to MPI once an event recorded after the copy has completed (so every
kernel that wrote the buffer before, on that stream, has finished too); received bytes go back
to the device with an asynchronous copy whose event guards the host buffer's next use. The
buffers live in a ``PinnedPool``, one per exchange slot, reused across epochs.
"""
from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass

import torch

ENV_CUDA_AWARE = "HPCGNN_CUDA_AWARE"
MPIX_GPU_SUPPORT_CUDA = 0          # MPICH's enum MPIX_GPU_SUPPORT_CUDA


def pick_device(local_rank: int, want: str = "auto") -> torch.device:
    """The device of a rank: GPU ``local_rank % n_gpus`` when CUDA is there (or asked), else CPU."""
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device 'cuda' asked for, but {_why_no_cuda()}; or use --device cpu")
    count = torch.cuda.device_count()
    index = local_rank % count
    try:
        torch.cuda.set_device(index)
        torch.zeros(1, device=torch.device("cuda", index))   # makes the CUDA context: a busy or
    except RuntimeError as exc:                              # broken GPU fails here, not later
        raise RuntimeError(
            f"GPU {index} (node-local rank {local_rank} takes GPU {local_rank} mod {count}) cannot "
            f"be used: {str(exc).strip().splitlines()[0]}. Fix: nvidia-smi on this node shows "
            f"the GPUs' compute mode and processes (an Exclusive_Process GPU takes one process: "
            f"another job's, or a second rank where the node runs more ranks than it has GPUs); "
            f"a GPU in an error state needs another node; or use --device cpu") from exc
    return torch.device("cuda", index)


def _why_no_cuda() -> str:
    """Why torch sees no GPU, as far as this process can tell, with the fix."""
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build of "
                f"torch")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        return (f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from torch: ask the job for "
                f"GPUs (e.g. srun/sbatch --gpus-per-task=1) or unset it")
    named = ""
    if visible is not None:          # names GPUs, but torch sees none of them
        named = (f" with CUDA_VISIBLE_DEVICES={visible!r}: it may name GPUs this node does not "
                 f"have (nvidia-smi -L lists them; a job script that set it for another node), or "
                 f"the node has")
    return (f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) sees no GPU on "
            f"this node{named or ':'} no GPU, or no NVIDIA driver that supports CUDA "
            f"{torch.version.cuda} (nvidia-smi shows the driver's CUDA version)")


# -- is the MPI library CUDA-aware? ------------------------------------------------------------
@dataclass(frozen=True)
class CudaAwareness:
    """Whether device buffers may be handed to the MPI library, and how that was decided."""

    aware: bool
    how: str                      # the rule that decided, in words
    built: bool | None = None     # compiled with CUDA support (None: the library does not say)
    runtime: bool | None = None   # usable in this process (None: the library does not say)


def mpi_is_cuda_aware() -> bool:
    """Whether device pointers may be handed to this MPI library (``cuda_awareness().aware``)."""
    return cuda_awareness().aware


def cuda_awareness() -> CudaAwareness:
    """Decide CUDA-awareness (the rules in the module docstring). Initialises MPI if needed."""
    setting = os.environ.get(ENV_CUDA_AWARE)
    if setting is not None:
        return _from_setting(setting)
    name = mpi_library()
    libs = _loaded_mpi_libraries()
    if name.startswith("Open MPI"):
        return _open_mpi(name, libs)
    if re.search(r"MPICH|MVAPICH|Intel\(R\) MPI", name, re.IGNORECASE):
        return _mpich_family(name, libs)
    return _no_query(name)


def _from_setting(setting: str) -> CudaAwareness:
    value = setting.strip()
    if value not in ("0", "1"):
        raise RuntimeError(f"{ENV_CUDA_AWARE}={setting!r}: use 1 (hand device buffers to MPI) or 0 "
                           f"(stage them through host memory), or unset it to ask the MPI library")
    return CudaAwareness(value == "1", f"set by {ENV_CUDA_AWARE}={value} (the library was not asked)")


def _no_query(name: str) -> CudaAwareness:
    return CudaAwareness(False, f"{name} offers no CUDA query known here: assumed not CUDA-aware "
                                f"(set {ENV_CUDA_AWARE}=1 if it is)")


def _open_mpi(name: str, libs: list[ctypes.CDLL]) -> CudaAwareness:
    major = int(m.group(1)) if (m := re.search(r"v(\d+)\.", name)) else 0
    built = _flag(libs, "opal_built_with_cuda_support")
    query = _call(libs, "MPIX_Query_cuda_support")
    if query is None:
        if built is None:
            return _no_query(f"{name} (built without its cuda extension)")
        if major >= 5:          # decides at run time (its accelerator component): not askable here
            return CudaAwareness(False, f"no MPIX_Query_cuda_support (built without its cuda extension; "
                                        f"opal_built_with_cuda_support = {int(built)}): Open MPI "
                                        f"{major} decides at run time and cannot be asked: assumed "
                                        f"not CUDA-aware (set {ENV_CUDA_AWARE}=1 if it is)", built)
        switch = _flag(libs, "opal_cuda_support")
        return CudaAwareness(built and switch is not False,
                             f"opal_built_with_cuda_support = {int(built)} (no MPIX_Query_cuda_support: "
                             f"the library's compile-time flag); run-time switch opal_cuda_support = "
                             f"{_word(switch)}", built, switch)
    if major >= 5:
        return CudaAwareness(bool(query), f"MPIX_Query_cuda_support() = {query}: Open MPI {major}'s "
                                          f"run-time answer (its CUDA accelerator component is "
                                          f"{'in use' if query else 'not in use'})", built, bool(query))
    switch = _flag(libs, "opal_cuda_support")     # on in a CUDA build; off by --mca or no libcuda
    aware = bool(query) and switch is not False
    off = bool(query) and switch is False
    why = " (--mca opal_cuda_support 0, or libcuda.so.1 not loadable)" if off else ""
    return CudaAwareness(aware, f"MPIX_Query_cuda_support() = {query}: Open MPI {major}'s compile-time "
                                f"answer; run-time switch opal_cuda_support = {_word(switch)}{why}",
                         bool(query), switch)


def _mpich_family(name: str, libs: list[ctypes.CDLL]) -> CudaAwareness:
    fn = _symbol(libs, "MPIX_GPU_query_support")
    if fn is not None:
        flag = ctypes.c_int(0)
        if fn(ctypes.c_int(MPIX_GPU_SUPPORT_CUDA), ctypes.byref(flag)) == 0:
            on = bool(flag.value)
            return CudaAwareness(on, f"MPIX_GPU_query_support(CUDA) = {flag.value}: the library's "
                                     f"run-time answer", None, on)
    if "CRAY" in name.upper():
        on = os.environ.get("MPICH_GPU_SUPPORT_ENABLED", "0") == "1"
        return CudaAwareness(on, f"Cray MPICH without a query: MPICH_GPU_SUPPORT_ENABLED="
                                 f"{os.environ.get('MPICH_GPU_SUPPORT_ENABLED', '(unset)')}", None, on)
    return _no_query(name)


def _word(value: bool | None) -> str:
    return "unknown" if value is None else ("on" if value else "off")


def _loaded_mpi_libraries() -> list[ctypes.CDLL]:
    """libmpi and Open MPI's libopen-pal as mpi4py loaded them (from /proc/self/maps)."""
    from mpi4py import MPI  # noqa: F401  (loads libmpi)
    libs = []
    for path in mpi_library_paths():
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libs


def mpi_library_paths() -> list[str]:
    """Paths of the loaded libmpi / libmpich / libopen-pal (empty where /proc is not readable)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if ".so" in line and "/lib" in line}
    except OSError:
        return []
    names = ("libmpi.so", "libmpich", "libopen-pal.so")
    return sorted(p for p in paths if os.path.basename(p).startswith(names))


def _symbol(libs: list[ctypes.CDLL], name: str):
    for lib in libs:
        if hasattr(lib, name):
            return getattr(lib, name)
    return None


def _call(libs: list[ctypes.CDLL], name: str) -> int | None:
    fn = _symbol(libs, name)
    return None if fn is None else int(fn())


def _flag(libs: list[ctypes.CDLL], name: str) -> bool | None:
    """A C ``bool`` global of the library, or None where it is not exported."""
    for lib in libs:
        try:
            return bool(ctypes.c_bool.in_dll(lib, name).value)
        except ValueError:
            continue
    return None


# -- staging through page-locked host memory --------------------------------------------------
class PinnedPool:
    """Page-locked host buffers, one per slot (an exchange direction and its staging role),
    kept across epochs: a slot is reallocated only when a request outgrows it, and then to
    twice its size (at least the request), so a slowly growing exchange (a VARCO schedule
    relaxing its ratio) reallocates a few times, not every epoch. ``allocations`` counts them.

    A slot can be held by an asynchronous copy (``hold``): ``take`` waits for that copy's
    event before handing the buffer out again, so MPI never writes into host memory that a
    device copy is still reading. ``pinned=False`` gives ordinary host memory (a CPU-only torch
    has no page-locked allocator); the reuse rules are the same."""

    def __init__(self, pinned: bool = True):
        self.pinned = pinned
        self.allocations = 0
        self._buffers: dict[str, torch.Tensor] = {}
        self._holds: dict[str, torch.cuda.Event] = {}

    def take(self, slot: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``n`` elements for ``slot`` (a view of the slot's buffer), free to use."""
        event = self._holds.pop(slot, None)
        if event is not None:
            event.synchronize()                 # the last async copy out of this buffer is done
        buf = self._buffers.get(slot)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            size = max(n, 1, 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0)
            buf = torch.empty(size, dtype=dtype, pin_memory=self.pinned)
            self._buffers[slot] = buf
            self.allocations += 1
        return buf[:n]

    def hold(self, t: torch.Tensor, event: torch.cuda.Event) -> None:
        """Mark the slot whose buffer holds ``t`` busy until ``event`` (an async copy reading or
        writing ``t``) has completed; a ``t`` of no slot waits for the event at once."""
        ptr = t.untyped_storage().data_ptr()
        slot = next((k for k, b in self._buffers.items() if b.untyped_storage().data_ptr() == ptr), None)
        if slot is None:
            event.synchronize()
        else:
            self._holds[slot] = event

    def buffer(self, slot: str) -> torch.Tensor | None:
        """The whole buffer of ``slot`` (for checks), or None."""
        return self._buffers.get(slot)


def to_mpi(t: torch.Tensor, cuda_aware: bool, pool: PinnedPool | None = None, slot: str = ""):
    """A buffer MPI can read for tensor ``t``: a numpy view (CPU); the device tensor itself once
    the current stream has finished (CUDA-aware MPI); else a page-locked host copy (the pool's
    ``slot``; without a pool a one-off pageable copy)."""
    if t.device.type == "cpu":
        return t.numpy()
    stream = torch.cuda.current_stream(t.device)
    if cuda_aware:
        stream.synchronize()                    # MPI must see the kernels that wrote t finished
        return t
    if pool is None:
        return t.cpu().numpy()                  # synchronous: ordered after t's producers
    host = pool.take(slot, t.numel(), t.dtype)
    host.copy_(t, non_blocking=True)            # on t's stream: after the kernels that wrote t
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()                          # one wait covers the producers and the copy
    return host.numpy()


def recv_buffer(n: int, dtype: torch.dtype, device: torch.device, cuda_aware: bool,
                pool: PinnedPool | None = None, slot: str = "") -> tuple[torch.Tensor, object]:
    """(tensor, MPI buffer) to receive ``n`` elements: the same memory on CPU or CUDA-aware
    MPI, else a page-locked host tensor (the pool's ``slot``) to move with ``from_mpi``."""
    if device.type == "cpu":
        t = torch.empty(n, dtype=dtype)
        return t, t.numpy()
    if cuda_aware:
        t = torch.empty(n, dtype=dtype, device=device)
        return t, t
    host = (pool or PinnedPool()).take(slot, n, dtype)
    return host, host.numpy()


def from_mpi(t: torch.Tensor, device: torch.device, pool: PinnedPool | None = None) -> torch.Tensor:
    """The received tensor on ``device``. Staged: an asynchronous copy from page-locked memory
    on the current stream (the kernels that use the result are queued after it); the pool
    slot of ``t`` stays held until the copy has read it. Without a pool the copy is synchronous."""
    if t.device == device:
        return t
    if pool is None or not t.is_pinned():
        return t.to(device, non_blocking=False)
    out = t.to(device, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    pool.hold(t, done)
    return out


def mpi_library() -> str:
    """First line of ``MPI_Get_library_version`` (e.g. 'Open MPI v5.0.11, ...'); imports mpi4py,
    which initialises MPI (the CUDA queries need MPI_Init)."""
    from mpi4py import MPI
    return MPI.Get_library_version().strip().splitlines()[0].split(", package")[0]
