"""Blocks of the normalised adjacency for CAGNET's algorithms, built by global id from the
parts of a shard set: a rank reads only the parts it needs, and of those only the graph
datasets (no features).

A *group* is a run of consecutive parts (``hpcgnn.data.merge.member_parts``); its nodes are
ordered by ascending global id, the order in which ``load_part`` gives the merged shard of
those parts, so a group's rows here are, one for one, the dense rows of the ranks that hold
that group. A *block row* is a list of groups (its rows: each group's nodes, one group after
the other); a *block column* is one group.

The values come from the caller (``EdgeValues``: the model's normalisation, e.g. GCN's
``1 / sqrt((d_i + 1)(d_j + 1))`` with the self-loop ``1 / (d_i + 1)``, or SAGE-mean's
``1 / d_i``; ``hpcgnn.train.parallel`` passes ``hpcgnn.nn.graph``'s). Row ``i`` receives from
column ``j``: ``Z = A H`` aggregates in-neighbours, so a directed graph's blocks are not the
transposes of each other.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import h5py
import numpy as np
import scipy.sparse as sp

from hpcgnn.data.errors import H5_ERRORS, hdf5_fix
from hpcgnn.data.merge import member_parts
from hpcgnn.data.shard import ShardFormatError, part_name, read_global_ids

GRAPH_FIELDS = {"global_id": "nodes/global_id", "degree": "nodes/degree",
                "halo_global_id": "halo/global_id", "halo_degree": "halo/degree",
                "indptr": "graph/indptr", "indices": "graph/indices"}


@dataclass
class PartGraph:
    """The graph datasets of one part (the ``Shard`` fields the edge values need)."""

    global_id: np.ndarray
    degree: np.ndarray
    halo_global_id: np.ndarray
    halo_degree: np.ndarray
    indptr: np.ndarray
    indices: np.ndarray

    @property
    def n_owned(self) -> int:
        return int(self.global_id.shape[0])


def read_part_graph(shards_dir, part: int) -> PartGraph:
    """Part ``part``'s graph datasets; ShardFormatError naming the file and the fix. (The
    rank that holds the part's rows verifies its sha256 through ``load_part``.)"""
    path = Path(shards_dir) / part_name(part)
    fix = "re-run `python -m preprocess` to rewrite the shard set"
    try:
        with h5py.File(path, "r") as f:
            arrays = {k: np.asarray(f[v][...], dtype=np.int64) for k, v in GRAPH_FIELDS.items()}
    except H5_ERRORS as exc:
        raise ShardFormatError(f"{path}: cannot read its graph datasets ({exc}); "
                               f"{hdf5_fix(exc, fix)}") from exc
    g = PartGraph(**arrays)
    n, nnz, width = g.n_owned, g.indices.shape[0], g.n_owned + len(g.halo_global_id)
    if g.indptr.shape != (n + 1,) or g.indptr[-1] != nnz or (nnz and g.indices.max() >= width):
        raise ShardFormatError(f"{path}: graph/indptr or graph/indices do not fit its nodes; {fix}")
    return g


def group_parts(group: int, groups: int, num_parts: int) -> range:
    """The parts of group ``group`` when ``num_parts`` parts form ``groups`` groups."""
    return member_parts(group, groups, num_parts)


def group_ids(shards_dir, parts: range) -> np.ndarray:
    """Global ids of a group's nodes, ascending (the merged shard's row order)."""
    ids = [read_global_ids(shards_dir, p) for p in parts]
    return np.sort(np.concatenate(ids)) if ids else np.zeros(0, np.int64)


# (part graph) -> (values of its edges in CSR order, values of its self-loops or None)
EdgeValues = Callable[[PartGraph], "tuple[np.ndarray, Optional[np.ndarray]]"]


def in_edges(g: PartGraph, values: EdgeValues) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row global id, column global id, value) of every entry of the part's rows of ``A``,
    self-loops included when ``values`` gives them."""
    vals, loops = values(g)
    rows = np.repeat(g.global_id, np.diff(g.indptr))
    cols = np.concatenate([g.global_id, g.halo_global_id])[g.indices]
    if loops is not None:
        rows, cols = np.concatenate([rows, g.global_id]), np.concatenate([cols, g.global_id])
        vals = np.concatenate([vals, loops])
    return rows, cols, vals.astype(np.float32)


@dataclass(frozen=True)
class Columns:
    """Several block columns at once: every column's global id (sorted), its block and its
    position inside its block."""

    ids: np.ndarray
    block: np.ndarray
    pos: np.ndarray
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, blocks: list[np.ndarray]) -> "Columns":
        ids = np.concatenate(blocks) if blocks else np.zeros(0, np.int64)
        block = np.repeat(np.arange(len(blocks)), [len(b) for b in blocks])
        pos = np.concatenate([np.arange(len(b)) for b in blocks]) if blocks else ids
        order = np.argsort(ids, kind="stable")
        return cls(ids[order], block[order], pos[order], tuple(len(b) for b in blocks))

    def find(self, gid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(found, block, position) of each global id."""
        if self.ids.size == 0:
            z = np.zeros(gid.shape, np.int64)
            return z.astype(bool), z, z
        at = np.searchsorted(self.ids, gid).clip(max=self.ids.size - 1)
        return self.ids[at] == gid, self.block[at], self.pos[at]


def adjacency_blocks(shards_dir, row_groups: list[range], col_groups: list[range],
                     values: EdgeValues) -> list[sp.csr_matrix]:
    """``[A[rows, cols_b] for each column group b]`` (scipy CSR, float32): rows = the nodes of
    ``row_groups``, one group after the other, each ascending; columns of block ``b`` = the
    nodes of ``col_groups[b]``, ascending. Reads each row part's graph once."""
    cols = Columns.of([group_ids(shards_dir, g) for g in col_groups])
    r_all, b_all, c_all, v_all = [], [], [], []
    offset = 0
    for group in row_groups:
        row_ids = group_ids(shards_dir, group)
        for part in group:
            rows, gcols, vals = in_edges(read_part_graph(shards_dir, part), values)
            found, block, pos = cols.find(gcols)
            r_all.append(offset + np.searchsorted(row_ids, rows[found]))
            b_all.append(block[found])
            c_all.append(pos[found])
            v_all.append(vals[found])
        offset += row_ids.size
    r, b, c, v = (np.concatenate(a) if a else np.zeros(0, np.int64)
                  for a in (r_all, b_all, c_all, v_all))
    return [sp.csr_matrix((v[b == k].astype(np.float32), (r[b == k], c[b == k])),
                          shape=(offset, size)) for k, size in enumerate(cols.sizes)]


def group_sizes(meta: dict, groups: int) -> list[int]:
    """Nodes of each of ``groups`` groups of the shard set (``meta.json``'s ``num_owned``)."""
    k = int(meta["num_parts"])
    return [sum(int(meta["parts"][p]["num_owned"]) for p in group_parts(g, groups, k))
            for g in range(groups)]
