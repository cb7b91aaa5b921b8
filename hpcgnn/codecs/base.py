"""The seam between the halo exchange and the compressors.

A ``WireCodec`` turns the rows that one rank sends to its peers into bytes and back. It is pure
torch (no MPI): the exchange asks it how many bytes each peer's block takes, hands it the packed
send buffer, and ships the bytes with one ``Alltoallv``. Because ``block_bytes`` depends only on
the row count, the width and the codec's own settings, every rank derives every peer's byte
count from the plan and the schedule alone — no size handshake.

Shapes: ``x`` is the send buffer ``(sum(counts), width)``, rows grouped by peer in rank order;
``counts[p]`` is the number of rows of peer ``p``'s block. ``keys[p]`` is a seed shared by the
sender and the receiver of that block (for codecs that draw random numbers); both sides derive
it from (run seed, epoch, layer, direction, src, dst).
"""
from __future__ import annotations

from typing import Sequence

import torch


class WireCodec:
    """Identity codec: fp32 rows as they are. Subclasses override the three methods."""

    name = "none"

    def block_bytes(self, rows: int, width: int) -> int:
        """Exact bytes on the wire for one peer block of ``rows`` rows of ``width`` channels."""
        return rows * width * 4

    def encode(self, x: torch.Tensor, counts: Sequence[int], keys: Sequence[int]) -> torch.Tensor:
        """``(sum(counts), width)`` float -> uint8 ``[sum(block_bytes(c, width))]``, blocks in order."""
        return x.detach().to(torch.float32).contiguous().view(torch.uint8).reshape(-1)

    def decode(self, buf: torch.Tensor, counts: Sequence[int], width: int,
               keys: Sequence[int]) -> torch.Tensor:
        """uint8 blocks -> ``(sum(counts), width)`` float32, the inverse (or estimate) of encode."""
        return buf.view(torch.float32).reshape(-1, width)

    def byte_counts(self, counts: Sequence[int], width: int) -> list[int]:
        """Per-peer byte counts for the Alltoallv."""
        return [self.block_bytes(int(c), width) if c else 0 for c in counts]


IDENTITY = WireCodec()


class CompressionPolicy:
    """What each halo exchange does at a given epoch and layer. This base is full precision.

    ``hpcgnn.schedule.load_schedule(path)`` returns a subclass built from a schedule file. The
    trainer asks it, every epoch and layer, for the ratio (for the metrics) and for the forward
    and backward codecs; evaluation always uses ``IDENTITY``. A policy may also give a layer a
    learned encoder/decoder pair (VARCO's ``learned`` codec): the model registers them as
    submodules, so their gradients are all-reduced and stepped with the model's, applies the
    encoder to the rows it sends before ``encode`` and the decoder to the halo rows after
    ``decode``.
    """

    def bind(self, epochs: int, num_layers: int) -> "CompressionPolicy":
        """Tell the policy the run's epoch count and layer count; call once, before training.

        Schedules such as VARCO's ``linear`` need the total number of epochs ``T`` (the authors'
        formula divides by ``T - 2``), and per-layer overrides are checked against the layer
        count here, so a bad schedule fails before any rank communicates. Returns the policy
        (this base needs nothing and returns itself).
        """
        return self

    def ratio(self, epoch: int, layer: int, num_layers: int) -> float:
        """Compression ratio (fp32 bytes / bytes sent) of ``layer``'s exchange at ``epoch``."""
        return 1.0

    def forward_codec(self, epoch: int, layer: int, num_layers: int, width: int) -> WireCodec:
        """Codec of the forward (activation) exchange."""
        return IDENTITY

    def backward_codec(self, epoch: int, layer: int, num_layers: int, width: int) -> WireCodec:
        """Codec of the backward (halo-gradient) exchange."""
        return IDENTITY

    def layer_modules(self, layer: int, width: int) -> tuple[torch.nn.Module | None,
                                                             torch.nn.Module | None]:
        """(encoder, decoder) applied around ``layer``'s exchange; ``(None, None)`` for none."""
        return None, None


FULL_PRECISION = CompressionPolicy()
