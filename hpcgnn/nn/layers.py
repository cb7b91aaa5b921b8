"""GCN and GraphSAGE (mean) layers over a rank's ``LocalGraph`` and a propagation object
(``hpcgnn.nn.propagation``: the halo exchange, stale or not, or a CAGNET SpMM), and what every
layer shares (``HaloLayer``; GAT, on the same contract: ``hpcgnn.nn.gat``).

Shapes: input ``x`` ``(n_owned, F_in)`` -> output ``(n_owned, F_out)``; the halo rows
``(n_halo, w)`` arrive through the propagation. ``A (X W) = (A X) W``, so a layer may exchange
and aggregate its input (``w = F_in``, aggregate first) or its transformed features
(``w = F_out``, transform first); it picks the one that moves fewer rows x channels per step
(``choose_order``): the narrower, except that the first layer's input needs no gradient, so
aggregating it first costs no backward exchange and no backward sparse product.

Per layer: one forward exchange of ``sum(send_counts) * w * 4`` bytes (identity codec) and,
when the exchanged rows need a gradient, one backward exchange of the same size. A stale layer
(PipeGCN) always exchanges its input, ``w = F_in``.

On CPU ranks a layer that multiplies its dropped input by a weight at most 32 wide first
(transform first) does the dropout and the product in one C pass (``dropout_matmul``;
``sync_forward``, ``stale_forward``): the dropped rows are never written, and a stale layer
then transforms first wherever that is cheaper than aggregating its halo rows at the input
width (``LocalGraph.transform_first_with_halo(fused=True)``).
"""
from __future__ import annotations

import math
from typing import Callable, TypeVar

import torch
from torch import nn

from hpcgnn.config import ModelConfig
from hpcgnn.nn.dropout import (SparseRows, counter_dropout, dropout_matmul, fuses_matmul,
                               sparse_dropout_matmul, sparse_product)
from hpcgnn.nn.graph import LocalGraph
from hpcgnn.nn.step import LayerStep

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
    """What the layers share: the graph, the propagation object (``hpcgnn.nn.propagation``),
    the optional codec modules, dropout on the layer's input, and the stack of layers a model
    config builds (``stack``; GAT overrides it for its heads).

    ``forward(h, step)``: ``h`` ``(n_owned, F_in)`` is the layer's input before dropout (the
    previous layer's activation output, or the features). A synchronous step drops ``h`` out
    (counter-based, keyed by global id) and runs ``forward_owned``, whose exchange carries
    the dropped rows (or their transform). A stale training step (PipeGCN) exchanges ``h``
    itself, drops out ``[h; h_halo]`` on the receiving side with the same keys, and runs
    ``with_halo``: the same function of the same masks, so ``s = 0`` would give the same
    model."""

    activation = staticmethod(torch.relu)      # between layers (the model applies it)

    def __init__(self, graph: LocalGraph, prop, width: int, dropout: float = 0.0,
                 codec_modules: tuple[nn.Module | None, nn.Module | None] = (None, None),
                 sparse_input: bool = False, sync_width: int | None = None):
        super().__init__()
        self.graph, self.prop, self.p = graph, prop, dropout
        self.width = width                     # channels of the rows the exchange carries
        # whether the exchanged rows need a gradient, so that the layer has a backward exchange
        # (not where the first layer exchanges the features themselves); subclasses set it
        self.sends_gradient = True
        # channels of the rows a synchronous step exchanges: evaluation's exchange, also in a
        # stale layer, whose training steps exchange its input (``width``) instead
        self.sync_width = width if sync_width is None else sync_width
        self.encoder, self.decoder = codec_modules
        self.sparse_input = sparse_input       # the (constant) features: cache their non-zeros
        self._nz: dict[str, tuple] = {}

    @classmethod
    def stack(cls, cfg: ModelConfig, in_dim: int, num_classes: int) -> list[tuple[int, int, dict]]:
        """``(in_dim, out_dim, extra constructor kwargs)`` of every layer."""
        dims = [in_dim] + [cfg.hidden] * (cfg.layers - 1) + [num_classes]
        return [(a, b, {}) for a, b in zip(dims[:-1], dims[1:])]

    @staticmethod
    def wire_width(in_dim: int, out_dim: int, input_needs_grad: bool, **_) -> int:
        """Channels of the rows a synchronous layer exchanges (what its codec modules see)."""
        return choose_order(in_dim, out_dim, input_needs_grad)[1]

    # -- the step ---------------------------------------------------------------------------
    def forward(self, h: torch.Tensor, step: LayerStep) -> torch.Tensor:
        if step.training and self.prop.exchanges_input:
            halo = self.prop.input_halo(h, step.exchange)         # rows of t - s, not dropped
            return self.stale_forward(h, halo, step)
        if not step.training and self.prop.eval_kept:
            # evaluation on the features' halo rows kept on the rank: no exchange (no dropout
            # in evaluation, so this is ``with_halo`` in the cheaper order and product)
            return self.stale_forward(h, self.prop.kept_input_halo(h, step.epoch), step)
        return self.sync_forward(h, step)

    def sync_forward(self, h: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """A synchronous step on the input ``h`` before dropout: ``forward_owned`` of the
        dropped rows (a layer may fuse the dropout with its first product instead)."""
        return self.forward_owned(self.dropped(h, step, "owned"), step)

    def stale_forward(self, h: torch.Tensor, halo: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """The layer on ``h`` and given halo rows ``halo``, both before dropout (a stale step's
        rows of ``t - s``, or the features' kept rows): ``with_halo`` of the dropped rows (a
        layer may fuse the dropout with its product, as ``sync_forward``)."""
        point = self.prop.point                                   # progress of what is in flight
        return self.with_halo(point(self.dropped(h, step, "owned")),
                              point(self.dropped(halo, step, "halo")), step)

    def forward_owned(self, x: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """The layer on its dropped-out input ``x`` ``(n_owned, F_in)``, exchanging through
        ``self.prop`` with the step's settings."""
        raise NotImplementedError

    def with_halo(self, x: torch.Tensor, x_halo: torch.Tensor,
                  step: LayerStep | None = None) -> torch.Tensor:
        """The layer on ``x`` ``(n_owned, F_in)`` and given halo rows ``(n_halo, F_in)``, no
        exchange."""
        raise NotImplementedError

    def dropped(self, x: torch.Tensor, step: LayerStep, rows: str) -> torch.Tensor:
        """Counter-based dropout of the ``rows`` (``owned`` | ``halo``) rows ``x`` with the
        keys (seed, epoch, layer, global id, channel)."""
        if not step.training or self.p == 0.0 or x.numel() == 0:
            return x
        return counter_dropout(x, self._ids(rows), self.p, step.seed, step.epoch, step.layer,
                               True, self._sparse(x, rows))

    def dropped_matmul(self, x: torch.Tensor, step: LayerStep, rows: str,
                       w: torch.Tensor) -> torch.Tensor:
        """``dropped(x, step, rows) @ w``: for sparse features on CPU ranks a CSR product over
        the kept non-zeros (``hpcgnn.nn.dropout.sparse_dropout_matmul``), for a narrow ``w``
        one C pass (``dropout_matmul``), else the two steps."""
        nonzeros = self._sparse(x, rows)
        if sparse_product(x, nonzeros):
            return sparse_dropout_matmul(self._plan(x, rows, nonzeros), self._ids(rows), self.p,
                                         step.seed, step.epoch, step.layer, step.training, w)
        if not step.training or self.p == 0.0 or x.numel() == 0:
            return x @ w
        return dropout_matmul(x, self._ids(rows), self.p, step.seed, step.epoch, step.layer,
                              True, w, nonzeros)

    def product(self, x: torch.Tensor, step: LayerStep, out_width: int) -> dict | None:
        """How ``dropped_matmul`` of the owned rows ``x`` by a weight ``out_width`` wide runs,
        as the cost keywords of ``LocalGraph.transform_first_with_halo``: ``{"density": d}``
        (sparse features: a CSR product over the non-zeros, in training and evaluation),
        ``{"fused": True}`` (one C pass), or None (dropout, then the dense product)."""
        nonzeros = self._sparse(x, "owned")
        if sparse_product(x, nonzeros):
            return {"density": nonzeros[0].numel() / x.numel()}
        if step.training and fuses_matmul(x, out_width, self.p, True, nonzeros):
            return {"fused": True}
        return None

    def _ids(self, rows: str) -> torch.Tensor:
        """The global ids of the ``rows`` (``owned`` | ``halo``) rows."""
        n = self.graph.n_owned
        return self.graph.node_ids[:n] if rows == "owned" else self.graph.node_ids[n:]

    def _sparse(self, x: torch.Tensor, rows: str):
        """``_nonzeros`` of the constant input rows where they may be sparse, else None."""
        return self._nonzeros(x, rows) if self.sparse_input else None

    def _plan(self, x: torch.Tensor, rows: str, nonzeros) -> SparseRows:
        """``SparseRows`` of the constant sparse input rows ``x``, cached beside their
        non-zeros (``_nonzeros``)."""
        key = ("plan", rows)
        cached = self._nz.get(key)
        if cached is None or cached[0] is not nonzeros:
            self._nz[key] = cached = (nonzeros, SparseRows.of(x, nonzeros))
        return cached[1]

    def _nonzeros(self, x: torch.Tensor, rows: str):
        """Non-zeros of the constant input rows when they are sparse (bag-of-words), cached.
        Whether they are is decided on the owned rows and holds for the halo rows too (the same
        features), so halo rows that happen to be zeros — the benchmarks' no-exchange floor —
        take the same path as real ones."""
        key = (x.data_ptr(), x._version, tuple(x.shape))
        cached = self._nz.get(rows)
        if cached is None or cached[0] != key:
            owned = self._nz.get("owned")
            if rows == "halo" and owned is not None:
                sparse = owned[1] is not None
            else:
                sparse = bool(x.numel()) and float(torch.count_nonzero(x)) / x.numel() < 0.5
            self._nz[rows] = cached = (key, x.nonzero(as_tuple=True) if sparse else None)
        return cached[1]

    # -- exchanges ----------------------------------------------------------------------------
    def halo_rows(self, src: torch.Tensor, step: LayerStep, local: Callable[[], T]
                  ) -> tuple[T, torch.Tensor | None]:
        """``(local(), halo rows (n_halo, w) of src (n_owned, w))`` through the propagation."""
        return self.prop.halo_rows(src, step.exchange, local, (self.encoder, self.decoder))

    def propagate(self, src: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """``A @ [src_owned; src_halo]`` ``(n_owned, w)`` through the propagation."""
        return self.prop.aggregate(self.graph, src, step.exchange, (self.encoder, self.decoder))


class GCNLayer(HaloLayer):
    """``out = Â X W + b`` (Kipf & Welling), exchanging ``X`` or ``X W`` (``choose_order``)."""

    def __init__(self, in_dim: int, out_dim: int, graph: LocalGraph, prop,
                 input_needs_grad: bool = True, **common):
        transform_first, width = choose_order(in_dim, out_dim, input_needs_grad)
        super().__init__(graph, prop, in_dim if prop.exchanges_input else width, sync_width=width,
                         **common)
        self.transform_first = transform_first
        self.sends_gradient = transform_first or input_needs_grad
        self.weight = nn.Parameter(glorot_(torch.empty(in_dim, out_dim)))
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward_owned(self, x: torch.Tensor, step: LayerStep) -> torch.Tensor:
        if self.transform_first:
            return self.propagate(x @ self.weight, step) + self.bias
        return self.propagate(x, step) @ self.weight + self.bias

    def sync_forward(self, h: torch.Tensor, step: LayerStep) -> torch.Tensor:
        if self.transform_first and self.product(h, step, self.weight.shape[1]) is not None:
            return self.propagate(self.dropped_matmul(h, step, "owned", self.weight), step) + self.bias
        return super().sync_forward(h, step)

    def stale_forward(self, h: torch.Tensor, halo: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """Transform first with the dropout in the product (one C pass, or a CSR product of
        sparse features) where that is the cheaper order (``LocalGraph.transform_first_with_halo``
        with the product's costs), else ``with_halo``."""
        f_in, f_out = self.weight.shape
        cost = self.product(h, step, f_out)
        if cost is not None and self.graph.transform_first_with_halo(f_in, f_out, **cost):
            point, agg = self.prop.point, self.prop.aggregate_halo
            return agg(self.graph, point(self.dropped_matmul(h, step, "owned", self.weight)),
                       point(self.dropped_matmul(halo, step, "halo", self.weight))) + self.bias
        return super().stale_forward(h, halo, step)

    def from_aggregate(self, x: torch.Tensor, agg: torch.Tensor) -> torch.Tensor:
        """The layer given ``agg = Â [x; x_halo]`` ``(n_owned, F_in)`` (RETEXO: halo rows fixed,
        no exchange): ``agg W + b``; ``x`` is unused (Â holds the self-loop)."""
        return agg @ self.weight + self.bias

    def with_halo(self, x: torch.Tensor, x_halo: torch.Tensor,
                  step: LayerStep | None = None) -> torch.Tensor:
        """The layer on ``x`` ``(n_owned, F_in)`` and given halo rows ``(n_halo, F_in)``, no
        exchange, in the order of fewer multiply-adds (``transform_first_with_halo``; progress
        points between the products)."""
        point, agg = self.prop.point, self.prop.aggregate_halo
        if self.graph.transform_first_with_halo(*self.weight.shape):
            return agg(self.graph, point(x @ self.weight), point(x_halo @ self.weight)) + self.bias
        return point(self.from_aggregate(x, agg(self.graph, x, x_halo)))


class SAGELayer(HaloLayer):
    """``out_i = W_s x_i + W_n mean_{j->i} x_j + b`` (GraphSAGE-mean), exchanging ``X`` or
    ``X W_n`` (``choose_order``)."""

    def __init__(self, in_dim: int, out_dim: int, graph: LocalGraph, prop,
                 input_needs_grad: bool = True, **common):
        transform_first, width = choose_order(in_dim, out_dim, input_needs_grad)
        super().__init__(graph, prop, in_dim if prop.exchanges_input else width, sync_width=width,
                         **common)
        self.transform_first = transform_first
        self.sends_gradient = transform_first or input_needs_grad
        self.out_dim = out_dim
        # [W_s | W_n] as one parameter (one optimiser entry); used as two column views
        self.weight = nn.Parameter(torch.cat([glorot_(torch.empty(in_dim, out_dim)),
                                              glorot_(torch.empty(in_dim, out_dim))], dim=1))
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward_owned(self, x: torch.Tensor, step: LayerStep) -> torch.Tensor:
        w_self, w_neigh = self.weight[:, :self.out_dim], self.weight[:, self.out_dim:]
        # the neighbours' term first: ``x W_s`` made before it lived through the exchange, one
        # (n_owned, F_out) block more at the layer's peak (a + b = b + a: the same bits)
        if self.transform_first:                  # two GEMMs: no slice copies of (n, 2 F_out)
            return self.propagate(x @ w_neigh, step) + x @ w_self + self.bias
        return self.propagate(x, step) @ w_neigh + x @ w_self + self.bias

    def sync_forward(self, h: torch.Tensor, step: LayerStep) -> torch.Tensor:
        if self.transform_first and self.product(h, step, self.weight.shape[1]) is not None:
            y = self.dropped_matmul(h, step, "owned", self.weight)     # [x W_s | x W_n]
            return y[:, :self.out_dim] + self.propagate(y[:, self.out_dim:], step) + self.bias
        return super().sync_forward(h, step)

    def stale_forward(self, h: torch.Tensor, halo: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """As ``GCNLayer.stale_forward``: transform first with the dropout in the product
        where that is the cheaper order."""
        f_in = self.weight.shape[0]
        cost = self.product(h, step, self.weight.shape[1])
        if cost is not None and self.graph.transform_first_with_halo(f_in, self.out_dim, **cost):
            point, agg = self.prop.point, self.prop.aggregate_halo
            y = point(self.dropped_matmul(h, step, "owned", self.weight))   # [x W_s | x W_n]
            y_halo = point(self.dropped_matmul(halo, step, "halo", self.weight[:, self.out_dim:]))
            return y[:, :self.out_dim] + agg(self.graph, y[:, self.out_dim:], y_halo) + self.bias
        return super().stale_forward(h, halo, step)

    def from_aggregate(self, x: torch.Tensor, agg: torch.Tensor) -> torch.Tensor:
        """The layer given ``agg = mean_{j->i} x_j`` ``(n_owned, F_in)`` (RETEXO: halo rows
        fixed, no exchange): ``x W_s + agg W_n + b``."""
        return x @ self.weight[:, :self.out_dim] + agg @ self.weight[:, self.out_dim:] + self.bias

    def with_halo(self, x: torch.Tensor, x_halo: torch.Tensor,
                  step: LayerStep | None = None) -> torch.Tensor:
        """The layer on ``x`` ``(n_owned, F_in)`` and given halo rows ``(n_halo, F_in)``, no
        exchange, in the order of fewer multiply-adds (``transform_first_with_halo``; progress
        points between the products)."""
        point, agg = self.prop.point, self.prop.aggregate_halo
        if self.graph.transform_first_with_halo(self.weight.shape[0], self.out_dim):
            w_neigh = self.weight[:, self.out_dim:]
            return (point(x @ self.weight[:, :self.out_dim])
                    + agg(self.graph, point(x @ w_neigh), point(x_halo @ w_neigh)) + self.bias)
        return point(self.from_aggregate(x, agg(self.graph, x, x_halo)))
