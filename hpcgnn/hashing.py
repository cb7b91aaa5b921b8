"""The counter-based hashes every random draw of hpcgnn is made of (no hpcgnn imports: the codecs,
the exchange and the dropout all build on this module, and the Triton kernels of
``hpcgnn.kernels`` compute the same functions on the device).

- ``splitmix64`` / ``mix``: 64-bit SplitMix64 (Steele et al.) and a chain of it over a tuple of
  non-negative ints; Python ints, used once per exchange or layer to make a 32-bit key.
- ``hash32``: lowbias32 (C. Wellons) on int64 tensors holding values in ``[0, 2^32)``;
  ``hash32_`` the same in place; ``hash32_int`` on one Python int. The products wrap modulo
  2^64 in int64, whose low 32 bits are exact, so the masks after each product give the uint32
  arithmetic of the C and Triton kernels.
- Column seeds: ``col_seeds(n)`` = ``hash32((g * GOLDEN + COL_OFFSET) mod 2^32)``, the codecs'
  per-channel (and per channel pair) seeds; ``golden_hashes(n)`` = ``hash32((c * GOLDEN) mod
  2^32)``, the dropout's per-channel hashes.
"""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B1           # 2^32 / golden ratio, odd
COL_OFFSET = 0x7F4A7C15       # the codecs' column-seed offset
LOWBIAS_A, LOWBIAS_B = 0x7FEB352D, 0x846CA68B


def splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele et al.): a well-mixed 64-bit value of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def mix(*values: int) -> int:
    """Hash a tuple of non-negative ints into 63 bits (fits a signed int64 / torch seed)."""
    h = 0
    for v in values:
        h = splitmix64(h ^ (int(v) & M64))
    return h >> 1


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 values in ``[0, 2^32)``; a new tensor."""
    x = x ^ (x >> 16)
    x = (x * LOWBIAS_A) & M32
    x = x ^ (x >> 15)
    x = (x * LOWBIAS_B) & M32
    return x ^ (x >> 16)


def hash32_(x: torch.Tensor) -> torch.Tensor:
    """``hash32`` in place on ``x`` (int64, values in ``[0, 2^32)``); returns ``x``."""
    x ^= x >> 16
    x.mul_(LOWBIAS_A).bitwise_and_(M32)
    x ^= x >> 15
    x.mul_(LOWBIAS_B).bitwise_and_(M32)
    x ^= x >> 16
    return x


def hash32_int(v: int) -> int:
    """``hash32`` of one Python int (taken modulo 2^32)."""
    x = int(v) & M32
    x ^= x >> 16
    x = (x * LOWBIAS_A) & M32
    x ^= x >> 15
    x = (x * LOWBIAS_B) & M32
    return x ^ (x >> 16)


def col_seeds(n: int, device: torch.device | str) -> torch.Tensor:
    """``(n,)`` int64: ``hash32((g * GOLDEN + COL_OFFSET) mod 2^32)`` for ``g < n``."""
    g = torch.arange(n, dtype=torch.int64, device=device)
    return hash32((g * GOLDEN + COL_OFFSET) & M32)


def golden_hashes(n: int, device: torch.device | str) -> torch.Tensor:
    """``(n,)`` int64: ``hash32((c * GOLDEN) mod 2^32)`` for ``c < n``."""
    return hash32_(torch.arange(n, dtype=torch.int64, device=device) * GOLDEN & M32)
