"""Shared randomness for codecs: one ``torch.Generator`` per peer block, seeded by its key.

The exchange hands every codec one key per peer block, equal on the sender and the receiver.
A composite codec gives each stage its own sub-key (``subkeys(keys, salt)``) so that, say, the
rows a ``sample`` stage keeps and the noise a ``quant`` stage rounds with are independent.
"""
from __future__ import annotations

from typing import Sequence

import torch

_MASK63 = (1 << 63) - 1


def subkey(key: int, salt: int) -> int:
    """A key for one stage, derived from the block key (splitmix64-style mixing)."""
    z = (int(key) + 0x9E3779B97F4A7C15 * (salt + 1)) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK63


def subkeys(keys: Sequence[int], salt: int) -> list[int]:
    """``subkey`` of every block key."""
    return [subkey(k, salt) for k in keys]


def generator(key: int) -> torch.Generator:
    """A CPU generator seeded with ``key`` (the same stream on both sides of a block)."""
    g = torch.Generator()
    g.manual_seed(int(key) & _MASK63)
    return g


def blocks(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(peer, start_row, rows)`` of every non-empty block, in peer order."""
    out, start = [], 0
    for peer, c in enumerate(counts):
        c = int(c)
        if c:
            out.append((peer, start, c))
        start += c
    return out
