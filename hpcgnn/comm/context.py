"""The communication context: the one object made from ``MPI.COMM_WORLD`` and handed to
everything that communicates (no module-level rank/comm globals anywhere else).

``CommContext.from_world()`` is the only place in hpcgnn that touches ``MPI.COMM_WORLD``.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

import numpy as np
import torch

from hpcgnn.comm import gpu
from hpcgnn.comm.gpu import mpi_library  # noqa: F401  (re-exported: the trainer records it)
from hpcgnn.comm.settings import INT_MAX


@dataclass(frozen=True)
class CommContext:
    """Rank, size, node-local rank (from a shared-memory split) and the device it maps to."""

    comm: object            # mpi4py.MPI.Comm
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    cuda_aware: bool        # device buffers may be handed to MPI directly
    thread_level: int = 0   # MPI.Query_thread(): CUDA autograd calls the backward exchange
                            # from its device thread, which needs THREAD_SERIALIZED or more
    max_message: int = INT_MAX  # bytes one MPI call may move ([comm] max_message): the trainer's
                                # Allreduce, its Bcasts and the checkpoint's go in pieces of it
    mixed_devices: tuple = ()   # every rank's (host, device type) where --device auto gave some
                                # ranks a GPU and others the CPU (the same on every rank); else ()

    @classmethod
    def from_world(cls, device: str = "auto") -> "CommContext":
        """Build the context from ``MPI.COMM_WORLD``; ``device``: auto | cpu | cuda. Every rank
        takes its device, then the ranks agree whether all got one and how many took a GPU (one
        tiny Allreduce): where any rank failed, every rank raises ``DeviceUnavailable`` with
        every rank's host and error, so that each can say which ranks failed and why, before
        any exchange; where some took a GPU and others the CPU (``--device auto`` on an
        allocation with nodes without GPUs), ``mixed_devices`` holds every rank's host and
        device type, for rank 0 to say so (``hpcgnn.train.early.device_mix``)."""
        from mpi4py import MPI
        world = MPI.COMM_WORLD
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        local_rank, local_size = node.Get_rank(), node.Get_size()
        node.Free()
        error = None
        try:
            dev, aware, level = _take_device(local_rank, device)
        except RuntimeError as exc:             # no GPU, a busy one, a bad HPCGNN_CUDA_AWARE, ...
            error = str(exc)
        counts = np.array([error is not None, error is None and dev.type == "cuda"], np.int64)
        world.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)      # (ranks failed, ranks on a GPU)
        if counts[0]:
            raise DeviceUnavailable(world.Get_rank(), world.Get_size(),
                                    world.allgather((socket.gethostname(), error)))
        mixed = ()
        if 0 < counts[1] < world.Get_size():
            mixed = tuple(world.allgather((socket.gethostname(), dev.type)))
        return cls(comm=world, rank=world.Get_rank(), size=world.Get_size(),
                   local_rank=local_rank, local_size=local_size, device=dev, cuda_aware=aware,
                   thread_level=level, mixed_devices=mixed)

    @property
    def is_root(self) -> bool:
        return self.rank == 0


class DeviceUnavailable(RuntimeError):
    """Raised on every rank when any rank could not take its device: ``failures`` holds every
    rank's ``(hostname, error or None)``, the same list on every rank."""

    def __init__(self, rank: int, size: int, failures: list[tuple[str, str | None]]):
        super().__init__("; ".join(f"rank {r} ({host}): {e}" for r, (host, e) in
                                   enumerate(failures) if e is not None))
        self.rank, self.size, self.failures = rank, size, failures


def _take_device(local_rank: int, device: str) -> tuple[torch.device, bool, int]:
    """This rank's (device, CUDA-aware MPI, MPI thread level); RuntimeError naming the fix
    where it cannot use the device asked for."""
    from mpi4py import MPI
    dev = gpu.pick_device(local_rank, device)
    aware = dev.type == "cuda" and gpu.mpi_is_cuda_aware()
    level = MPI.Query_thread()
    if dev.type == "cuda" and level < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            f"MPI granted thread level {level} (< MPI_THREAD_SERIALIZED); on a GPU, autograd "
            f"runs the backward halo exchange on its device thread. Launch with "
            f"MPI4PY_RC_THREAD_LEVEL=multiple (or serialized), or use --device cpu")
    return dev, aware, level
