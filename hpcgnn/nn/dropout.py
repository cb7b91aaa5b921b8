"""Dropout whose mask depends only on (seed, epoch, layer, global node id, channel).

A counter-based generator: the keep/drop bit of element ``(v, c)`` is a hash of those five
integers, so node ``v`` is dropped the same way whichever rank owns it — the same seed trains
the same model on 1, 2, 3 or 64 ranks.

Only the non-zero elements need a bit (a dropped zero is still zero), so for sparse input
features (bag-of-words, whose non-zeros the model finds once) the hash runs on the non-zeros
alone; other inputs are hashed in one C pass on CPU ranks (``hpcgnn.codecs.native``; the
backward hashes again rather than keep a mask; the torch path, in row chunks, where no C
compiler is: ``HPCGNN_NATIVE=0``). All paths give the
same result. On CUDA with Triton installed, one fused kernel (``hpcgnn.kernels.dropout``)
hashes, masks and multiplies in one pass, and its backward hashes again instead of saving a
mask; a sparse input that needs no gradient takes it too (a dropped zero is still zero).

``dropout_matmul`` is ``counter_dropout(x) @ W``: on CPU ranks, for a weight at most 32 wide,
one C pass that never writes the dropped rows (the layers' transform-first products).

``SparseRows`` and ``sparse_dropout_matmul``: the same product for sparse input features on CPU
ranks (at most ``SPARSE_PRODUCT_DENSITY`` non-zeros, e.g. bag-of-words): the masked non-zeros as
a CSR matrix times ``W`` (``nnz x m`` multiply-adds, not ``n x F x m``), and ``dW`` through the
transposed pattern built once. The same masks; the sums differ in rounding only.

``edge_dropout`` does the same for the attention coefficients of GAT: the bit of edge
``(dst, src)`` and head ``h`` is a hash of (seed, epoch, layer, dst's global id, src's global
id, head), whichever rank holds the edge.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcgnn.codecs import native
from hpcgnn.hashing import M32 as _M32, golden_hashes, hash32_ as _hash32, mix
from hpcgnn.kernels import use_triton
from hpcgnn.nn.graph import csr, csr_offsets

_CHUNK_ELEMS = 1 << 18          # CPU: a chunk's int64 temporaries stay in cache
_CHUNK_ELEMS_GPU = 1 << 26      # GPU: few launches (a chunk per 256k elements cost 2,500
                                # kernel launches per layer, 5x PyG's epoch on an H100)


def _node_key(seed: int, epoch: int, layer: int) -> int:
    return mix(seed, epoch, layer, 0xD209) & _M32


def _edge_key(seed: int, epoch: int, layer: int) -> int:
    return mix(seed, epoch, layer, 0xA77E) & _M32


def _fused(t: torch.Tensor):
    """The Triton kernels for ``t`` (ids, or float32 values, on CUDA with Triton), else None."""
    if not use_triton(t) or (t.is_floating_point() and t.dtype != torch.float32):
        return None
    from hpcgnn.kernels import dropout as kernels  # noqa: PLC0415  (imports triton)
    return kernels


def _row_col_hashes(global_id: torch.Tensor, width: int, seed: int, epoch: int, layer: int):
    """Per-row and per-channel 32-bit hashes; an element's bit mixes one of each."""
    rows = _hash32(_hash32(global_id.to(torch.int64) & _M32) ^ _node_key(seed, epoch, layer))
    return rows, golden_hashes(width, global_id.device)


def _threshold(p: float) -> int:
    """An element is kept where its 32-bit hash is at least this."""
    return int(p * 2**32)


def _keep(row_h: torch.Tensor, col_h: torch.Tensor, p: float) -> torch.Tensor:
    """Keep bits of elements whose row/col hashes are given (broadcasting)."""
    return _hash32(row_h ^ col_h) >= _threshold(p)


def keep_mask(global_id: torch.Tensor, width: int, p: float, seed: int, epoch: int,
              layer: int) -> torch.Tensor:
    """bool ``(len(global_id), width)``: True where the element is kept (probability 1 - p)."""
    if (fused := _fused(global_id)) is not None:
        return fused.keep_mask(global_id.to(torch.int64), width, p, _node_key(seed, epoch, layer))
    rows, cols = _row_col_hashes(global_id, width, seed, epoch, layer)
    if global_id.device.type == "cpu" and native.lib() is not None:
        return native.dropout_keep(rows, cols, _threshold(p))     # one C pass, same bits
    out = torch.empty(rows.shape[0], width, dtype=torch.bool, device=global_id.device)
    chunk = _CHUNK_ELEMS_GPU if global_id.device.type == "cuda" else _CHUNK_ELEMS
    step = max(1, chunk // max(width, 1))
    for a in range(0, rows.shape[0], step):
        out[a:a + step] = _keep(rows[a:a + step, None], cols[None, :], p)
    return out


def _scale_sparse(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, p: float,
                  nonzeros: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The dropout scale (0 or 1/(1-p)) at the non-zeros of ``x``, 0 elsewhere."""
    r, c = x.detach().nonzero(as_tuple=True) if nonzeros is None else nonzeros
    scale = torch.zeros_like(x, dtype=x.dtype)
    scale[r, c] = _keep(rows[r], cols[c], p).to(x.dtype) * (1.0 / (1.0 - p))
    return scale


def counter_dropout(x: torch.Tensor, global_id: torch.Tensor, p: float, seed: int, epoch: int,
                    layer: int, training: bool,
                    nonzeros: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Inverted dropout of ``x`` ``(n, F)`` with the counter-based mask of ``keep_mask``.

    ``nonzeros``: ``x.nonzero(as_tuple=True)`` when the caller knows it (the constant, sparse
    input features): only those elements are hashed. Otherwise every element is (searching a
    ReLU output for its non-zeros costs more than hashing it)."""
    if not training or p == 0.0 or x.numel() == 0:
        return x
    fused = _fused(x)
    if fused is not None and (nonzeros is None or not x.requires_grad):
        return fused.dropout(x, global_id.to(torch.int64), p, _node_key(seed, epoch, layer))
    if nonzeros is not None:
        rows, cols = _row_col_hashes(global_id, x.shape[1], seed, epoch, layer)
        return x * _scale_sparse(x, rows, cols, p, nonzeros)
    if native.takes(x):
        rows, cols = _row_col_hashes(global_id, x.shape[1], seed, epoch, layer)
        return _NativeMasked.apply(x, rows, cols, _threshold(p), 1.0 / (1.0 - p))
    return _Masked.apply(x, keep_mask(global_id, x.shape[1], p, seed, epoch, layer), 1.0 / (1.0 - p))


def fuses_matmul(x: torch.Tensor, out_width: int, p: float, training: bool,
                 nonzeros=None) -> bool:
    """Whether ``dropout_matmul`` runs as one C pass for ``x`` and a weight ``out_width`` wide:
    a dense float32 CPU ``x`` with the kernels built, dropout on, a narrow weight."""
    return (training and p > 0.0 and nonzeros is None and x.numel() > 0 and native.takes(x)
            and 0 < out_width <= native.MATMUL_MAX_WIDTH)


def dropout_matmul(x: torch.Tensor, global_id: torch.Tensor, p: float, seed: int, epoch: int,
                   layer: int, training: bool, w: torch.Tensor,
                   nonzeros: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``counter_dropout(x, ...) @ w`` ``(n, m)``. Where ``fuses_matmul`` (CPU ranks, ``m <=
    32``) one C pass hashes, masks and multiplies, so the dropped rows are never written, and
    its backward hashes again (``hpcgnn.codecs.native.dropout_matmul``; rows split between
    ``torch.get_num_threads()`` threads, the same bits for any count): MKL's product by a
    weight 8 wide ran at a seventh of its speed at 64 wide, and the dropped rows cost a pass of
    their own. Elsewhere the two steps as they are. The same masks either way; the sums
    differ in rounding only (each output is summed over the input channels in order)."""
    if not fuses_matmul(x, w.shape[1], p, training, nonzeros):
        return counter_dropout(x, global_id, p, seed, epoch, layer, training, nonzeros) @ w
    rows, cols = _row_col_hashes(global_id, x.shape[1], seed, epoch, layer)
    return _NativeDropMatmul.apply(x, w, rows, cols, _threshold(p), 1.0 / (1.0 - p))


# Non-zeros per element at or under which a sparse input's product by a weight runs as a CSR
# product: the crossover against MKL's dense product (forward + dW, one thread, 677-5000 rows,
# 128-1433 channels, weights 16 and 64 wide) was at 0.2-0.3; at 0.1 the CSR product took
# 0.24-0.56x the dense one's time, at 0.01 0.03-0.10x (Cora's features: 0.0127).
SPARSE_PRODUCT_DENSITY = 0.1


@dataclass(frozen=True)
class SparseRows:
    """The non-zeros of a constant ``(n, F)`` float32 CPU input (the features) in CSR order,
    with the transposed pattern for ``dW``: built once per input (``of``)."""

    rows: torch.Tensor      # int64 (nnz,): row of each non-zero, row-major order
    cols: torch.Tensor      # int64 (nnz,)
    values: torch.Tensor    # float32 (nnz,)
    crow: torch.Tensor      # int64 (n + 1,)
    order_t: torch.Tensor   # int64 (nnz,): the non-zeros in the transpose's CSR order
    crow_t: torch.Tensor    # int64 (F + 1,)
    col_t: torch.Tensor     # int64 (nnz,): rows[order_t]
    shape: tuple[int, int]

    @classmethod
    def of(cls, x: torch.Tensor, nonzeros: tuple[torch.Tensor, torch.Tensor]) -> "SparseRows":
        """From ``x`` and ``x.nonzero(as_tuple=True)`` (row-major, as torch returns it)."""
        r, c = nonzeros
        n, f = x.shape
        order_t = torch.argsort(c * n + r)
        return cls(rows=r, cols=c, values=x.detach()[r, c].contiguous(),
                   crow=csr_offsets(r, n), order_t=order_t, crow_t=csr_offsets(c[order_t], f),
                   col_t=r[order_t].contiguous(), shape=(n, f))

    def matrix(self, values: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """The CSR matrix ``(n, F)`` with ``values`` in CSR order, or its transpose ``(F, n)``."""
        if transpose:
            return csr(self.crow_t, self.col_t, values[self.order_t], self.shape[::-1])
        return csr(self.crow, self.cols, values, self.shape)


def sparse_product(x: torch.Tensor, nonzeros) -> bool:
    """Whether ``x`` with these non-zeros (None: dense) takes ``sparse_dropout_matmul``: a
    float32 CPU input with at most ``SPARSE_PRODUCT_DENSITY`` of its elements non-zero, needing
    no gradient."""
    return (nonzeros is not None and x.device.type == "cpu" and x.dtype == torch.float32
            and not x.requires_grad and x.numel() > 0
            and nonzeros[0].numel() <= SPARSE_PRODUCT_DENSITY * x.numel())


def sparse_dropout_matmul(plan: SparseRows, global_id: torch.Tensor, p: float, seed: int,
                          epoch: int, layer: int, training: bool, w: torch.Tensor) -> torch.Tensor:
    """``counter_dropout(x, ...) @ w`` for the sparse constant input of ``plan``: the kept
    non-zeros scaled by ``1 / (1 - p)`` (the bits of ``counter_dropout``'s sparse path), as a
    CSR matrix, times ``w``; ``dw`` through the transposed pattern. No gradient for ``x``."""
    values = plan.values
    if training and p > 0.0:
        rows, cols = _row_col_hashes(global_id, plan.shape[1], seed, epoch, layer)
        keep = _keep(rows[plan.rows], cols[plan.cols], p).to(values.dtype) * (1.0 / (1.0 - p))
        values = values * keep
    return _SparseMatmul.apply(values, w, plan)


class _SparseMatmul(torch.autograd.Function):
    """``csr(values) @ w`` ``(n, m)``; backward ``dw = csr^T @ g`` (the values need none)."""

    @staticmethod
    def forward(ctx, values, w, plan: SparseRows):
        ctx.plan = plan
        ctx.save_for_backward(values)
        return plan.matrix(values) @ w.detach()

    @staticmethod
    def backward(ctx, g):
        (values,) = ctx.saved_tensors
        dw = ctx.plan.matrix(values, transpose=True) @ g.contiguous() if ctx.needs_input_grad[1] else None
        return None, dw, None


def edge_keep_mask(dst_id: torch.Tensor, src_id: torch.Tensor, heads: int, p: float, seed: int,
                   epoch: int, layer: int) -> torch.Tensor:
    """bool ``(E, heads)``: True where the coefficient of edge ``src_id[e] -> dst_id[e]`` (global
    ids) and head is kept (probability 1 - p)."""
    key = _edge_key(seed, epoch, layer)
    if (fused := _fused(dst_id)) is not None:
        return fused.keep_mask(dst_id.to(torch.int64), heads, p, key, src=src_id.to(torch.int64))
    edge = _hash32(_hash32(_hash32(dst_id.to(torch.int64) & _M32) ^ key) ^ (src_id.to(torch.int64) & _M32))
    return _keep(edge[:, None], golden_hashes(heads, dst_id.device)[None, :], p)


def edge_dropout(alpha: torch.Tensor, dst_id: torch.Tensor, src_id: torch.Tensor, p: float,
                 seed: int, epoch: int, layer: int, training: bool) -> torch.Tensor:
    """Inverted dropout of the attention coefficients ``alpha`` ``(E, heads)`` with the mask of
    ``edge_keep_mask``."""
    if not training or p == 0.0 or alpha.numel() == 0:
        return alpha
    if (fused := _fused(alpha)) is not None:
        return fused.dropout(alpha, dst_id.to(torch.int64), p, _edge_key(seed, epoch, layer),
                             src=src_id.to(torch.int64))
    keep = edge_keep_mask(dst_id, src_id, alpha.shape[1], p, seed, epoch, layer)
    return _Masked.apply(alpha, keep, 1.0 / (1.0 - p))


def apply_keep(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout of ``x`` with a given keep mask (``keep_mask``'s): what
    ``counter_dropout`` does once the mask is made."""
    return _Masked.apply(x, keep, 1.0 / (1.0 - p))


class _Masked(torch.autograd.Function):
    """``x * keep * scale``, saving the bool mask (1 byte per element) for backward, not a
    float mask (4 bytes)."""

    @staticmethod
    def forward(ctx, x, keep, scale: float):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x * (keep * scale)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * (keep * ctx.scale), None, None


class _NativeMasked(torch.autograd.Function):
    """``_Masked`` on CPU ranks in C: hash, mask and scale in one pass forward; the backward
    hashes again and applies the same mask to the gradient (``hpcgnn.codecs.native``), so no
    mask is kept, and an input that needs no gradient (the features) costs one pass."""

    @staticmethod
    def forward(ctx, x, rows, cols, threshold: int, scale: float):
        ctx.save_for_backward(rows, cols)
        ctx.threshold, ctx.scale = threshold, scale
        return native.dropout_apply(x.detach(), rows, cols, threshold, scale)

    @staticmethod
    def backward(ctx, grad):
        rows, cols = ctx.saved_tensors
        if grad.dtype != torch.float32:
            keep = native.dropout_keep(rows, cols, ctx.threshold)
            return grad * (keep * ctx.scale), None, None, None, None
        return native.dropout_apply(grad, rows, cols, ctx.threshold, ctx.scale), None, None, None, None


class _NativeDropMatmul(torch.autograd.Function):
    """``dropout_matmul`` on CPU ranks: one C pass forward (hash, mask, multiply by ``w``), one
    backward (hash again; ``dx`` and ``dw`` together). Nothing but the inputs is saved."""

    @staticmethod
    def forward(ctx, x, w, rows, cols, threshold: int, scale: float):
        ctx.save_for_backward(x, w, rows, cols)
        ctx.threshold, ctx.scale = threshold, scale
        return native.dropout_matmul(x.detach(), rows, cols, threshold, scale, w.detach())

    @staticmethod
    def backward(ctx, gy):
        x, w, rows, cols = ctx.saved_tensors
        dx, dw = native.dropout_matmul_backward(x.detach(), rows, cols, ctx.threshold, ctx.scale,
                                                w.detach(), gy.to(torch.float32),
                                                input_grad=ctx.needs_input_grad[0])
        return dx, (dw if ctx.needs_input_grad[1] else None), None, None, None, None
