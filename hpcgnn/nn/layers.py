"""GCN and GraphSAGE (mean) layers over a rank's ``LocalGraph`` and a ``HaloExchanger``.

Shapes: input ``x`` ``(n_owned, F_in)`` -> output ``(n_owned, F_out)``; the halo rows
``(n_halo, w)`` arrive through the exchanger. Each layer exchanges whichever of its input
(``w = F_in``, aggregate first) or transformed features (``w = F_out``, transform first) is
narrower: ``A (X W) = (A X) W``, so both orders give the same result.

Per layer: one forward exchange of ``sum(send_counts) * w * 4`` bytes (identity codec) and,
when the exchanged rows need a gradient, one backward exchange of the same size.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from hpcgnn.comm.exchange import HaloExchanger
from hpcgnn.nn.graph import LocalGraph


def glorot_(w: torch.Tensor) -> torch.Tensor:
    """Glorot/Xavier uniform, as Kipf & Welling and PyG initialise GCN weights."""
    bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
    with torch.no_grad():
        return w.uniform_(-bound, bound)


class HaloLayer(nn.Module):
    """What GCN and SAGE share: the graph, the exchanger, the optional codec modules, and
    ``propagate`` (aggregate owned rows while the halo rows travel)."""

    def __init__(self, graph: LocalGraph, exchanger: HaloExchanger, width: int,
                 codec_modules: tuple[nn.Module | None, nn.Module | None] = (None, None)):
        super().__init__()
        self.graph, self.exchanger, self.width = graph, exchanger, width
        self.encoder, self.decoder = codec_modules

    def propagate(self, src: torch.Tensor) -> torch.Tensor:
        """``A @ [src_owned; src_halo]`` ``(n_owned, w)``; the exchange overlaps ``owned @ src``."""
        handle = self.exchanger.start(src, self.encoder)      # Ialltoallv posted
        local = self.graph.owned @ src                        # no communication needed
        halo = self.exchanger.finish(handle, self.decoder)    # wait, decode
        return local + (self.graph.halo @ halo)


class GCNLayer(HaloLayer):
    """``out = Â X W + b`` (Kipf & Welling), exchanging ``X`` or ``X W``, the narrower."""

    def __init__(self, in_dim: int, out_dim: int, graph: LocalGraph, exchanger: HaloExchanger,
                 codec_modules=(None, None)):
        super().__init__(graph, exchanger, min(in_dim, out_dim), codec_modules)
        self.transform_first = out_dim <= in_dim
        self.weight = nn.Parameter(glorot_(torch.empty(in_dim, out_dim)))
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform_first:
            return self.propagate(x @ self.weight) + self.bias
        return self.propagate(x) @ self.weight + self.bias


class SAGELayer(HaloLayer):
    """``out_i = W_s x_i + W_n mean_{j->i} x_j + b`` (GraphSAGE-mean), exchanging ``X`` or
    ``X W_n``, the narrower."""

    def __init__(self, in_dim: int, out_dim: int, graph: LocalGraph, exchanger: HaloExchanger,
                 codec_modules=(None, None)):
        super().__init__(graph, exchanger, min(in_dim, out_dim), codec_modules)
        self.transform_first = out_dim <= in_dim
        self.out_dim = out_dim
        # [W_s | W_n] as one parameter (one optimiser entry); used as two column views
        self.weight = nn.Parameter(torch.cat([glorot_(torch.empty(in_dim, out_dim)),
                                              glorot_(torch.empty(in_dim, out_dim))], dim=1))
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_self, w_neigh = self.weight[:, :self.out_dim], self.weight[:, self.out_dim:]
        if self.transform_first:                  # two GEMMs: no slice copies of (n, 2 F_out)
            return x @ w_self + self.propagate(x @ w_neigh) + self.bias
        return x @ w_self + self.propagate(x) @ w_neigh + self.bias


LAYERS = {"gcn": GCNLayer, "sage": SAGELayer}
