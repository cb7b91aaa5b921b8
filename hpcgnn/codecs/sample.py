"""BNS-GCN boundary-node sampling: send a uniformly sampled fraction ``p`` of each peer block.

Both sides draw the same ``kept(rows, p) = min(rows, max(1, ceil(rows * p)))`` row indices from
the block's shared key, so one block costs ``inner.block_bytes(kept(rows, p), F)`` bytes —
derivable from the row count and ``p`` alone.

Renormalisation (our choice): the receiver places the kept rows back in their slots, scaled by
``rows / kept`` (the inverse inclusion probability), and leaves the dropped rows zero. The
aggregation downstream is a weighted *sum* over neighbours with weights fixed by the global
degrees, so scaling makes every neighbour sum an unbiased estimate of the full one without the
codec touching the graph (BNS-GCN's dropped nodes are absent; zero rows are absent from a sum).
The backward exchange samples with its own key, so its estimate is unbiased too.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from hpcgnn.codecs.base import IDENTITY, WireCodec
from hpcgnn.codecs.rng import blocks, generator, subkeys

_SALT_ROWS = 2


def kept_rows(rows: int, keep: float) -> int:
    """Rows of a block of ``rows`` that are sent at keep fraction ``keep`` (0 stays 0)."""
    if rows <= 0:
        return 0
    return min(rows, max(1, math.ceil(round(rows * keep, 9))))


class SampleCodec(WireCodec):
    """Keep ``kept_rows(rows, p)`` rows of every peer block; the inner codec encodes them."""

    name = "sample"

    def __init__(self, keep: float, inner: WireCodec = IDENTITY):
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"sample: keep fraction must be in (0, 1], got {keep}")
        self.keep, self.inner = float(keep), inner

    def __repr__(self) -> str:
        return f"sample({self.keep:g})" + ("" if self.inner is IDENTITY else f"+{self.inner!r}")

    def _kept_counts(self, counts: Sequence[int]) -> list[int]:
        return [kept_rows(int(c), self.keep) for c in counts]

    def block_bytes(self, rows: int, width: int) -> int:
        return self.inner.block_bytes(kept_rows(rows, self.keep), width)

    def _index(self, key: int, rows: int) -> torch.Tensor:
        """Sorted indices (within the block) of the kept rows."""
        perm = torch.randperm(rows, generator=generator(key))
        return perm[: kept_rows(rows, self.keep)].sort().values

    def _global_index(self, counts: Sequence[int], keys: Sequence[int]) -> torch.Tensor:
        row_keys = subkeys(keys, _SALT_ROWS)
        parts = [start + self._index(row_keys[peer], rows) for peer, start, rows in blocks(counts)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def encode(self, x: torch.Tensor, counts: Sequence[int], keys: Sequence[int]) -> torch.Tensor:
        picked = x[self._global_index(counts, keys)]
        return self.inner.encode(picked, self._kept_counts(counts), subkeys(keys, _SALT_ROWS + 1))

    def decode(self, buf: torch.Tensor, counts: Sequence[int], width: int,
               keys: Sequence[int]) -> torch.Tensor:
        kept_counts = self._kept_counts(counts)
        kept = self.inner.decode(buf, kept_counts, width, subkeys(keys, _SALT_ROWS + 1))
        scale = torch.repeat_interleave(
            torch.tensor([c / k if k else 0.0 for c, k in zip(counts, kept_counts)]),
            torch.tensor(kept_counts, dtype=torch.long))
        out = torch.zeros(int(sum(counts)), width, dtype=torch.float32)
        out[self._global_index(counts, keys)] = kept * scale[:, None]
        return out
