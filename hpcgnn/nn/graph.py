"""The local graph of one rank as two sparse operators, normalisation folded into the values.

Rows are the owned nodes. ``owned`` ``(n_owned, n_owned)`` holds the edges between owned nodes
(and the self-loops, for GCN); ``halo`` ``(n_owned, n_halo)`` the edges from halo slots. A
layer computes ``owned @ X_owned + halo @ X_halo``: the first product needs no communication,
so it runs while the halo rows are on the wire. Both are torch CSR tensors built once, each
with its transpose for the backward pass; on CPU ranks the products run in C
(``hpcgnn.codecs.native.spmm``), on CUDA through torch (cuSPARSE).

GCN: ``Â = D^-1/2 (A + I) D^-1/2`` with ``D`` the *global* in-degree + 1 (the shard stores the
halo nodes' global degrees, so boundary rows are normalised exactly as in the whole graph).
SAGE (mean): ``1 / in_degree(i)`` on every in-edge of ``i``, no self-loop.
GAT: the SAGE operators' structure (its attention replaces the values; ``hpcgnn.nn.gat``).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from hpcgnn.codecs import native
from hpcgnn.data.shard import Shard


@dataclass(frozen=True)
class SparseOp:
    """A CSR matrix and its transpose, for ``A @ X`` forward and ``A^T @ G`` backward."""

    mat: torch.Tensor
    mat_t: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_coo(cls, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray,
                 shape: tuple[int, int], device: torch.device) -> "SparseOp":
        """From triplets (any order; duplicates are summed). Built with numpy alone: scipy
        costs a rank 0.2-0.4 s of start-up to import."""
        return cls(_torch_csr(rows, cols, vals, shape, device),
                   _torch_csr(cols, rows, vals, (shape[1], shape[0]), device), tuple(shape))

    @classmethod
    def from_scipy(cls, m, device: torch.device) -> "SparseOp":
        """From a scipy sparse matrix (tests, benchmarks)."""
        m = m.tocoo()
        return cls.from_coo(m.row, m.col, m.data, m.shape, device)

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        return SpMM.apply(x, self)


# Forward + backward nanoseconds per unit of work on one CPU thread, measured on the 2-core
# development machine (AVX-512) with a stale layer of random parts of the cSBM 20k (5,000 owned
# and 13,737 halo rows, 55k non-zeros, 64 -> 8 channels): the fused dropout-matmul kernel per
# row x input channel x output channel (padded to 8, 16 or 32), the C sparse product per
# non-zero x channel, the C dropout per element, torch's dense product per multiply-add.
FUSED_COSTS = {"fused": 0.25, "sparse": 0.36, "dropout": 0.94, "dense": 0.4}


@dataclass(frozen=True)
class LocalGraph:
    """The owned-rows operator split by column block: owned columns and halo columns."""

    owned: SparseOp      # (n_owned, n_owned)
    halo: SparseOp       # (n_owned, n_halo)
    n_owned: int
    n_halo: int
    node_ids: torch.Tensor | None = None   # int64 (n_owned + n_halo,): global ids, owned then halo

    @classmethod
    def from_shard(cls, shard: Shard, arch: str, device: torch.device | str = "cpu") -> "LocalGraph":
        # Peak memory: the edges' temporaries (tens of bytes per edge) are this rank's peak
        # where the features are narrow, so the halo operator is built first and each array
        # is dropped as soon as it is used, and the self-loops go in without a second copy.
        vals = gcn_values(shard) if arch == "gcn" else mean_values(shard)
        n, h = shard.n_owned, shard.n_halo
        device = torch.device(device)
        rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(shard.indptr))
        cols = np.asarray(shard.indices, dtype=np.int64)
        mine = cols < n
        theirs = ~mine
        halo = SparseOp.from_coo(rows[theirs], cols[theirs] - n, vals[theirs], (n, h), device)
        del theirs
        loops = n if arch == "gcn" else 0              # GCN's self-loops, 1 / (d + 1)
        o_rows, o_cols, o_vals = (np.empty(int(mine.sum()) + loops, dtype=a.dtype)
                                  for a in (rows, cols, vals))
        m = o_rows.size - loops
        np.compress(mine, rows, out=o_rows[:m])
        del rows
        np.compress(mine, cols, out=o_cols[:m])
        np.compress(mine, vals, out=o_vals[:m])
        del mine, vals
        if loops:
            o_rows[m:] = o_cols[m:] = np.arange(n, dtype=np.int64)
            o_vals[m:] = (1.0 / (shard.degree + 1.0)).astype(np.float32)
        owned = SparseOp.from_coo(o_rows, o_cols, o_vals, (n, n), device)
        ids = torch.from_numpy(np.concatenate([shard.global_id, shard.halo_global_id]).astype(np.int64))
        return cls(owned, halo, n, h, ids.to(device))

    def transform_first_with_halo(self, f_in: int, f_out: int, fused: bool = False,
                                  density: float = 1.0) -> bool:
        """Whether ``A drop([x; x_halo]) W`` is cheaper as ``A (drop([x; x_halo]) W)`` than as
        ``(A drop([x; x_halo])) W`` when the halo rows are given (a stale step): the first
        multiplies every halo row by ``W``, the second only the owned rows, so on a graph cut
        into many halo rows (random parts) aggregating first is the cheaper order even where
        ``F_out < F_in``. Without ``fused``, by multiply-adds. With ``fused`` (CPU ranks: the
        dropout and ``@ W`` in one C pass, ``hpcgnn.nn.dropout.dropout_matmul``), by the
        forward + backward seconds per unit of work of ``FUSED_COSTS``. ``density``: the share of
        the input's elements that are non-zero where the transform is a sparse product over them
        (sparse features, ``hpcgnn.nn.dropout.sparse_dropout_matmul``)."""
        nnz = self.owned.mat.values().numel() + self.halo.mat.values().numel()
        rows = self.n_owned + self.n_halo
        if fused:
            c = FUSED_COSTS
            padded = 8 if f_out <= 8 else (16 if f_out <= 16 else 32)
            first = rows * f_in * padded * c["fused"] + nnz * f_out * c["sparse"]
            last = (nnz * f_in * c["sparse"] + rows * f_in * c["dropout"]
                    + self.n_owned * f_in * f_out * c["dense"])
            return first < last
        first = rows * f_in * f_out * density + nnz * f_out
        last = nnz * f_in + self.n_owned * f_in * f_out
        return first < last

    def aggregate(self, x_owned: torch.Tensor, x_halo: torch.Tensor) -> torch.Tensor:
        """``(owned @ x_owned) + (halo @ x_halo)``: ``(n_owned, F)``, on CPU ranks in one C pass
        that gives the same bits (``native.spmm_sum2``: no second product to allocate and add)."""
        if native.takes(x_owned) and native.takes(x_halo) and self.n_owned and self.n_halo:
            return SpMMSum.apply(x_owned, x_halo, self.owned, self.halo)
        return (self.owned @ x_owned) + (self.halo @ x_halo)


def gcn_values(shard: Shard) -> np.ndarray:
    """Edge values ``1 / sqrt((d_i + 1)(d_j + 1))`` in CSR order (global degrees)."""
    deg = np.concatenate([shard.degree, shard.halo_degree]).astype(np.float64) + 1.0
    rows = np.repeat(np.arange(shard.n_owned), np.diff(shard.indptr))
    return (1.0 / np.sqrt(deg[rows] * deg[shard.indices])).astype(np.float32)


def mean_values(shard: Shard) -> np.ndarray:
    """Edge values ``1 / in_degree(i)`` in CSR order (the mean over in-neighbours)."""
    counts = np.diff(shard.indptr)
    return np.repeat(1.0 / np.maximum(counts, 1), counts).astype(np.float32)


def csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
        size: tuple[int, int]) -> torch.Tensor:
    """A torch CSR tensor of a pattern known to be valid (no invariant checks)."""
    with warnings.catch_warnings():        # "sparse CSR support is in beta": we rely on it
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, size=size, check_invariants=False)


def csr_offsets(sorted_rows: torch.Tensor, n: int) -> torch.Tensor:
    """The CSR row offsets ``(n + 1,)`` of entries whose rows ``sorted_rows`` are ascending."""
    counts = torch.bincount(sorted_rows, minlength=n)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def _torch_csr(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, shape: tuple[int, int],
               device: torch.device) -> torch.Tensor:
    """float32 torch CSR of the triplets: each row's columns ascending, duplicates summed."""
    rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    order = np.lexsort((cols, rows))
    rows, cols, vals = rows[order], cols[order], np.asarray(vals)[order]
    del order
    if rows.size > 1:
        first = np.r_[True, (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1])]
        if not first.all():
            starts = np.flatnonzero(first)
            vals, rows, cols = np.add.reduceat(vals, starts), rows[starts], cols[starts]
    indptr = np.zeros(shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=shape[0]), out=indptr[1:])
    return csr(torch.from_numpy(indptr).to(device), torch.from_numpy(cols).to(device),
               torch.from_numpy(vals.astype(np.float32, copy=False)).to(device), shape)


class SpMM(torch.autograd.Function):
    """``A @ X`` with a precomputed ``A^T`` for the gradient (no transposition per step)."""

    @staticmethod
    def forward(ctx, x, op: SparseOp):
        ctx.op = op
        if x.shape[0] == 0 or op.shape[0] == 0:
            return x.new_zeros(op.shape[0], x.shape[1])
        return _product(op.mat, x)

    @staticmethod
    def backward(ctx, grad):
        op = ctx.op
        if not ctx.needs_input_grad[0]:
            return None, None
        if grad.shape[0] == 0 or op.shape[1] == 0:
            return grad.new_zeros(op.shape[1], grad.shape[1]), None
        return _product(op.mat_t, grad), None


class SpMMSum(torch.autograd.Function):
    """``A @ Xa + B @ Xb`` of two operators with the same rows, one C pass (CPU float32)."""

    @staticmethod
    def forward(ctx, xa, xb, op_a: SparseOp, op_b: SparseOp):
        ctx.ops = op_a, op_b
        return native.spmm_sum2(op_a.mat, xa, op_b.mat, xb)

    @staticmethod
    def backward(ctx, grad):
        grads = [_product(op.mat_t, grad) if needed else None
                 for op, needed in zip(ctx.ops, ctx.needs_input_grad[:2])]
        return grads[0], grads[1], None, None


def _product(mat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``mat @ x``: the C kernel on CPU float32 (``native.spmm``; torch's CSR product where
    there is none, ``HPCGNN_NATIVE=0``), torch's (cuSPARSE) on CUDA."""
    if native.takes(x):
        return native.spmm(mat, x)
    return mat @ x.contiguous()
