"""Seeds shared by the two ends of one block of one exchange, derived without communicating.

``block_key(seed, epoch, layer, direction, src, dst)`` is the same integer on the sender and
the receiver, different for every block, epoch, layer and direction (0 = forward activations,
1 = backward gradients). The codecs' keys are made from ``mix`` in ``hpcgnn.codecs.rng`` (the
row sample's without the layer: one sample an epoch, as BNS-GCN). ``mix`` and ``splitmix64``
live in ``hpcgnn.hashing`` (re-exported here).
"""
from __future__ import annotations

from hpcgnn.hashing import M64, mix, splitmix64

__all__ = ["M64", "FORWARD", "BACKWARD", "splitmix64", "mix", "block_key"]
FORWARD, BACKWARD = 0, 1


def block_key(seed: int, epoch: int, layer: int, direction: int, src: int, dst: int) -> int:
    return mix(seed, epoch, layer, direction, src, dst)
