"""CAGNET's 2D algorithm (Tripathy, Yelick, Buluç, SC20; PASSIONLab/CAGNET ``gcn_distr_2d.py``):
SUMMA on a ``q x q`` grid, ~``(nnz + n f) / sqrt(P)`` words per rank and SpMM. The product is
written for a ``q x q x c`` grid, of which 2D is ``c = 1`` and 3D (``cagnet3d.py``) ``c = q``.

Layout, over a ``K``-part shard set (``K`` divisible by ``q c``): the parts form ``q c``
*groups* of ``K / (q c)`` consecutive parts (``hpcgnn.data.blocks``); block row ``i`` is
groups ``i c .. i c + c - 1`` (2D: group ``i``). Rank ``r = (i q + j) c + l``:

  dense rows  group ``(i, l)`` = ``i c + l`` (``load_part``'s merged shard), replicated on the
              ``q`` ranks ``(i, ., l)``: the trainer's dense layers, loss and metrics run on it
  sparse      ``A[i, (j, l)]``: block row ``i``'s rows, group ``(j, l)``'s columns (and its
              transpose); ``nnz / P`` per rank on average
  features    one SpMM of width ``f``: column slice ``j`` of ``q`` near-equal slices, ``f_j``

One SpMM ``Z = A H`` at rank ``(i, j, l)``, ``h`` = its dense rows ``H[(i, l)]``:

  forward   for k in 0..q-1 (SUMMA stages, in layer l):
                Bcast A[i, (k, l)] along the row (i, ., l) from rank (i, k, l)
                Bcast H[(k, l), cols_j] along the column (., j, l) from rank (k, j, l)
                Z_l[i, cols_j] += A[i, (k, l)] H[(k, l), cols_j]
            3D: Reduce_scatter of Z_l[i, cols_j] across the fibre (i, j, .): rank (i, j, l)
                gets the rows of group (i, l), summed over the layers
            Allgatherv of Z[(i, l), cols_j] along the row: every replica holds Z[(i, l)]
  backward  the adjoint, in reverse: Reduce_scatter of dZ[(i, l)] along the row (column
            slices, summed over the replicas); 3D: Allgatherv across the fibre (block row i's
            rows); for each k: Bcast A[i, (k, l)]^T along the row, Reduce of
            A[i, (k, l)]^T dZ[i, cols_j] down the column to rank (k, j, l), which gets the
            gradient of its H[(k, l), cols_j] (its other columns: zero). The replicas' partial
            gradients add up in the trainer's one gradient Allreduce, as in 1.5D.

Where this differs from the authors' code: their ``H`` lives in ``P`` tiles (rank ``(i, j)``
holds ``H[i, cols_j]``) and their dense products, softmax and weight gradient are distributed
too; here each rank holds its group's dense rows whole (replicated on ``q`` ranks) so the
trainer, its loss, metrics, checkpoints and predict run unchanged, at the price of the
Allgatherv (forward) and Reduce_scatter (backward) along the row. Their backward multiplies by
``A`` again (correct for symmetric ``A`` only); this one by ``A^T`` (each rank keeps its block's
transpose), so directed graphs train exactly. Their sparse blocks travel as COO with indices
cast to float (exact below 2^24 only); here as CSR with integer indices.

Bytes per SpMM over all ranks (``cagnet_wire``'s costs; ``s`` bytes per index, 4 here up to
2^31 entries; ``nnz`` of ``A`` with GCN's self-loops; ``n`` nodes, ``f`` channels):

  2D forward = backward   (q - 1) (s q (n + q) + (s + 4) nnz + 8 n f)
  3D forward              (q - 1) (s q^2 (n + q) + (s + 4) nnz + 12 n f)
  3D backward             (q - 1) (s q (n + q^2) + (s + 4) nnz + 12 n f)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcgnn.comm.cagnet import GridComms, GridSpmm
from hpcgnn.data.blocks import group_parts, group_sizes
from hpcgnn.comm.cagnet_wire import SparseBlock, index_dtype, message_limit
from hpcgnn.comm.context import CommContext
from hpcgnn.comm.settings import VALUE_BYTES
from hpcgnn.data.shard import ShardFormatError


def spmm_bytes(q: int, c: int, n: int, nnz: int, f: int, backward: bool,
               index_bytes: int = 4) -> int:
    """Bytes of one SpMM over all ranks (the closed forms above): ``n`` nodes, ``nnz`` entries
    of ``A`` (GCN's self-loops included), ``f`` channels, forward or ``backward``."""
    s, dense = index_bytes, (8 if c == 1 else 12) * n * f
    rows = s * q * (n + q * q) if (backward and c > 1) else s * q * c * (n + q)
    return (q - 1) * (rows + (s + 4) * nnz + dense)


def column_slices(f: int, q: int) -> list[slice]:
    """``q`` near-equal slices of ``range(f)`` (the first ``f % q`` one wider; some empty
    when ``f < q``)."""
    base, extra = divmod(f, q)
    bounds = [0]
    for j in range(q):
        bounds.append(bounds[-1] + base + (1 if j < extra else 0))
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _width(s: slice) -> int:
    return s.stop - s.start


@dataclass(frozen=True)
class SummaGrid:
    """The ``q x q x c`` grid over a ``num_parts``-part set: rank arithmetic (pure, no
    communication) and ``connect`` (collective)."""

    q: int
    c: int
    rank: int
    num_parts: int
    dims: int = 2            # 2 (2D, c = 1) or 3 (3D, c = q): for messages only

    @property
    def i(self) -> int:
        return self.rank // (self.q * self.c)

    @property
    def j(self) -> int:
        return (self.rank // self.c) % self.q

    @property
    def l(self) -> int:  # noqa: E743  (the cube's third index, as in the papers)
        return self.rank % self.c

    @property
    def groups(self) -> int:
        return self.q * self.c

    def group(self, i: int, l: int) -> int:  # noqa: E741
        """Group ``(i, l)``: the ``l``-th group of block row ``i``."""
        return i * self.c + l

    @property
    def dense_group(self) -> tuple[int, int]:
        """(group, groups) of ``load_part``: this rank's dense rows."""
        return self.group(self.i, self.l), self.groups

    def parts(self, group: int) -> range:
        return group_parts(group, self.groups, self.num_parts)

    def describe(self) -> str:
        shape = " x ".join([str(self.q)] * self.dims)
        return (f"{self.dims}D: {shape} ranks over {self.num_parts} parts, "
                f"{self.num_parts // self.groups} part(s) a group of dense rows")

    def connect(self, comm) -> GridComms:
        """Row ``(i, ., l)`` ordered by j, column ``(., j, l)`` ordered by i, fibre
        ``(i, j, .)`` ordered by l (one rank in 2D)."""
        i, j, l, q, c = self.i, self.j, self.l, self.q, self.c  # noqa: E741
        return GridComms(row=comm.Split(i * c + l, j), col=comm.Split(j * c + l, i),
                         fiber=comm.Split(i * q + j, l))

    def block_groups(self) -> tuple[list[range], list[range]]:
        """(row groups, column groups) of this rank's one block ``A[i, (j, l)]``."""
        rows = [self.parts(self.group(self.i, m)) for m in range(self.c)]
        return rows, [self.parts(self.group(self.j, self.l))]

    def operator(self, ctx: CommContext, blocks: list, meta: dict, limit: int) -> "SummaSpmm":
        """The operator over this rank's block (``block_groups``, read by the caller); ``limit``:
        bytes a call may move (``[comm] max_message``)."""
        return SummaSpmm(ctx, self, blocks[0], group_sizes(meta, self.groups), 
                         index_dtype(int(meta["num_nodes"]), int(meta["num_edges"])), limit=limit)


def rank_count_error(shards, algorithm: str, k: int, size: int, shape: str, valid: list[int],
                     why: str) -> ShardFormatError:
    """The refusal of a rank count: what the algorithm needs, the valid counts, the fix."""
    return ShardFormatError(
        f"{shards}/meta.json: parallel.algorithm = '{algorithm}' runs on {shape} ranks; {why}, "
        f"and the job has {size} ranks; launch `mpirun -n P` with P in "
        f"{', '.join(map(str, valid))} for this {k}-part set, preprocess another part count, "
        f"or use parallel.algorithm = 'halo'")


def plan_2d(shards, k: int, rank: int, size: int, parallel) -> SummaGrid:
    """The ``q x q`` grid (``P = q^2``, ``q`` dividing ``k``); raises with the valid counts."""
    valid = [q * q for q in range(1, k + 1) if k % q == 0]
    q = round(size ** 0.5)
    if q * q != size or k % q:
        raise rank_count_error(shards, "2d", k, size, "P = q x q",  valid,
                               f"q must divide the part count K = {k}")
    return SummaGrid(q, 1, rank, k)


class SummaSpmm(GridSpmm):
    """``Z[(i, l)] = (A H)[(i, l)]`` on the ``q x q x c`` grid; call it with this rank's dense
    rows ``H[(i, l)]`` ``(n_il, f)``."""

    def __init__(self, ctx: CommContext, grid: SummaGrid, block, sizes: list[int],
                 dtype: torch.dtype, limit: int | None = None):
        super().__init__(ctx, message_limit() if limit is None else limit)
        self.grid, self.sizes, self.dtype = grid, sizes, dtype
        self.a = SparseBlock.from_scipy(block, dtype, ctx.device)          # (n_i, n_jl)
        self.a_t = SparseBlock.from_scipy(block.T.tocsr(), dtype, ctx.device)
        self.row_sizes = [sizes[grid.group(grid.i, m)] for m in range(grid.c)]
        self.nnz: list[int] = []

    def least_message(self) -> tuple[int, str]:
        """A round of an Allgatherv or Reduce_scatter over a row or fibre carries a whole value
        from each of its ``q`` ranks; a block's Bcast splits between whole indices."""
        index, q = torch.empty(0, dtype=self.dtype).element_size(), self.grid.q
        return (max(index, VALUE_BYTES * q),
                f"a round of its Allgatherv and Reduce_scatter carries a {VALUE_BYTES}-byte value "
                f"from each of the {q} ranks of a grid row, and a block's Bcast whole "
                f"{index}-byte indices")

    def connect(self) -> None:
        """The communicators, then the nnz of every block of the row (one small allgather)."""
        super().connect()
        self.nnz = self.comms.row.allgather(self.a.nnz)

    # -- the blocks along the row ------------------------------------------------------------
    def block(self, k: int, transposed: bool) -> SparseBlock:
        """``A[i, (k, l)]`` ``(n_i, n_kl)`` (or its transpose), Bcast along the row from rank
        ``(i, k, l)``: ``(q - 1) (s (rows + 1) + (s + 4) nnz)`` bytes."""
        g = self.grid
        if k == g.j:
            mine = self.a_t if transposed else self.a
        else:
            shape = (sum(self.row_sizes), self.sizes[g.group(k, g.l)])
            shape = shape[::-1] if transposed else shape
            mine = SparseBlock.empty(shape, self.nnz[k], self.dtype, self.ctx.device)
        return mine.bcast(self.wire, self.comms.row, root=k)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` ``(n_il, f)`` -> ``Z[(i, l)]`` ``(n_il, f)``: q stages, the layers' sum (3D),
        the row's Allgatherv."""
        g, cols = self.grid, column_slices(h.shape[1], self.grid.q)
        mine = cols[g.j]
        z = h.new_zeros(sum(self.row_sizes), _width(mine))
        for k in range(g.q):                                # SUMMA stage k of layer l
            a = self.block(k, transposed=False)
            hk = h[:, mine] if k == g.i else h.new_empty(self.sizes[g.group(k, g.l)], _width(mine))
            z += a @ self.wire.bcast(self.comms.col, hk, root=k)     # (q - 1) n_kl f_j x 4 B
        z = self.wire.reduce_scatter(self.comms.fiber, z,          # 3D: the layers' sum
                                     [n * _width(mine) for n in self.row_sizes])
        return self.gather_columns(z.reshape(h.shape[0], _width(mine)), cols)

    def gather_columns(self, z: torch.Tensor, cols: list[slice]) -> torch.Tensor:
        """``(n, f_j)`` slices of the row's ranks -> ``(n, f)`` on each (one Allgatherv:
        ``(q - 1) n f_j x 4`` bytes from each rank)."""
        n = z.shape[0]
        flat = self.wire.allgather(self.comms.row, z, [n * _width(s) for s in cols])
        blocks = flat.split([n * _width(s) for s in cols])
        return torch.cat([b.reshape(n, _width(s)) for b, s in zip(blocks, cols)], dim=1)

    # -- backward ----------------------------------------------------------------------------
    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        """``dZ[(i, l)]`` ``(n_il, f)`` of this replica -> this copy's share of ``dH[(i, l)]``
        ``(n_il, f)`` (its column slice ``j``; the replicas' shares add up to the gradient)."""
        g, cols = self.grid, column_slices(grad.shape[1], self.grid.q)
        mine, n = cols[g.j], grad.shape[0]
        packed = torch.cat([grad[:, s].reshape(-1) for s in cols])
        gj = self.wire.reduce_scatter(self.comms.row, packed, [n * _width(s) for s in cols])
        gj = self.wire.allgather(self.comms.fiber, gj, [m * _width(mine) for m in self.row_sizes])
        gj = gj.reshape(sum(self.row_sizes), _width(mine))     # (n_i, f_j): block row i's rows
        out = grad.new_zeros(grad.shape)
        for k in range(g.q):                                # adjoint of stage k
            part = self.block(k, transposed=True) @ gj
            got = self.wire.reduce(self.comms.col, part, root=k)     # (q - 1) n_kl f_j x 4 B
            if k == g.i:
                out[:, mine] = got
        return out
