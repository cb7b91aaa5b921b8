"""GCN and GraphSAGE (mean) layers over a rank's ``LocalGraph`` and a ``HaloExchanger``, and
what every layer shares (``HaloLayer``; GAT, on the same contract: ``hpcgnn.nn.gat``).

Shapes: input ``x`` ``(n_owned, F_in)`` -> output ``(n_owned, F_out)``; the halo rows
``(n_halo, w)`` arrive through the exchanger. ``A (X W) = (A X) W``, so a layer may exchange
and aggregate its input (``w = F_in``, aggregate first) or its transformed features
(``w = F_out``, transform first); it picks the one that moves fewer rows x channels per step
(``choose_order``): the narrower, except that the first layer's input needs no gradient, so
aggregating it first costs no backward exchange and no backward sparse product.

Per layer: one forward exchange of ``sum(send_counts) * w * 4`` bytes (identity codec) and,
when the exchanged rows need a gradient, one backward exchange of the same size.
"""
from __future__ import annotations

import math
from typing import Callable, TypeVar

import torch
from torch import nn

from hpcgnn.comm.exchange import HaloExchanger
from hpcgnn.config import ModelConfig
from hpcgnn.nn.graph import LocalGraph

T = TypeVar("T")


def glorot_(w: torch.Tensor) -> torch.Tensor:
    """Glorot/Xavier uniform, as Kipf & Welling and PyG initialise GCN weights."""
    bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
    with torch.no_grad():
        return w.uniform_(-bound, bound)


def choose_order(in_dim: int, out_dim: int, input_needs_grad: bool) -> tuple[bool, int]:
    """(transform_first, exchanged width): the order with the smaller forward + backward
    width (ties: transform first)."""
    aggregate_cost = in_dim * (2 if input_needs_grad else 1)
    transform_cost = out_dim * 2
    transform_first = transform_cost <= aggregate_cost
    return transform_first, (out_dim if transform_first else in_dim)


class HaloLayer(nn.Module):
    """What the layers share: the graph, the exchanger, the optional codec modules, the
    exchange of a tensor's boundary rows (``halo_rows``), and the stack of layers a model
    config builds (``stack``; GAT overrides it for its heads)."""

    activation = staticmethod(torch.relu)      # between layers (the model applies it)

    def __init__(self, graph: LocalGraph, exchanger: HaloExchanger, width: int,
                 codec_modules: tuple[nn.Module | None, nn.Module | None] = (None, None)):
        super().__init__()
        self.graph, self.exchanger, self.width = graph, exchanger, width
        self.encoder, self.decoder = codec_modules
        self.stale = None        # a StaleExchange when train.staleness >= 1 (hpcgnn.comm.stale)
        self.spmm = None         # a Spmm15D with parallel.algorithm = '1.5d' (hpcgnn.comm.cagnet)

    @classmethod
    def stack(cls, cfg: ModelConfig, in_dim: int, num_classes: int) -> list[tuple[int, int, dict]]:
        """``(in_dim, out_dim, extra constructor kwargs)`` of every layer."""
        dims = [in_dim] + [cfg.hidden] * (cfg.layers - 1) + [num_classes]
        return [(a, b, {}) for a, b in zip(dims[:-1], dims[1:])]

    @staticmethod
    def wire_width(in_dim: int, out_dim: int, input_needs_grad: bool, **_) -> int:
        """Channels of the rows the layer exchanges (what its codec modules see)."""
        return choose_order(in_dim, out_dim, input_needs_grad)[1]

    def halo_rows(self, src: torch.Tensor, local: Callable[[], T],
                  weight: torch.Tensor | None = None) -> tuple[T, torch.Tensor | None]:
        """``(local(), halo rows (n_halo, w) of src (n_owned, w))``; ``local()`` runs while the
        rows travel. On one rank the halo is None (no collective kept in the autograd graph).
        ``weight``: ``src = x @ weight`` for the layer's (dropped-out) input ``x``; None when
        ``src`` is ``x`` itself. A stale exchange needs it to send a late halo gradient back
        through the dropout mask of the epoch whose rows it belongs to (``hpcgnn.comm.stale``)."""
        if self.stale is not None and self.training and self.exchanger.ctx.size > 1:
            halo = self.stale.exchange(src, weight)           # rows posted s epochs ago
            return local(), halo
        handle = self.exchanger.start(src, self.encoder)      # (I)Alltoallv posted
        out = local()                                         # no communication needed
        halo = self.exchanger.finish(handle, self.decoder)    # wait, decode
        return out, (halo if self.exchanger.ctx.size > 1 else None)

    def propagate(self, src: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``A @ [src_owned; src_halo]`` ``(n_owned, w)``; the exchange overlaps ``owned @ src``."""
        if self.spmm is not None:                             # CAGNET 1.5D: A[i, :] @ H
            return self.spmm(src)
        local, halo = self.halo_rows(src, lambda: self.graph.owned @ src, weight)
        return local if halo is None else local + (self.graph.halo @ halo)


class GCNLayer(HaloLayer):
    """``out = Â X W + b`` (Kipf & Welling), exchanging ``X`` or ``X W`` (``choose_order``)."""

    def __init__(self, in_dim: int, out_dim: int, graph: LocalGraph, exchanger: HaloExchanger,
                 codec_modules=(None, None), input_needs_grad: bool = True):
        transform_first, width = choose_order(in_dim, out_dim, input_needs_grad)
        super().__init__(graph, exchanger, width, codec_modules)
        self.transform_first = transform_first
        self.weight = nn.Parameter(glorot_(torch.empty(in_dim, out_dim)))
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform_first:
            return self.propagate(x @ self.weight, self.weight) + self.bias
        return self.propagate(x) @ self.weight + self.bias

    def from_aggregate(self, x: torch.Tensor, agg: torch.Tensor) -> torch.Tensor:
        """The layer given ``agg = Â [x; x_halo]`` ``(n_owned, F_in)`` (RETEXO: halo rows fixed,
        no exchange): ``agg W + b``; ``x`` is unused (Â holds the self-loop)."""
        return agg @ self.weight + self.bias

    def with_halo(self, x: torch.Tensor, x_halo: torch.Tensor) -> torch.Tensor:
        """The layer on ``x`` ``(n_owned, F_in)`` and given halo rows ``(n_halo, F_in)``, no
        exchange; the narrower side is aggregated."""
        if self.weight.shape[1] < self.weight.shape[0]:
            return self.graph.aggregate(x @ self.weight, x_halo @ self.weight) + self.bias
        return self.from_aggregate(x, self.graph.aggregate(x, x_halo))


class SAGELayer(HaloLayer):
    """``out_i = W_s x_i + W_n mean_{j->i} x_j + b`` (GraphSAGE-mean), exchanging ``X`` or
    ``X W_n`` (``choose_order``)."""

    def __init__(self, in_dim: int, out_dim: int, graph: LocalGraph, exchanger: HaloExchanger,
                 codec_modules=(None, None), input_needs_grad: bool = True):
        transform_first, width = choose_order(in_dim, out_dim, input_needs_grad)
        super().__init__(graph, exchanger, width, codec_modules)
        self.transform_first = transform_first
        self.out_dim = out_dim
        # [W_s | W_n] as one parameter (one optimiser entry); used as two column views
        self.weight = nn.Parameter(torch.cat([glorot_(torch.empty(in_dim, out_dim)),
                                              glorot_(torch.empty(in_dim, out_dim))], dim=1))
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_self, w_neigh = self.weight[:, :self.out_dim], self.weight[:, self.out_dim:]
        if self.transform_first:                  # two GEMMs: no slice copies of (n, 2 F_out)
            return x @ w_self + self.propagate(x @ w_neigh, w_neigh) + self.bias
        return x @ w_self + self.propagate(x) @ w_neigh + self.bias

    def from_aggregate(self, x: torch.Tensor, agg: torch.Tensor) -> torch.Tensor:
        """The layer given ``agg = mean_{j->i} x_j`` ``(n_owned, F_in)`` (RETEXO: halo rows
        fixed, no exchange): ``x W_s + agg W_n + b``."""
        return x @ self.weight[:, :self.out_dim] + agg @ self.weight[:, self.out_dim:] + self.bias

    def with_halo(self, x: torch.Tensor, x_halo: torch.Tensor) -> torch.Tensor:
        """The layer on ``x`` ``(n_owned, F_in)`` and given halo rows ``(n_halo, F_in)``, no
        exchange; the narrower side is aggregated."""
        if self.out_dim < self.weight.shape[0]:
            w_neigh = self.weight[:, self.out_dim:]
            return (x @ self.weight[:, :self.out_dim]
                    + self.graph.aggregate(x @ w_neigh, x_halo @ w_neigh) + self.bias)
        return self.from_aggregate(x, self.graph.aggregate(x, x_halo))
