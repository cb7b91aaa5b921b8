"""The communication context: the one object made from ``MPI.COMM_WORLD`` and handed to
everything that communicates (no module-level rank/comm globals anywhere else).

``CommContext.from_world()`` is the only place in hpcgnn that touches ``MPI.COMM_WORLD``.
"""
from __future__ import annotations

from dataclasses import dataclass

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

    @classmethod
    def from_world(cls, device: str = "auto") -> "CommContext":
        """Build the context from ``MPI.COMM_WORLD``; ``device``: auto | cpu | cuda."""
        from mpi4py import MPI
        world = MPI.COMM_WORLD
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        local_rank, local_size = node.Get_rank(), node.Get_size()
        node.Free()
        dev = gpu.pick_device(local_rank, device)
        aware = dev.type == "cuda" and gpu.mpi_is_cuda_aware()
        level = MPI.Query_thread()
        if dev.type == "cuda" and level < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                f"MPI granted thread level {level} (< MPI_THREAD_SERIALIZED); on a GPU, autograd "
                f"runs the backward halo exchange on its device thread. Launch with "
                f"MPI4PY_RC_THREAD_LEVEL=multiple (or serialized), or use --device cpu")
        return cls(comm=world, rank=world.Get_rank(), size=world.Get_size(),
                   local_rank=local_rank, local_size=local_size, device=dev, cuda_aware=aware,
                   thread_level=level)

    @property
    def is_root(self) -> bool:
        return self.rank == 0
