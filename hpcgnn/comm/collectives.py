"""Thin typed wrappers around the collectives the trainer uses (all over ``ctx.comm``).

- ``allreduce_sum_``: one flat-buffer ``Allreduce`` (SUM) of a list of tensors, in place —
  the per-step gradient sum (``sum(numel) * 4`` bytes per rank).
- ``broadcast_params_``: rank 0's parameters to every rank (one flat ``Bcast``).
- ``bcast_bytes``: rank 0's bytes (the checkpoint at ``--resume`` and ``predict``) to every
  rank: the length, then the bytes.
- ``sum_float64`` / ``max_float64``: small reductions of Python numbers.

MPI counts are C ints, and ``[comm] max_message`` (``ctx.max_message``, 2^31 - 1 by default)
is the bytes one call may move: a buffer past it goes in consecutive pieces of at most that
many bytes, one call each, on every rank alike (every rank holds the same sizes). Each element
is summed or copied as in one call; on 3 or more ranks MPI may choose another reduction order
for a smaller call, so a split sum may round differently there (on 2 ranks it cannot).
"""
from __future__ import annotations

import numpy as np
import torch

from hpcgnn.comm import gpu
from hpcgnn.comm.context import CommContext


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def unflatten_into_(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def allreduce_sum_(ctx: CommContext, tensors: list[torch.Tensor]) -> int:
    """Sum ``tensors`` over all ranks in place with ONE Allreduce; returns bytes this rank sent."""
    flat = flatten(tensors).contiguous()
    if ctx.size > 1:
        from mpi4py import MPI
        staged = flat.device.type == "cuda" and not ctx.cuda_aware
        host = flat.cpu() if staged else flat                  # host copy without CUDA-aware MPI
        buf = gpu.to_mpi(host, ctx.cuda_aware)                  # syncs the stream first on GPU
        for lo, hi in pieces(flat.numel(), flat.element_size(), ctx.max_message):
            ctx.comm.Allreduce(MPI.IN_PLACE, buf[lo:hi], op=MPI.SUM)   # sum(numel) * 4 B in all
        flat = host.to(flat.device) if staged else flat
    unflatten_into_(flat, tensors)
    return flat.numel() * flat.element_size()


def broadcast_params_(ctx: CommContext, params: list[torch.Tensor]) -> None:
    """Make every rank's ``params`` equal rank 0's (one flat Bcast)."""
    if ctx.size == 1:
        return
    with torch.no_grad():
        flat = flatten([p.detach() for p in params]).contiguous().cpu()
        buf = flat.numpy()
        for lo, hi in pieces(flat.numel(), flat.element_size(), ctx.max_message):
            ctx.comm.Bcast(buf[lo:hi], root=0)
        unflatten_into_(flat.to(params[0].device), [p.data for p in params])


def pieces(n: int, itemsize: int, limit: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: ``n`` elements of ``itemsize`` bytes in consecutive pieces of at
    most ``limit`` bytes (at least one element each); none when ``n`` is 0."""
    per = max(1, limit // itemsize)
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)]


def bcast_bytes(ctx: CommContext, data: bytes | None) -> bytes | bytearray | None:
    """Rank 0's ``data`` (bytes, or None) on every rank (others pass anything): its length in
    one small Bcast, then the bytes in pieces of at most ``ctx.max_message``."""
    if ctx.size == 1:
        return data
    root = ctx.is_root
    size = np.array([-1 if not root or data is None else len(data)], dtype=np.int64)
    ctx.comm.Bcast(size, root=0)
    if size[0] < 0:
        return None
    out = data if root else bytearray(int(size[0]))
    buf = np.frombuffer(out, dtype=np.uint8)
    for lo, hi in pieces(int(size[0]), 1, ctx.max_message):
        ctx.comm.Bcast(buf[lo:hi], root=0)
    return out


def sum_float64(ctx: CommContext, values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over ranks (one small Allreduce)."""
    arr = np.asarray(values, dtype=np.float64)
    if ctx.size > 1:
        from mpi4py import MPI
        ctx.comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
    return arr.tolist()


def max_float64(ctx: CommContext, values: list[float]) -> list[float]:
    """Element-wise maximum of ``values`` over ranks (one small Allreduce)."""
    arr = np.asarray(values, dtype=np.float64)
    if ctx.size > 1:
        from mpi4py import MPI
        ctx.comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.MAX)
    return arr.tolist()


def gather_float64(ctx: CommContext, values: list[float]) -> np.ndarray | None:
    """Every rank's ``values`` on rank 0, one row per rank (``(size, len(values))``; one small
    Gather); None on the other ranks."""
    arr = np.asarray(values, dtype=np.float64)
    if ctx.size == 1:
        return arr[None, :]
    out = np.empty((ctx.size, arr.size), dtype=np.float64) if ctx.is_root else None
    ctx.comm.Gather(arr, out, root=0)
    return out
