"""VARCO's learned compressor: a linear encoder ``F -> F`` whose first ``k`` outputs are sent
(``LearnedCodec`` on the wire) and a linear decoder ``F -> F`` applied to the zero-padded rows.

Both start as the identity, so at the first step the pair is exactly ``truncate`` (the model's
initial weights too: making the pair draws nothing from the global RNG) and every rank
holds the same parameters without a broadcast; the trainer registers them as model submodules,
so their gradients are all-reduced and stepped with the model's.

The pair is applied only around an exchange that compresses with it (``k < F``: the first ``k``
encoder outputs are a VARCO ``Linear(F, k)`` encoder, the decoder's first ``k`` columns its
``Linear(k, F)`` decoder), to the rows sent to peers only; at ratio 1 and in evaluation the halo
rows travel as they are (``hpcgnn.nn.propagation``; how this differs from SAR's pair, a
``Linear(F, k)`` + ``ReLU`` encoder at a fixed ``k``: ``docs/compression.md``).
"""
from __future__ import annotations

import torch


def identity_linear(width: int) -> torch.nn.Linear:
    """``Linear(width, width)`` initialised to the identity map. ``Linear``'s own random
    initialisation (overwritten here) runs on a forked RNG, so making the pair leaves the
    global RNG, hence the model's initial weights, as a ``truncate`` run has them."""
    with torch.random.fork_rng(devices=[]):
        lin = torch.nn.Linear(width, width)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(width))
        lin.bias.zero_()
    return lin


def learned_pair(width: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(encoder, decoder) for one layer's exchange of ``width``-channel rows."""
    return identity_linear(width), identity_linear(width)
