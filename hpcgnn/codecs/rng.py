"""Counter-based randomness for the codecs: every random number is a hash of integers, drawn
in one batched call on the tensor's device — no generator objects, no loop over peers.

``hash32`` is lowbias32 (C. Wellons) on int64 tensors holding values in ``[0, 2^32)``, from
``hpcgnn.hashing`` (with ``mix`` and ``col_seeds``; re-exported here). The codecs use it so:

- **Block keys** ``(P,)`` int64: one per peer block of one exchange, equal on the sender and
  the receiver, two 32-bit keys in one: ``pack(row, channel)`` = ``row * 2^32 + channel`` (the
  high half as a signed int64). The *row key* ``hash32(rows(src, dst) ^ hash32(epoch))``,
  ``rows(src, dst) = mix(seed, src, dst)``, depends on the epoch and the pair alone: every
  layer's exchange of an epoch, forward and backward, keeps the same rows of a block, as
  BNS-GCN's reference code draws one boundary sample an epoch for all layers
  (GATECH-EIC/BNS-GCN ``train.py``: ``select_node`` once per epoch). The *channel key*
  ``hash32(channels(src, dst) ^ hash32(epoch))``, ``channels(src, dst) = mix(seed, layer, src,
  dst)``, also holds the layer: ``random`` draws its channels per layer. Both pair keys are made
  once per exchanger (``pair_keys``), so both ends agree on the draws without communicating.
- **Row scores** (``row_scores``): ``hash32(row_key[b] ^ salt ^ hash32(i))`` for row ``i`` of
  block ``b`` — the sample stage keeps the rows of smallest score in each block.
- **Channel scores** (``channel_scores``): ``hash32(channel_key[b] ^ salt ^ col(c))``.
- **Rounding noise** (``noise_u16``): sender-side only. Element ``(r, c)`` of an ``(R, F)``
  buffer gets the 16-bit half ``c % 2`` of ``hash32(hash32(key ^ hash32(r)) ^ col(c // 2))``,
  ``col(g) = hash32((g * 0x9E3779B1 + 0x7F4A7C15) mod 2^32)``. The C kernel
  (``hpcgnn/codecs/_native.c``) and the Triton kernels (``hpcgnn/kernels/codec.py``) compute
  the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from hpcgnn.hashing import M32, col_seeds, hash32, hash32_int, mix

__all__ = ["M32", "SALT_ROWS", "SALT_CHANNELS", "hash32", "hash32_int", "col_seeds", "pair_keys",
           "pack", "row_keys", "channel_keys", "epoch_keys", "noise_u16", "Blocks", "row_scores",
           "channel_scores"]
SALT_ROWS = 0x5A17E5
SALT_CHANNELS = 0xC4A22E


def pair_keys(seed: int, layer: int, src: int | None, dst: int | None, parts: int,
              device: torch.device) -> torch.Tensor:
    """``(parts,)`` packed pair keys (``pack(rows, channels)``, module docstring) of the pairs
    (src -> p) when ``dst`` is None, or (p -> dst); only the channel half holds ``layer``."""
    pairs = [(src if src is not None else p, dst if dst is not None else p) for p in range(parts)]
    rows = torch.tensor([mix(seed, s, d) & M32 for s, d in pairs], dtype=torch.int64)
    chans = torch.tensor([mix(seed, layer, s, d) & M32 for s, d in pairs], dtype=torch.int64)
    return pack(rows, chans).to(device)


def pack(rows: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """int64 ``rows * 2^32 + channels`` of two int64 tensors of 32-bit keys (the row key as the
    high half, two's complement: no overflow)."""
    high = torch.where(rows >= 1 << 31, rows - (1 << 32), rows)
    return high * (1 << 32) + channels


def row_keys(keys: torch.Tensor) -> torch.Tensor:
    """The 32-bit row keys (high halves) of packed block keys."""
    return (keys >> 32) & M32


def channel_keys(keys: torch.Tensor) -> torch.Tensor:
    """The 32-bit channel keys (low halves) of packed block keys."""
    return keys & M32


def epoch_keys(pairs: torch.Tensor, epoch: int) -> torch.Tensor:
    """The block keys of one exchange: each half ``hash32(pair ^ hash32(epoch))``."""
    e = hash32_int(epoch)
    return pack(hash32(row_keys(pairs) ^ e), hash32(channel_keys(pairs) ^ e))


def noise_u16(rows: int, width: int, key: int, device: torch.device) -> torch.Tensor:
    """``(rows, width)`` int64 in ``[0, 2^16)``: the rounding noise of a sender's buffer."""
    r = torch.arange(rows, dtype=torch.int64, device=device)
    row = hash32(hash32(r) ^ (int(key) & M32))
    h = hash32(row[:, None] ^ col_seeds(-(-width // 2), device)[None, :])
    return torch.stack([h & 0xFFFF, h >> 16], dim=2).reshape(rows, -1)[:, :width]


def kept_rows(rows: int, keep: float) -> int:
    """Rows of a block of ``rows`` that the sample stage sends at keep fraction ``keep``: the
    ``kept_rows`` rows of smallest ``row_scores`` (0 stays 0)."""
    if rows <= 0:
        return 0
    return min(rows, max(1, math.ceil(round(rows * keep, 9))))


@dataclass(frozen=True)
class Blocks:
    """The layout of a packed buffer: rows grouped by peer, ``counts[p]`` rows for peer ``p``.

    Made once per plan and direction; every tensor is on ``device``.
    """

    counts: tuple[int, ...]
    counts_t: torch.Tensor        # int64 (P,)
    starts_t: torch.Tensor        # int64 (P,) first row of each block
    block_of_row: torch.Tensor    # int64 (R,)
    row_in_block: torch.Tensor    # int64 (R,)
    # the last few selections drawn on these blocks (WireCodec.select, CPU): an exchange's
    # backward draws what its forward drew, with the same keys
    selections: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, counts: Sequence[int], device: torch.device | str = "cpu") -> "Blocks":
        counts = tuple(int(c) for c in counts)
        counts_t = torch.tensor(counts, dtype=torch.int64, device=device)
        starts = torch.cumsum(counts_t, 0) - counts_t
        rows = sum(counts)
        block = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t,
                                        output_size=rows)
        in_block = torch.arange(rows, dtype=torch.int64, device=device) - starts[block]
        return cls(counts, counts_t, starts, block, in_block)

    @property
    def rows(self) -> int:
        return int(self.block_of_row.shape[0])

    @property
    def device(self) -> torch.device:
        return self.counts_t.device


def row_scores(blocks: Blocks, keys: torch.Tensor) -> torch.Tensor:
    """``(R,)`` 32-bit score of every row, from its block's row key and its index in the block."""
    return hash32((row_keys(keys)[blocks.block_of_row] ^ SALT_ROWS) ^ hash32(blocks.row_in_block))


def channel_scores(keys: torch.Tensor, width: int) -> torch.Tensor:
    """``(P, width)`` 32-bit score of every channel of every block, from its channel key."""
    return hash32((channel_keys(keys)[:, None] ^ SALT_CHANNELS)
                  ^ col_seeds(width, keys.device)[None, :])
