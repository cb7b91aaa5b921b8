"""CAGNET's 3D algorithm (Tripathy, Yelick, Buluç, SC20; PASSIONLab/CAGNET ``gcn_distr_3d.py``):
split-3D-SpMM on a ``q x q x q`` cube. Each of the ``q`` layers ``l`` of the cube runs the 2D
SUMMA product on its slice of the inner dimension (groups ``(k, l)``), then one reduction across
the layers (a Reduce_scatter of the fibre ``(i, j, .)``) sums the layers' partial products.
The product is ``cagnet2d.SummaSpmm`` with ``c = q``; this module is its grid's set-up.

What 3D needs of the shard set: ``P = q^3`` ranks and ``q^2`` dividing the part count ``K``
(the parts form ``q^2`` groups, the dense rows of the ``q^2`` row-and-layer pairs ``(i, l)``,
each replicated on ``q`` ranks). Rank ``(i, j, l)`` reads the graph datasets of block row ``i``
(``K / q`` parts, one at a time) to build its block ``A[i, (j, l)]``.

Where this differs from the authors' code: besides what ``cagnet2d`` lists, their layers split
the inner dimension evenly by node index and keep ``H`` in ``P`` tiles; here the inner slices are
groups of whole parts, and each layer's result goes by Reduce_scatter to the rows of the rank's
group (not by an all-reduce whose result each rank then cuts), so the layers' sum moves
``(q - 1) n f`` words rather than ``2 (q - 1) n f``.
"""
from __future__ import annotations

from hpcgnn.comm.cagnet2d import SummaGrid, rank_count_error


def plan_3d(shards, k: int, rank: int, size: int, parallel) -> SummaGrid:
    """The ``q x q x q`` cube (``P = q^3``, ``q^2`` dividing ``k``); raises with the valid
    rank counts."""
    valid = [q ** 3 for q in range(1, k + 1) if k % (q * q) == 0]
    q = round(size ** (1.0 / 3.0))
    if q ** 3 != size or k % (q * q):
        raise rank_count_error(shards, "3d", k, size, "P = q x q x q", valid,
                               f"q^2 must divide the part count K = {k}")
    return SummaGrid(q, q, rank, k, dims=3)
