"""CAGNET's 1.5D algorithm (Tripathy, Yelick, Buluç, SC20; PASSIONLab/CAGNET
``gcn_distr_15d.py``): partition the adjacency by block rows and replicate each block row on
``c`` ranks, so one SpMM moves ~``n f / c`` words per rank instead of the 1D ``n f``. Also what
every CAGNET operator shares (``GridSpmm``; 2D and 3D: ``cagnet2d.py``, ``cagnet3d.py``).

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

Bytes (``ExchangeStats``, the costs of ``cagnet_wire``): per SpMM
``4 n f ((K - 1) + 2 (c - 1))`` bytes over all ranks (n nodes, f channels), forward and backward
alike; the halo algorithm moves ``4 f`` per boundary row and peer instead.

Set-up is local (``plan_15d``, ``ProcessGrid.operator``: files only, so a rank that fails there
fails before any collective); ``connect()`` makes the row and column communicators (``Split``,
collective) and is called by ``Trainer.start()`` once every rank agreed that none failed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcgnn.data.blocks import group_sizes
from hpcgnn.comm.cagnet_wire import SparseBlock, Wire, index_dtype, message_limit
from hpcgnn.comm.context import CommContext
from hpcgnn.comm.exchange import ExchangeStats
from hpcgnn.comm.settings import VALUE_BYTES
from hpcgnn.data.shard import ShardFormatError
from hpcgnn.log import get_logger

log = get_logger()


class GridSpmm:
    """What the CAGNET operators share: a callable ``h -> A_i H`` with its own autograd (the
    contract of ``layer.spmm``), the wire (collectives, byte counts, ``stats``), and the
    collective ``connect()`` that the trainer calls after the start-up agreement. Subclasses
    give ``grid`` (with ``connect(comm)``), ``forward(h)`` and ``backward(grad)``."""

    grid: object

    def __init__(self, ctx: CommContext, limit: int):
        self.ctx = ctx
        self.wire = Wire(ctx, limit)
        self.comms = None

    @property
    def stats(self) -> ExchangeStats | None:
        return self.wire.stats

    @stats.setter
    def stats(self, stats: ExchangeStats) -> None:
        self.wire.stats = stats

    def least_message(self) -> tuple[int, str]:
        """(the least ``[comm] max_message`` this operator's calls keep, why): its Bcasts,
        Reduces and Allreduces split between whole 4-byte values."""
        return VALUE_BYTES, f"its collectives split between whole {VALUE_BYTES}-byte values"

    def connect(self) -> None:
        """Make the grid's communicators (collective: every rank, same order); once."""
        if getattr(self, "comms", None) is not None:
            return
        self.comms = self.grid.connect(self.ctx.comm)
        log.info("CAGNET %s", self.grid.describe())

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.comms is None:
            raise RuntimeError(f"{type(self).__name__}: connect() was not called (Trainer.start "
                               f"calls it after the start-up agreement)")
        return _GridSpmmFn.apply(h, self)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _GridSpmmFn(torch.autograd.Function):
    """Autograd around a ``GridSpmm``: ``op.forward`` and its adjoint ``op.backward``."""

    @staticmethod
    def forward(ctx, h, op: GridSpmm):
        ctx.op = op
        op.stats.exchanges += 1
        return op.forward(h.detach())

    @staticmethod
    def backward(ctx, grad):
        ctx.op.stats.exchanges += 1
        return ctx.op.backward(grad.contiguous()), None


@dataclass(frozen=True)
class GridComms:
    """The communicators of a grid: along its rows, its columns and (3D) its fibres."""

    row: object
    col: object
    fiber: object | None = None


@dataclass(frozen=True)
class ProcessGrid:
    """The ``K x c`` grid of 1.5D: rank arithmetic (pure) and ``connect`` (collective)."""

    k: int
    c: int
    rank: int

    @property
    def i(self) -> int:
        return self.rank // self.c

    @property
    def j(self) -> int:
        return self.rank % self.c

    @property
    def columns(self) -> range:
        """Block columns this replica handles."""
        per = self.k // self.c
        return range(self.j * per, (self.j + 1) * per)

    @property
    def dense_group(self) -> tuple[int, int]:
        """(group, groups) of ``load_part``: this rank's dense rows are part ``i``."""
        return self.i, self.k

    def describe(self) -> str:
        return (f"1.5D: {self.k} row groups of {self.c} replicas, {self.k // self.c} block "
                f"columns a replica")

    def connect(self, comm) -> GridComms:
        """Row group (c ranks, ordered by replica j), column group (K ranks, ordered by i)."""
        return GridComms(row=comm.Split(self.i, self.j), col=comm.Split(self.j, self.i))

    def block_groups(self) -> tuple[list[range], list[range]]:
        """(row groups, column groups) of the blocks of ``A`` this rank holds: its part's rows,
        one block per column part it handles (``hpcgnn.data.blocks.adjacency_blocks``)."""
        return [range(self.i, self.i + 1)], [range(q, q + 1) for q in self.columns]

    def operator(self, ctx: CommContext, blocks: list, meta: dict, limit: int) -> "Spmm15D":
        """The operator over the blocks of ``block_groups`` (read by the caller); ``limit``:
        bytes a call may move (``[comm] max_message``)."""
        return Spmm15D(ctx, self, dict(zip(self.columns, blocks)), group_sizes(meta, self.k),
                       index_dtype(int(meta["num_nodes"]), int(meta["num_edges"])), limit=limit)


def plan_15d(shards, k: int, rank: int, size: int, parallel) -> ProcessGrid:
    """The 1.5D grid of ``size`` ranks over a ``k``-part set with ``parallel.replication``;
    raises naming the numbers and a fix that plans (``c`` must divide ``k`` whatever the rank
    count, so that comes first; a part count is offered only when it would run)."""
    c = parallel.replication
    if k % c:
        fits = ", ".join(str(d) for d in range(1, k + 1) if k % d == 0)
        raise ShardFormatError(
            f"{shards}/meta.json: parallel.algorithm = '1.5d' with replication {c} needs the "
            f"part count K = {k} divisible by c (the K*c ranks divisible by c^2 = {c * c}); use "
            f"parallel.replication in {fits} for this {k}-part set (on {k} x c ranks), or "
            f"preprocess a multiple of {c} parts")
    if k * c != size:
        parts = size // c if size % c == 0 and (size // c) % c == 0 else None
        other = f" or preprocess {parts} parts" if parts else ""
        raise ShardFormatError(
            f"{shards}/meta.json: parallel.algorithm = '1.5d' with replication {c} over this "
            f"{k}-part set needs {k * c} ranks, the job has {size}; launch `mpirun -n {k * c}`"
            f"{other}")
    return ProcessGrid(k, c, rank)


def spmm_bytes_15d(k: int, c: int, n: int, f: int) -> int:
    """Bytes of one SpMM over all ranks, forward or backward: ``4 n f ((K - 1) + 2 (c - 1))``."""
    return 4 * n * f * ((k - 1) + 2 * (c - 1))


class Spmm15D(GridSpmm):
    """``Z_i = sum_q A[i, q] H_q`` on the grid; call it with this rank's ``H_i`` ``(n_i, f)``."""

    def __init__(self, ctx: CommContext, grid: ProcessGrid, blocks: dict, sizes: list[int],
                 dtype: torch.dtype, limit: int | None = None):
        super().__init__(ctx, message_limit() if limit is None else limit)
        dev = ctx.device
        self.grid, self.sizes = grid, sizes
        self.a = {q: SparseBlock.from_scipy(m, dtype, dev) for q, m in blocks.items()}
        self.a_t = {q: SparseBlock.from_scipy(m.T.tocsr(), dtype, dev) for q, m in blocks.items()}

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``H_i`` ``(n_i, f)`` -> ``Z_i`` ``(n_i, f)``: ``K/c`` Bcasts of ``(K - 1) n_q f x 4``
        bytes, one Allreduce of ``2 (c - 1) n_i f x 4``."""
        g, col = self.grid, self.comms.col
        partial = h.new_zeros(h.shape[0], h.shape[1])
        for q in g.columns:                               # Bcast H_q in the column group
            hq = h if q == g.i else h.new_empty(self.sizes[q], h.shape[1])
            partial += self.a[q] @ self.wire.bcast(col, hq, root=q)
        return self.wire.allreduce(self.comms.row, partial)     # the row group's replicas sum

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        """``dZ_i`` ``(n_i, f)`` -> this replica's share of ``dH_i``: the Allreduce, then
        ``K/c`` Reduces of ``(K - 1) n_q f x 4`` bytes."""
        g = self.grid
        grad = self.wire.allreduce(self.comms.row, grad)  # dL/dZ_i summed over the replicas
        out = grad.new_zeros(self.sizes[g.i], grad.shape[1])
        for q in g.columns:                               # Reduce A[i,q]^T dZ_i to rank (q, j)
            got = self.wire.reduce(self.comms.col, self.a_t[q] @ grad, root=q)
            if q == g.i:
                out = got
        return out
