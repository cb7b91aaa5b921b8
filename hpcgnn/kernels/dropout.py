"""The counter-based dropout (``hpcgnn.nn.dropout``) as one Triton kernel: hash, mask and
multiply in one pass, the same bits as ``keep_mask`` and ``edge_keep_mask``.

Element ``(r, c)`` is kept when ``lowbias32(row[r] ^ golden(c)) >= threshold``, with
``row[r] = lowbias32(lowbias32(gid[r]) ^ key)`` for node rows, or, for the edges of GAT,
``row[e] = lowbias32(lowbias32(lowbias32(dst[e]) ^ key) ^ src[e])``. A kept element is
multiplied by ``scale = 1 / (1 - p)`` (as float32), a dropped one by 0 — exactly
``x * (keep * scale)`` of the torch path. The backward runs the same kernel on the gradient, so
no mask is stored: 4 bytes read and 4 written per element each way, one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hpcgnn.kernels import cdiv, explained, pow2
from hpcgnn.kernels.hash import golden_hash, lowbias32

TILE = 4096
OPTS = {"enable_fp_fusion": False}


@triton.jit
def _row_hash(gid_ptr, src_ptr, rows, rmask, key, EDGE: tl.constexpr):
    h = lowbias32(lowbias32(tl.load(gid_ptr + rows, mask=rmask, other=0).to(tl.uint32)) ^ key)
    if EDGE:
        h = lowbias32(h ^ tl.load(src_ptr + rows, mask=rmask, other=0).to(tl.uint32))
    return h


@triton.jit
def _dropout_kernel(x_ptr, out_ptr, gid_ptr, src_ptr, n_rows, width, key, threshold, scale,
                    EDGE: tl.constexpr, MASK_ONLY: tl.constexpr, BR: tl.constexpr, CW: tl.constexpr):
    """Rows ``[pid * BR, pid * BR + BR)``: ``out = x * (keep * scale)``, or the keep bits."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)   # int32 wraps at 2^31 rows
    rmask = rows < n_rows
    row_h = _row_hash(gid_ptr, src_ptr, rows, rmask, tl.cast(key, tl.uint32), EDGE)
    for c0 in range(0, width, CW):
        cols = c0 + tl.arange(0, CW)
        m = rmask[:, None] & (cols < width)[None, :]
        keep = lowbias32(row_h[:, None] ^ golden_hash(cols.to(tl.uint32))[None, :]).to(tl.int64) >= threshold
        at = rows[:, None].to(tl.int64) * width + cols[None, :]
        if MASK_ONLY:
            tl.store(out_ptr + at, keep.to(tl.uint8), mask=m)
        else:
            x = tl.load(x_ptr + at, mask=m, other=0.0)
            tl.store(out_ptr + at, x * tl.where(keep, scale, 0.0), mask=m)


@explained
def _launch(x: torch.Tensor | None, out: torch.Tensor, gid: torch.Tensor, src: torch.Tensor | None,
            width: int, key: int, p: float) -> torch.Tensor:
    n = int(gid.shape[0])
    if n and width:
        cw = pow2(width, 8, 1024)
        br = max(1, TILE // cw)
        _dropout_kernel[(cdiv(n, br),)](
            out if x is None else x, out, gid, gid if src is None else src, n, width, key & 0xFFFFFFFF,
            int(p * 2**32), 1.0 / (1.0 - p), EDGE=src is not None, MASK_ONLY=x is None,
            BR=br, CW=cw, **OPTS)
    return out


def keep_mask(gid: torch.Tensor, width: int, p: float, key: int,
              src: torch.Tensor | None = None) -> torch.Tensor:
    """bool ``(n, width)`` keep bits of rows ``gid`` (int64 global ids; edges: ``gid`` = dst and
    ``src`` = src ids) under the 32-bit ``key``."""
    out = torch.empty(gid.shape[0], width, dtype=torch.uint8, device=gid.device)
    return _launch(None, out, gid.contiguous(), None if src is None else src.contiguous(), width,
                   key, p).view(torch.bool)


def dropout(x: torch.Tensor, gid: torch.Tensor, p: float, key: int,
            src: torch.Tensor | None = None) -> torch.Tensor:
    """``x * (keep * (1 / (1 - p)))`` of float32 ``x`` ``(n, width)``, differentiable; the
    backward recomputes the mask (nothing is saved but the ids)."""
    return _Dropout.apply(x, gid.contiguous(), None if src is None else src.contiguous(), p, key)


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gid, src, p: float, key: int):
        ctx.save_for_backward(gid, src)
        ctx.p, ctx.key = p, key
        x = x.contiguous()
        return _launch(x, torch.empty_like(x), gid, src, x.shape[1], key, p)

    @staticmethod
    def backward(ctx, grad):
        gid, src = ctx.saved_tensors
        grad = grad.contiguous()
        out = _launch(grad, torch.empty_like(grad), gid, src, grad.shape[1], ctx.key, ctx.p)
        return out, None, None, None, None
