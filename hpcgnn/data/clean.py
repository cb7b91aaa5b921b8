"""Cleaning an edge list on the way in: drop self-loops and duplicate edges, symmetrise on request.

All of it is sorting int64 keys ``row * N + col`` (one key per CSR entry), so the working set is a
small multiple of the edge array and nothing loops over nodes or edges in Python.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import scipy.sparse as sp

from hpcgnn.data.errors import DatasetError
from hpcgnn.data.graph import Graph

log = logging.getLogger("hpcgnn.data")

MAX_NODES = 3_000_000_000   # keys row * N + col must fit int64; it also keeps every node id
                            # below 2^32, the width of the dropout masks' node key


@dataclass(frozen=True)
class CleanReport:
    """What cleaning changed, in directed edges (CSR entries)."""

    edges_in: int
    self_loops: int
    duplicates: int
    reverse_added: int
    edges_out: int

    def __str__(self) -> str:
        return (f"{self.edges_in:,} edges in: dropped {self.self_loops:,} self-loops and "
                f"{self.duplicates:,} duplicates, added {self.reverse_added:,} reverse edges "
                f"-> {self.edges_out:,} edges")


def unique_sorted(keys: np.ndarray) -> np.ndarray:
    """Sort ``keys`` in place and return its distinct values."""
    if keys.size and not bool(np.all(keys[1:] >= keys[:-1])):
        keys.sort()
    if keys.size == 0:
        return keys
    keep = np.empty(keys.shape, dtype=bool)
    keep[0] = True
    np.not_equal(keys[1:], keys[:-1], out=keep[1:])
    return keys[keep]


def csr_from_keys(keys: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 CSR (indptr, indices) from sorted distinct keys ``row * num_nodes + col``."""
    rows = keys // num_nodes
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=num_nodes), out=indptr[1:])
    rows *= num_nodes
    np.subtract(keys, rows, out=rows)        # reuse the buffer: rows now holds the columns
    return indptr, rows


def edges_to_csr(dst: np.ndarray, src: np.ndarray, num_nodes: int, *, symmetrize: bool,
                 source: str = "graph") -> tuple[np.ndarray, np.ndarray, CleanReport]:
    """CSR of in-neighbours (row ``dst`` lists ``src``) without self-loops or duplicates."""
    if num_nodes > MAX_NODES:
        raise DatasetError(f"{source}: {num_nodes:,} nodes is more than this preprocessor "
                           f"handles ({MAX_NODES:,}); split the graph first")
    n, edges_in = np.int64(num_nodes), len(dst)
    loops = dst == src
    n_loops = int(np.count_nonzero(loops))
    keys = dst.astype(np.int64) * n + src
    del dst            # the caller's edge_rows() array: freed here, not held through the sort
    if n_loops:
        keys = keys[~loops]
    del loops
    keys = unique_sorted(keys)
    n_dup = edges_in - n_loops - len(keys)
    added = 0
    if symmetrize:            # keys and their reverses in one buffer, built in place
        before = len(keys)
        both = np.empty(2 * before, dtype=np.int64)
        both[:before] = keys
        del keys
        rows, rev = both[:before] // n, both[before:]
        np.remainder(both[:before], n, out=rev)
        rev *= n
        rev += rows
        del rows, rev
        keys = unique_sorted(both)
        del both
        added = len(keys) - before
    indptr, indices = csr_from_keys(keys, num_nodes)
    report = CleanReport(edges_in, n_loops, n_dup, added, len(indices))
    return indptr, indices, report


def edge_rows(indptr: np.ndarray) -> np.ndarray:
    """int64 [nnz]: the row of every CSR entry."""
    n = len(indptr) - 1
    return np.repeat(np.arange(n, dtype=np.int64), np.diff(indptr))


def is_symmetric_simple(indptr: np.ndarray, indices: np.ndarray) -> bool:
    """True if the CSR has sorted rows, no duplicates, no self-loops and equals its transpose
    (O(nnz), in scipy's C code: a cheap test before a sort-based symmetrisation)."""
    n = len(indptr) - 1
    a = sp.csr_matrix((np.ones(len(indices), dtype=np.int8), indices, indptr), shape=(n, n))
    if not a.has_canonical_format or np.count_nonzero(a.diagonal()):
        return False
    t = a.T.tocsr()
    return np.array_equal(t.indptr, a.indptr) and np.array_equal(t.indices, a.indices)


def clean_graph(graph: Graph, *, symmetrize: bool = False) -> tuple[Graph, CleanReport]:
    """``graph`` without self-loops or duplicate edges (and with both directions if asked)."""
    indptr, indices, report = edges_to_csr(edge_rows(graph.indptr), graph.indices,
                                           graph.num_nodes, symmetrize=symmetrize,
                                           source=graph.name)
    log.info("%s: %s", graph.name, report)
    return replace(graph, indptr=indptr, indices=indices), report
