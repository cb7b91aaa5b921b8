"""Every rank holds a copy of the weights and steps it with the same summed gradient, so the
copies stay equal bit for bit only while every rank's optimizer rounds alike. Ranks on other
devices (``--device auto`` over GPU and CPU nodes) or other kernels (CPU instruction sets whose
builds fuse a multiply-add differently) may not: the copies then drift apart, each rank computes
its part of the forward with other weights, and what trains is a mix that no checkpoint (rank
0's copy) describes.

So each epoch every rank condenses its weights' bytes into a small digest ``d`` (``digest``: bits
of their CRC-32; 0.6 ms for a million weights on the 2-core development machine, one timing
while other jobs ran) and
the epoch-end Allreduce (SUM) carries ``d`` and ``d^2`` beside its other figures: no
other message. The copies agree when ``P sum d^2 == (sum d)^2`` (Cauchy-Schwarz: equality only when every
``d`` is equal); the sums are integers below 2^53, exact in float64, for ``P`` below 2^13 at 20
bits, fewer bits beyond (``digest_bits``). Where they differ, rank 0 gathers the digests (one
small Gather, only then), says which ranks differ from it, and every rank takes rank 0's weights
(one Bcast), so that the run goes on as rank 0's copy, which is what its checkpoint holds.
"""
from __future__ import annotations

import math
import zlib

import torch

from hpcgnn.comm.collectives import broadcast_params_, gather_float64
from hpcgnn.comm.context import CommContext
from hpcgnn.log import get_logger


def digest_bits(ranks: int) -> int:
    """The digest's width: ``P * 2^(2 b) < 2^53`` keeps the SUM of ``d^2`` over ``P`` ranks exact."""
    return max(1, min(20, (53 - math.ceil(math.log2(ranks + 1))) // 2))


class ReplicaCheck:
    """The digest of a rank's weights, and what the ranks do when theirs differ."""

    def __init__(self, ctx: CommContext, params: list[torch.Tensor]):
        self.ctx, self.params = ctx, params
        self.bits = digest_bits(ctx.size)
        self.resyncs = 0                          # epochs whose copies differed

    def digest(self) -> int:
        """``bits`` bits of the CRC-32 of every parameter's bytes, in order (the same on two
        ranks, CPU or GPU, when their copies are equal bit for bit; a GPU rank copies its
        weights to the host for it: 4 MB for a million weights)."""
        crc = 0
        with torch.no_grad():
            for p in self.params:
                host = p.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
                crc = zlib.crc32(host.numpy(), crc)
        return crc & ((1 << self.bits) - 1)

    def figures(self) -> list[float]:
        """``[d, d^2]``: what this rank adds to the epoch-end SUM."""
        d = self.digest()
        return [float(d), float(d * d)]

    def agree(self, sums: list[float], epoch: int) -> None:
        """Every rank, with the SUMs of ``figures``: when the copies differ, rank 0 says which
        ranks' differ from its own (the first time) and every rank takes rank 0's weights."""
        s1, s2 = int(sums[0]), int(sums[1])
        if self.ctx.size == 1 or self.ctx.size * s2 == s1 * s1:
            return
        digests = gather_float64(self.ctx, [float(self.digest())])
        self.resyncs += 1
        if digests is not None and self.resyncs == 1:
            from hpcgnn.train.early import rank_list
            off = [r for r in range(self.ctx.size) if digests[r, 0] != digests[0, 0]]
            get_logger().warning(
                "epoch %d: the ranks' copies of the weights differ after the optimizer step "
                "(%s against rank 0): the ranks round Adam differently (other devices, or CPU "
                "kernels of other instruction sets); every rank now takes rank 0's weights at "
                "the end of each epoch where they differ (the checkpoint holds rank 0's). Give "
                "every rank the same kind of device and CPU to avoid it", epoch, rank_list(off))
        broadcast_params_(self.ctx, [p.data for p in self.params])
