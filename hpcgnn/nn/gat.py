"""GAT (Veličković et al., ICLR 2018) over a rank's ``LocalGraph`` and a ``HaloExchanger``:
PyG's ``GATConv`` (v1) semantics, heads ``H``, ``C`` channels per head.

    h     = x W                                   (n, H*C), viewed (n, H, C)
    s_j   = <a_src[k], h_j[k]>,  d_i = <a_dst[k], h_i[k]>        per head k: (n, H)
    e_ij  = LeakyReLU_0.2(d_i + s_j)              every edge j -> i of an owned i, plus i -> i
    alpha = softmax over j of e_ij, per head      (scatter-max, exp, scatter-add; no Python loop)
    alpha = attention dropout (``dropout.edge_dropout``: keyed by both global ids and the head)
    out_i = concat_k (hidden layers) or mean_k (last layer) of sum_j alpha_ij h_j[k], + bias

Shapes: input ``x`` ``(n_owned, F_in)`` -> ``(n_owned, H*C)`` (concat) or ``(n_owned, C)`` (mean).
The edges are the shard's (no self-loops, no duplicates) plus one self-loop per owned node,
as ``GATConv(add_self_loops=True)``, kept in CSR order (by destination, then source). The sum
``sum_j alpha_ij h_j`` is, per head, a sparse product with the attention as the matrix's values
(``AttentionSum``; torch's CSR products: on CUDA cuSPARSE's SpMM forward, SpMM with the
transpose and SDDMM backward), so the messages ``alpha_ij h_j`` ``(E + n_owned, H, C)`` are
never materialised (PyG's ``GATConv`` materialises them). ``HPCGNN_GAT_SPMM=0`` asks for those
per-edge messages instead (same results to rounding; 2.5x slower on one CPU thread, 1.8x on an
H200).

**What is exchanged.** The attention of a halo source ``j`` needs ``h_j`` and ``s_j``. We send
``h_j`` only (width ``H*C``) and the receiver recomputes ``s_j = <a_src, h_j>`` from the rows it
received: uncompressed, that is exactly the sender's ``s_j``; with a lossy codec the attention
logit and the message of ``j`` then come from the same decoded row (consistent, as a neighbour
seen through the codec), a channel-selecting codec (``truncate``, ``random``) treats the row
like any other, and the backward is one exchange of ``dL/dh_j`` (the gradient through ``s_j``
folds into it on the receiver). Sending ``s_j`` as ``H`` extra columns would add ``H/(H*C)``
to the bytes and put the attention terms under the codec's channel selection.
As GCN's layers do (``choose_order``), a layer whose input needs no gradient (the first) and is
narrower than ``2 H C`` exchanges its input ``x_j`` instead (forward only) and the receiver
transforms the halo rows itself: ``h_j = x_j W``.

Codecs: truncate, random, learned and quant apply to the exchanged rows as for GCN. With a
``sample`` stage (BNS-GCN) on, the layer runs on the epoch's sampled graph, as BNS-GCN's code
runs GAT: the receiver draws which halo rows each peer sent from the shared block keys
(``HaloExchanger.received_rows``; nothing extra crosses the wire) and sets the logits of the
edges from the others to ``-inf`` (``attend``'s ``kept``), so each softmax runs over the
in-neighbours kept and the dropped rows add nothing to the sums nor receive a gradient; the
exchange runs the stage unscaled (``unscaled``: ``WireCodec.scaled = False``, forward and the
adjoint backward), since a ``rows / kept`` scale would scale the row's logit and message.
BNS-GCN's code scales the rows after the first layer and carries a TODO that GAT should not
(``get_send_size``); this follows the TODO.

Staleness (PipeGCN): a stale step exchanges the layer's input ``x`` (before dropout), drops out
``[x; x_halo]`` on the receiving side and computes ``h = [x; x_halo] W`` and the attention with
the current parameters (``stale_forward``). With a ``sample`` stage as well, the two compose: the
halo rows of epoch ``t`` were posted at ``t - s`` (``t`` in the warm-up) with that epoch's
sample, so the softmax keeps the edges of the rows that sample sent (``StalePropagation.
received_input_rows``: the settings the stale buffer holds for them, a checkpoint's after a
resume), unscaled, and their late gradients go back through the adjoint of that exchange (the
rows sent alone). Refused (``hpcgnn.combinations``) with ``train.smoothing``, whose rows
average several epochs' samples.

Per layer: one forward exchange of ``sum(send_counts) * w * 4`` bytes (identity codec), ``w =
H*C`` (or ``F_in``), and, when the exchanged rows need a gradient, one backward exchange of
the same size (through the exchanger's autograd functions, as for GCN and SAGE).
"""
from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from hpcgnn.config import ModelConfig
from hpcgnn.nn.dropout import edge_dropout
from hpcgnn.nn.graph import LocalGraph, csr, csr_offsets
from hpcgnn.nn.layers import HaloLayer, choose_order, glorot_
from hpcgnn.nn.step import LayerStep

NEGATIVE_SLOPE = 0.2


def edges_with_self_loops(graph: LocalGraph) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst, src) int64 ``(E + n_owned,)``: the in-edges of the owned rows and one self-loop per
    owned row, ``src`` indexing ``[owned; halo]`` rows, sorted by ``dst`` then ``src`` (CSR
    order). On the graph's device."""
    def coo(mat: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        counts = mat.crow_indices().diff()
        rows = torch.arange(counts.shape[0], device=counts.device).repeat_interleave(counts)
        return rows, mat.col_indices() + offset
    (d_own, s_own), (d_halo, s_halo) = coo(graph.owned.mat, 0), coo(graph.halo.mat, graph.n_owned)
    loop = torch.arange(graph.n_owned, device=d_own.device)
    dst, src = torch.cat([d_own, d_halo, loop]), torch.cat([s_own, s_halo, loop])
    order = torch.argsort(dst * (graph.n_owned + graph.n_halo) + src)
    return dst[order], src[order]


def unscaled(step: LayerStep) -> LayerStep:
    """``step`` with its exchange's ``sample`` stage unscaled (``WireCodec.scaled = False``,
    forward and the adjoint backward): a GAT layer removes the edges of the rows not sent
    from its softmax (``attend``'s ``kept``) rather than scaling the rows sent by ``rows /
    kept``."""
    fwd = step.exchange.forward
    if fwd.keep >= 1.0 or not fwd.scaled:
        return step
    return replace(step, exchange=replace(step.exchange, forward=replace(fwd, scaled=False)))


def use_spmm() -> bool:
    """Whether the attention sums run as sparse products (``AttentionSum``): yes, on every
    device, unless ``HPCGNN_GAT_SPMM=0`` asks for the per-edge messages."""
    return os.environ.get("HPCGNN_GAT_SPMM", "1") != "0"


class AttentionPattern:
    """The CSR structure of the attention ``(n_owned, n_owned + n_halo)`` and of its transpose,
    for edges in CSR order (``edges_with_self_loops``): built once per layer."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, n: int, m: int):
        # 32-bit indices where they fit (cuSPARSE's common case), else 64-bit
        small = max(n, m, dst.shape[0]) < 2 ** 31
        index = (lambda t: t.to(torch.int32)) if small else (lambda t: t)  # noqa: E731
        order_t = torch.argsort(src * n + dst)          # the transpose's CSR order
        self.shape, self.perm_t = (n, m), order_t
        self.crow, self.col = index(csr_offsets(dst, n)), index(src)
        self.crow_t, self.col_t = index(csr_offsets(src[order_t], m)), index(dst[order_t])

    def matrix(self, values: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """``(n, m)`` CSR with ``values`` ``(E,)`` in CSR order, or with ``transpose`` the
        transpose ``(m, n)`` with ``values`` in its order (``values.index_select(0, perm_t)``)."""
        if transpose:
            return csr(self.crow_t, self.col_t, values, self.shape[::-1])
        return csr(self.crow, self.col, values, self.shape)


class AttentionSum(torch.autograd.Function):
    """``out[i, k] = sum_j alpha[ij, k] h[j, k]`` ``(n, H, C)`` from ``alpha`` ``(E, H)`` (CSR
    order) and ``h`` ``(m, H, C)``: per head one SpMM forward; backward ``dh[:, k] = A_k^T
    g[:, k]`` (SpMM) and ``dalpha[ij, k] = <g[i, k], h[j, k]>`` (SDDMM, ``sampled_addmm``)."""

    @staticmethod
    def forward(ctx, alpha, h, pattern: AttentionPattern):
        ctx.pattern = pattern
        ctx.save_for_backward(alpha, h)
        vals, heads = alpha.t().contiguous(), h.transpose(0, 1).contiguous()   # (H, E), (H, m, C)
        return torch.stack([pattern.matrix(vals[k]) @ heads[k] for k in range(h.shape[1])], dim=1)

    @staticmethod
    def backward(ctx, g):
        alpha, h = ctx.saved_tensors
        pattern = ctx.pattern
        g = g.transpose(0, 1).contiguous()                  # (H, n, C): each head's rows once
        d_alpha = d_h = None
        if ctx.needs_input_grad[0]:
            zeros = pattern.matrix(alpha.new_zeros(alpha.shape[0]))
            heads = h.transpose(0, 1).contiguous()
            d_alpha = torch.stack([
                torch.sparse.sampled_addmm(zeros, g[k], heads[k].t(), beta=0.0).values()
                for k in range(h.shape[1])], dim=1)
        if ctx.needs_input_grad[1]:
            # one gather of (E, H) rows into the transpose's order: index_select, not a 1-D
            # alpha[perm] per head (the H200 profile of 2026-11-27: 15 such gathers an epoch,
            # 4.2 ms each on 10.5M edges)
            vals = alpha.index_select(0, pattern.perm_t).t().contiguous()
            d_h = torch.stack([pattern.matrix(vals[k], transpose=True) @ g[k]
                               for k in range(h.shape[1])], dim=1)
        return d_alpha, d_h, None


def edge_softmax(e: torch.Tensor, dst: torch.Tensor, n: int) -> torch.Tensor:
    """Softmax of ``e`` ``(E, H)`` over the edges of each ``dst`` row (``n`` rows, every row
    with at least one edge): the row max (no gradient: softmax ignores a shift) is subtracted
    before ``exp``."""
    index = dst[:, None].expand_as(e)
    with torch.no_grad():
        row_max = e.new_full((n, e.shape[1]), float("-inf")).scatter_reduce_(0, index, e, "amax")
    p = (e - row_max.index_select(0, dst)).exp()
    return p / e.new_zeros(n, e.shape[1]).index_add_(0, dst, p).index_select(0, dst)


class GATLayer(HaloLayer):
    """``out_i = ||_k (or mean_k) sum_{j in N(i) + i} alpha^k_ij (x_j W)^k + b`` (module doc)."""

    activation = staticmethod(F.elu)           # as the GAT paper and PyG's GAT example

    def __init__(self, in_dim: int, out_dim: int, graph: LocalGraph, prop,
                 input_needs_grad: bool = True, heads: int = 1, concat: bool = True,
                 attn_dropout: float = 0.0, **common):
        transform_first, width = choose_order(in_dim, heads * out_dim, input_needs_grad)
        super().__init__(graph, prop, in_dim if prop.exchanges_input else width, sync_width=width,
                         **common)
        self.transform_first, self.heads, self.out_dim = transform_first, heads, out_dim
        self.sends_gradient = transform_first or input_needs_grad
        self.concat, self.attn_dropout = concat, attn_dropout
        self.weight = nn.Parameter(glorot_(torch.empty(in_dim, heads * out_dim)))
        self.att_src = nn.Parameter(glorot_(torch.empty(heads, out_dim)))
        self.att_dst = nn.Parameter(glorot_(torch.empty(heads, out_dim)))
        self.bias = nn.Parameter(torch.zeros(heads * out_dim if concat else out_dim))
        dst, src = edges_with_self_loops(graph)
        self.register_buffer("dst", dst, persistent=False)
        self.register_buffer("src", src, persistent=False)
        self.pattern = (AttentionPattern(dst, src, graph.n_owned, graph.n_owned + graph.n_halo)
                        if use_spmm() else None)
        if attn_dropout and graph.node_ids is not None:   # the edges' global ids, once
            self.register_buffer("dst_id", graph.node_ids.index_select(0, dst), persistent=False)
            self.register_buffer("src_id", graph.node_ids.index_select(0, src), persistent=False)

    @classmethod
    def stack(cls, cfg: ModelConfig, in_dim: int, num_classes: int) -> list[tuple[int, int, dict]]:
        """Hidden layers: ``model.heads`` heads of ``model.hidden`` channels, concatenated; the
        last: ``model.out_heads`` heads of ``num_classes``, averaged (PyG's Cora GAT: 8 x 8, 1)."""
        hidden = {"heads": cfg.heads, "concat": True, "attn_dropout": cfg.attn_dropout}
        last = {"heads": cfg.out_heads, "concat": False, "attn_dropout": cfg.attn_dropout}
        ins = [in_dim] + [cfg.hidden * cfg.heads] * (cfg.layers - 1)
        outs = [(cfg.hidden, hidden)] * (cfg.layers - 1) + [(num_classes, last)]
        return [(a, b, kw) for a, (b, kw) in zip(ins, outs)]

    @staticmethod
    def wire_width(in_dim: int, out_dim: int, input_needs_grad: bool, heads: int = 1, **_) -> int:
        return choose_order(in_dim, heads * out_dim, input_needs_grad)[1]

    def forward_owned(self, x: torch.Tensor, step: LayerStep, src: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """``src``: ``x @ W`` where the caller has it (``sync_forward``'s product of the dropped
        rows; ``x`` is then not read: this layer transforms first)."""
        if src is None:
            src = x @ self.weight if self.transform_first else x
        step = unscaled(step)
        # one exchange: h (or x) of the boundary rows; the owned rows' transform overlaps it
        h, halo = self.halo_rows(src, step, lambda: src if self.transform_first else x @ self.weight)
        kept = None
        if halo is not None:
            h = torch.cat([h, halo if self.transform_first else halo @ self.weight])
            kept = self.prop.received_rows(step.exchange, src.shape[1])
        return self.output(self.attend(h.view(-1, self.heads, self.out_dim), step, kept))

    def sync_forward(self, h: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """Transforming first, the dropout in the product where it runs as one (sparse
        features' CSR product, or the fused C pass: ``HaloLayer.product``)."""
        if self.transform_first and self.product(h, step, self.weight.shape[1]) is not None:
            return self.forward_owned(h, step, self.dropped_matmul(h, step, "owned", self.weight))
        return super().sync_forward(h, step)

    def forward(self, h: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """``HaloLayer.forward`` with the ``sample`` stage unscaled (``unscaled``) on every
        path: synchronous, and stale, whose rows posted now and late gradients (the adjoint of
        the settings those rows were sent with) then carry no ``rows / kept`` scale either."""
        return super().forward(h, unscaled(step))

    def stale_forward(self, h: torch.Tensor, halo: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """``with_halo`` of the dropped rows (with the dropout in the product where it runs as
        one, ``HaloLayer.product``: GAT transforms every row first in any order), attending
        over the halo rows the stale exchange's ``sample`` stage sent at the epoch they were
        posted at (``received_input_rows``): the sampled graph of that epoch."""
        stale = step.training and self.prop.exchanges_input      # ``halo``: input_halo's rows
        kept = self.prop.received_input_rows(h.shape[1]) if stale else None
        point = self.prop.point
        if self.product(h, step, self.weight.shape[1]) is None:
            y = torch.cat([point(self.dropped(h, step, "owned")),
                           point(self.dropped(halo, step, "halo"))]) @ self.weight
        else:
            y = torch.cat([self.dropped_matmul(h, step, "owned", self.weight),
                           self.dropped_matmul(halo, step, "halo", self.weight)])
        return self.attended(point(y), step, kept)

    def with_halo(self, x: torch.Tensor, x_halo: torch.Tensor,
                  step: LayerStep | None = None) -> torch.Tensor:
        """The layer on ``x`` ``(n_owned, F_in)`` and given halo input rows ``(n_halo, F_in)``
        (every one attended), no exchange; progress points after the transform and the
        attention."""
        return self.attended(self.prop.point(torch.cat([x, x_halo]) @ self.weight), step)

    def attended(self, h: torch.Tensor, step: LayerStep | None,
                 kept: torch.Tensor | None = None) -> torch.Tensor:
        """The layer given every row transformed, ``h`` ``(n_owned + n_halo, H * C)``;
        ``kept`` as ``attend``'s."""
        return self.prop.point(self.output(self.attend(h.view(-1, self.heads, self.out_dim),
                                                       step, kept)))

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """``(n_owned, H, C)`` -> heads concatenated or averaged, plus the bias."""
        return (out.flatten(1) if self.concat else out.mean(dim=1)) + self.bias

    def attend(self, h: torch.Tensor, step: LayerStep,
               kept: torch.Tensor | None = None) -> torch.Tensor:
        """``(n_owned + n_halo, H, C)`` transformed rows -> ``(n_owned, H, C)`` attention sums.
        ``kept``: bool ``(n_halo,)``, the halo rows this step's ``sample`` stage delivered
        (None: all); the edges from the others leave the softmax and the sums (BNS-GCN's
        sampled graph)."""
        n = self.graph.n_owned
        s = (h * self.att_src).sum(dim=-1)                       # (n_owned + n_halo, H)
        d = (h[:n] * self.att_dst).sum(dim=-1)                   # (n_owned, H)
        # index_select, not h[idx]: its backward is an index_add_; advanced indexing's is an
        # index_put_ that sorts the edge list first (a radix sort per gather on CUDA)
        e = F.leaky_relu(s.index_select(0, self.src) + d.index_select(0, self.dst), NEGATIVE_SLOPE)
        if kept is not None:
            # -inf: exp gives an exact 0 (and no gradient); every row keeps its self-loop
            dropped = ~torch.cat([kept.new_ones(n), kept]).index_select(0, self.src)
            e = e.masked_fill(dropped[:, None], float("-inf"))
        alpha = edge_softmax(e, self.dst, n)                     # (E + n_owned, H)
        if step is not None and step.training and self.attn_dropout:
            alpha = edge_dropout(alpha, self.dst_id, self.src_id, self.attn_dropout, step.seed,
                                 step.epoch, step.layer, step.training)
        if self.pattern is not None:
            return AttentionSum.apply(alpha, h, self.pattern)
        return h.new_zeros(n, self.heads, self.out_dim).index_add_(
            0, self.dst, alpha.unsqueeze(-1) * h.index_select(0, self.src))
