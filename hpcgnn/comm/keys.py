"""Seeds shared by the two ends of one block of one exchange, derived without communicating.

``block_key(seed, epoch, layer, direction, src, dst)`` is the same integer on the sender and
the receiver, different for every block, epoch, layer and direction (0 = forward activations,
1 = backward gradients). Codecs that draw random numbers (stochastic rounding, random channels,
row sampling) seed with it, so both ends agree on what was drawn.
"""
from __future__ import annotations

M64 = (1 << 64) - 1
FORWARD, BACKWARD = 0, 1


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


def block_key(seed: int, epoch: int, layer: int, direction: int, src: int, dst: int) -> int:
    return mix(seed, epoch, layer, direction, src, dst)
