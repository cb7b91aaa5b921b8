"""CAGNET's 1.5D algorithm (Tripathy, Yelick, Buluç, SC20; PASSIONLab/CAGNET
``gcn_distr_15d.py``): partition the adjacency by block rows and replicate each block row on
``c`` ranks, so one SpMM moves ~``n f / c`` words per rank instead of the 1D ``n f``.

The grid: ``P = K c`` ranks over a ``K``-part shard set, rank ``r`` = row group ``i = r // c``,
replica ``j = r % c``. Row group ``i`` (``c`` ranks) holds block row ``i`` of ``A`` and of ``H``
(part ``i``'s shard, replicated); column group ``j`` (``K`` ranks) handles the block columns
``q`` in ``[j K/c, (j+1) K/c)`` (``K`` divisible by ``c``, i.e. ``P`` by ``c^2``). One SpMM
``Z_i = sum_q A[i, q] H_q``:

  forward   for each q of the column range: Bcast H_q (n_q x f) in the column group from
            rank (q, j); partial += A[i, q] H_q. Then Allreduce(partial) in the row group.
  backward  Allreduce(dZ_i) in the row group; for each q: Reduce(A[i, q]^T dZ_i) in the column
            group to rank (q, j), which gets the gradient of its H_q.
Replicas compute the same dense layers; the loss is normalised by the training-node count
summed over all P ranks (c times the graph's), and the trainer's one gradient Allreduce over all
ranks sums the replicas' partial weight gradients, so the step equals the single-process one.

Bytes (``ExchangeStats``), by the standard collective costs: a Bcast over m ranks moves
``(m - 1) x payload`` (counted at the root), a Reduce ``(m - 1) x payload`` (each non-root its
payload), an Allreduce ``2 (m - 1) x payload`` (ring: ``2 (m - 1) / m`` per rank; counted at
the group's first rank). Per SpMM that is
``4 n f ((K - 1) + 2 (c - 1))`` bytes over all ranks (n nodes, f channels), forward and backward
alike; the halo algorithm moves ``4 f`` per boundary row and peer instead.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from hpcgnn.comm import gpu
from hpcgnn.comm.context import CommContext
from hpcgnn.comm.exchange import ExchangeStats
from hpcgnn.data.shard import Shard, ShardFormatError, read_global_ids, read_meta


@dataclass
class ProcessGrid:
    """The ``K x c`` grid: row-group and column-group communicators, made once (collective)."""

    ctx: CommContext
    c: int
    row: object          # mpi4py Comm of my row group (c ranks, ordered by replica j)
    col: object          # mpi4py Comm of my column group (K ranks, ordered by row group i)

    @classmethod
    def make(cls, ctx: CommContext, c: int) -> "ProcessGrid":
        if c < 1 or ctx.size % (c * c):
            raise ValueError(f"parallel.replication = {c}: 1.5D needs the rank count ({ctx.size}) "
                             f"divisible by c^2 = {c * c}; use another c or launch on K*c ranks "
                             f"with K divisible by c")
        i, j = divmod(ctx.rank, c)
        return cls(ctx, c, ctx.comm.Split(i, j), ctx.comm.Split(j, i))

    @property
    def k(self) -> int:
        return self.ctx.size // self.c

    @property
    def i(self) -> int:
        return self.ctx.rank // self.c

    @property
    def j(self) -> int:
        return self.ctx.rank % self.c

    @property
    def columns(self) -> range:
        """Block columns this replica handles."""
        per = self.k // self.c
        return range(self.j * per, (self.j + 1) * per)


def block_columns(shard: Shard, shards_dir, values: np.ndarray, parts: range, arch: str) -> dict:
    """``{q: csr (n_i x n_q)}``: part ``shard``'s rows of ``A`` restricted to part ``q``'s nodes
    (columns in q's local order), edge values ``values`` in CSR order; GCN adds the self-loops."""
    n, i = shard.n_owned, shard.part_id
    owner = np.repeat(np.arange(shard.num_parts), shard.recv_counts)      # halo slot -> part
    rows = np.repeat(np.arange(n), np.diff(shard.indptr))
    cols = shard.indices
    halo = cols >= n
    slot = cols[halo] - n
    out = {}
    for q in parts:
        ids = read_global_ids(shards_dir, q)
        if q == i:
            r, local, v = rows[~halo], cols[~halo], values[~halo]
        else:
            sel = owner[slot] == q
            r, v = rows[halo][sel], values[halo][sel]
            local = np.searchsorted(ids, shard.halo_global_id[slot[sel]])
        m = sp.csr_matrix((v, (r, local)), shape=(n, len(ids)))
        if q == i and arch == "gcn":
            m = (m + sp.diags(1.0 / (shard.degree + 1.0))).tocsr()
        out[q] = m
    return out


def _csr(m: sp.csr_matrix, device) -> torch.Tensor:
    m = m.astype(np.float32).tocsr()
    m.sort_indices()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(torch.from_numpy(m.indptr.astype(np.int64)),
                                       torch.from_numpy(m.indices.astype(np.int64)),
                                       torch.from_numpy(m.data), size=m.shape, device=device)


class Spmm15D:
    """``Z_i = sum_q A[i, q] H_q`` on the grid; call it with this rank's ``H_i`` ``(n_i, f)``."""

    def __init__(self, grid: ProcessGrid, blocks: dict, sizes: list[int], stats: ExchangeStats):
        dev = grid.ctx.device
        self.grid, self.sizes, self.stats = grid, sizes, stats
        self.a = {q: _csr(m, dev) for q, m in blocks.items()}
        self.a_t = {q: _csr(m.T.tocsr(), dev) for q, m in blocks.items()}

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return _Spmm15D.apply(h, self)

    # -- collectives on the host-staging layer ------------------------------------------------
    def _count(self, nbytes: int) -> None:
        """fp32, uncompressed: what is sent is also the fp32 volume."""
        self.stats.bytes_sent += nbytes
        self.stats.bytes_full += nbytes

    def _timed(fn):  # noqa: N805  (a decorator over the three collectives: time into comm_s)
        def run(self, *args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kw)
            finally:
                self.stats.comm_s += time.perf_counter() - t0
        return run

    @_timed
    def bcast(self, t: torch.Tensor, root: int) -> torch.Tensor:
        col, aware = self.grid.col, self.grid.ctx.cuda_aware
        host = t if (t.device.type == "cpu" or aware) else t.cpu()
        buf = gpu.to_mpi(host.contiguous(), aware)
        col.Bcast(buf, root=root)                        # (K - 1) x payload
        if col.Get_rank() == root:
            self._count((col.Get_size() - 1) * t.numel() * 4)
        return host.to(t.device) if host is not t else t

    @_timed
    def reduce(self, t: torch.Tensor, root: int) -> torch.Tensor:
        from mpi4py import MPI
        col, aware = self.grid.col, self.grid.ctx.cuda_aware
        host = t.contiguous() if (t.device.type == "cpu" or aware) else t.cpu()
        out = torch.empty_like(host)
        col.Reduce(gpu.to_mpi(host, aware), gpu.to_mpi(out, aware), op=MPI.SUM, root=root)
        if col.Get_rank() != root:
            self._count(t.numel() * 4)                        # each non-root sends its payload
        return out.to(t.device)

    @_timed
    def allreduce(self, t: torch.Tensor) -> torch.Tensor:
        from mpi4py import MPI
        row, aware = self.grid.row, self.grid.ctx.cuda_aware
        m = row.Get_size()
        if m == 1:
            return t
        host = t.contiguous().clone() if (t.device.type == "cpu" or aware) else t.cpu()
        row.Allreduce(MPI.IN_PLACE, gpu.to_mpi(host, aware), op=MPI.SUM)
        if row.Get_rank() == 0:                       # 2 (m - 1) x payload, counted once
            self._count(2 * (m - 1) * t.numel() * 4)
        return host.to(t.device)


class _Spmm15D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, op: Spmm15D):
        g = op.grid
        partial = h.new_zeros(h.shape[0], h.shape[1])
        for q in g.columns:                               # Bcast H_q in the column group
            hq = h.detach() if q == g.i else h.new_empty(op.sizes[q], h.shape[1])
            hq = op.bcast(hq, root=q)
            partial += op.a[q] @ hq
        ctx.op, ctx.shape = op, h.shape
        op.stats.exchanges += 1
        return op.allreduce(partial)                      # the row group's replicas sum

    @staticmethod
    def backward(ctx, grad):
        op, g = ctx.op, ctx.op.grid
        grad = op.allreduce(grad.contiguous())            # dL/dZ_i summed over the replicas
        out = grad.new_zeros(ctx.shape)
        for q in g.columns:                               # Reduce A[i,q]^T dZ_i to rank (q, j)
            got = op.reduce(op.a_t[q] @ grad, root=q)
            if q == g.i:
                out = got
        op.stats.exchanges += 1
        return out, None


def check_rank_count(shards_dir, ctx: CommContext, c: int) -> int:
    """The part count K of the shard set, checked against ``P = K c``."""
    k = int(read_meta(shards_dir)["num_parts"])
    if k * c != ctx.size:
        raise ShardFormatError(
            f"{shards_dir}/meta.json: parallel.algorithm = '1.5d' with replication {c} over this "
            f"{k}-part set needs {k * c} ranks, the job has {ctx.size}; launch `mpirun -n {k * c}` "
            f"or preprocess {ctx.size // c if ctx.size % c == 0 else 'P/c'} parts")
    return k


def part_sizes(shards_dir, k: int) -> list[int]:
    meta = read_meta(shards_dir)
    return [int(p["num_owned"]) for p in meta["parts"][:k]]


