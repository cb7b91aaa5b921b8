"""VARCO's channel compressors: send ``k`` of a row's ``F`` channels, zero-pad back on receipt.

``truncate`` sends the first ``k`` channels; ``learned`` is ``truncate`` on the wire, applied to
the output of a learned linear encoder (``hpcgnn.codecs.learned``); ``random`` sends ``k``
channels drawn per peer block from the block's shared key. The ``k`` sent channels go through
an inner value codec (fp32 by default, or ``quant``), so one peer block of ``rows`` rows costs
``inner.block_bytes(rows, k)`` bytes — ``rows * k * 4`` with the fp32 inner codec.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from hpcgnn.codecs.base import IDENTITY, WireCodec
from hpcgnn.codecs.rng import blocks, generator, subkeys

_SALT_CHANNELS = 1


def channels_for(width: int, ratio: float) -> int:
    """VARCO's ``k = floor(F / r)``, guarded to ``1 <= k <= F`` (the authors' code sends nothing
    when ``F < r``)."""
    return max(1, min(width, math.floor(width / ratio + 1e-9)))


class TruncateCodec(WireCodec):
    """Send the first ``k`` channels of every row; the receiver zero-pads to the full width."""

    name = "truncate"

    def __init__(self, k: int, inner: WireCodec = IDENTITY):
        if k < 1:
            raise ValueError(f"{self.name}: k must be >= 1 channel, got {k}")
        self.k, self.inner = int(k), inner

    def __repr__(self) -> str:
        return f"{self.name}(k={self.k})+{self.inner!r}" if self.inner is not IDENTITY \
            else f"{self.name}(k={self.k})"

    def _k(self, width: int) -> int:
        if self.k > width:
            raise ValueError(f"{self.name}: k={self.k} channels exceed the row width {width}")
        return self.k

    def block_bytes(self, rows: int, width: int) -> int:
        return self.inner.block_bytes(rows, self._k(width))

    def encode(self, x: torch.Tensor, counts: Sequence[int], keys: Sequence[int]) -> torch.Tensor:
        # (sum(counts), F) -> (sum(counts), k): one slice, rows stay grouped by peer
        return self.inner.encode(x[:, : self._k(x.shape[1])], counts,
                                 subkeys(keys, _SALT_CHANNELS))

    def decode(self, buf: torch.Tensor, counts: Sequence[int], width: int,
               keys: Sequence[int]) -> torch.Tensor:
        k = self._k(width)
        kept = self.inner.decode(buf, counts, k, subkeys(keys, _SALT_CHANNELS))
        out = torch.zeros(kept.shape[0], width, dtype=torch.float32)
        out[:, :k] = kept
        return out


class LearnedCodec(TruncateCodec):
    """VARCO's ``learned`` codec on the wire: the first ``k`` outputs of the learned encoder.

    The encoder/decoder pair itself is a model submodule (``hpcgnn.codecs.learned``), applied by
    the trainer before ``encode`` and after ``decode``.
    """

    name = "learned"


class RandomChannelCodec(TruncateCodec):
    """Send ``k`` channels chosen per peer block with the block's shared key (VARCO ``random``).

    No rescaling on receipt (as in the authors' code): the missing channels are zeros.
    """

    name = "random"

    def _channels(self, key: int, width: int) -> torch.Tensor:
        perm = torch.randperm(width, generator=generator(key))
        return perm[: self._k(width)].sort().values

    def encode(self, x: torch.Tensor, counts: Sequence[int], keys: Sequence[int]) -> torch.Tensor:
        width = x.shape[1]
        picked = torch.empty(x.shape[0], self._k(width), dtype=x.dtype)
        for peer, start, rows in blocks(counts):
            picked[start:start + rows] = x[start:start + rows][:, self._channels(keys[peer], width)]
        return self.inner.encode(picked, counts, subkeys(keys, _SALT_CHANNELS))

    def decode(self, buf: torch.Tensor, counts: Sequence[int], width: int,
               keys: Sequence[int]) -> torch.Tensor:
        kept = self.inner.decode(buf, counts, self._k(width), subkeys(keys, _SALT_CHANNELS))
        out = torch.zeros(kept.shape[0], width, dtype=torch.float32)
        for peer, start, rows in blocks(counts):
            out[start:start + rows, self._channels(keys[peer], width)] = kept[start:start + rows]
        return out
