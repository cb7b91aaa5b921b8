"""Partitioners: the part of every node. METIS (multi-constraint: owned nodes and training nodes
balanced) through pymetis, and a balanced random assignment. Both deterministic for a seed."""
from __future__ import annotations

import logging
import time

import numpy as np

from hpcgnn.data.clean import csr_from_keys, edge_rows, is_symmetric_simple, unique_sorted
from hpcgnn.data.graph import Graph
from preprocess.errors import PreprocessError
from preprocess.halo import check_key_range
from preprocess.metis import idx_dtype, part_kway

log = logging.getLogger("hpcgnn.preprocess")
PARTITIONERS = ("metis", "random")


def check_parts(num_parts: int, num_nodes: int | None = None, name: str | None = None) -> None:
    """A request for ``num_parts`` parts of a graph of ``num_nodes`` nodes (None: not known
    yet, only ``num_parts >= 1`` is checked) is possible."""
    if num_parts < 1:
        raise PreprocessError(f"--parts {num_parts}: need at least 1 part")
    if num_nodes is not None and num_parts > num_nodes:
        raise PreprocessError(f"--parts {num_parts} is more than the {num_nodes:,} nodes"
                              f"{f' of {name}' if name else ''}; choose --parts <= {num_nodes}")
    if num_nodes is not None:
        check_key_range(num_nodes, num_parts)      # before the partitioning, not after it


def random_parts(num_nodes: int, num_parts: int, seed: int) -> np.ndarray:
    """Balanced random assignment: a seeded permutation dealt round-robin (sizes differ by <= 1)."""
    perm = np.random.default_rng(seed).permutation(num_nodes)
    parts = np.empty(num_nodes, dtype=np.int64)
    parts[perm] = np.arange(num_nodes, dtype=np.int64) % num_parts
    return parts


def _symmetric_keys_csr(graph: Graph) -> tuple[np.ndarray, np.ndarray]:
    """Both directions of every edge, self-loops dropped, as int64 CSR (a sort of 2 nnz keys)."""
    n = np.int64(graph.num_nodes)
    rows, cols = edge_rows(graph.indptr), graph.indices
    if not bool(np.all(loop_free := rows != cols)):
        rows, cols = rows[loop_free], cols[loop_free]
    keys = unique_sorted(np.concatenate([rows * n + cols, cols * n + rows]))
    del rows, cols
    return csr_from_keys(keys, graph.num_nodes)


def _check_metis_width(graph: Graph, count: int, what: str) -> None:
    """``count`` (the node ids' or the adjacency entries' range) fits METIS's index type."""
    if idx_dtype() == np.int32 and count >= np.iinfo(np.int32).max:
        raise PreprocessError(f"{graph.name}: {count:,} {what} exceed this METIS build's 32-bit "
                              f"index; use --partitioner random, or a pymetis whose METIS has "
                              f"64-bit indices (pymetis 2025.2.2's PyPI wheel)")


def metis_adjacency(graph: Graph):
    """The undirected simple graph METIS needs (both directions, no self-loops), as a
    ``pymetis.CSRAdjacency`` in METIS's index type; the graph's own arrays when it already is."""
    import pymetis

    _check_metis_width(graph, graph.num_nodes, "nodes")           # node ids would wrap
    if is_symmetric_simple(graph.indptr, graph.indices):
        indptr, indices = graph.indptr, graph.indices
    else:
        indptr, indices = _symmetric_keys_csr(graph)
    _check_metis_width(graph, len(indices), "adjacency entries")
    dt = idx_dtype()
    return pymetis.CSRAdjacency(indptr.astype(dt, copy=False), indices.astype(dt, copy=False))


def metis_weights(graph: Graph) -> np.ndarray:
    """int [N, ncon] vertex weights: (1, is_train) balances owned and training nodes."""
    if graph.train_idx.size == 0:
        return np.ones((graph.num_nodes, 1), dtype=np.int64)
    w = np.zeros((graph.num_nodes, 2), dtype=np.int64)
    w[:, 0] = 1
    w[graph.train_idx, 1] = 1
    return w


def metis_parts(graph: Graph, num_parts: int, seed: int) -> tuple[np.ndarray, float]:
    """METIS k-way parts and the seconds the METIS call took."""
    t0 = time.perf_counter()
    adj = metis_adjacency(graph)
    weights = metis_weights(graph)
    log.info("METIS input: %s nodes, %s undirected edges, %d constraint(s) (%.1f s)",
             f"{graph.num_nodes:,}", f"{len(adj.adjacent) // 2:,}", weights.shape[1],
             time.perf_counter() - t0)
    t0 = time.perf_counter()
    parts, cut = part_kway(adj, num_parts, weights, int(seed) % (1 << 31))
    seconds = time.perf_counter() - t0
    log.info("METIS: %d parts in %.2f s, edge cut %s (undirected)", num_parts, seconds,
             f"{cut:,}")
    return parts, seconds


def warn_empty_parts(who: str, sizes: np.ndarray) -> None:
    """Warn of the parts of ``sizes`` (owned nodes per part) that ``who`` left empty."""
    empty = np.flatnonzero(sizes == 0)
    if empty.size:
        log.warning("%s left part(s) %s of %d empty (a graph this small, or with many isolated "
                    "nodes); the set still has %d part files, and the empty ones train as ranks "
                    "without rows; --partitioner random fills every part", who, empty.tolist(),
                    len(sizes), len(sizes))


def partition_graph(graph: Graph, parts: int, partitioner: str = "metis",
                    seed: int = 0) -> np.ndarray:
    """int64 [N]: the part of every node."""
    check_parts(parts, graph.num_nodes, graph.name)
    if partitioner == "random":
        return random_parts(graph.num_nodes, parts, seed)
    if partitioner == "metis":
        assignment = metis_parts(graph, parts, seed)[0]
        warn_empty_parts("METIS", np.bincount(assignment, minlength=parts))
        return assignment
    raise PreprocessError(f"--partitioner {partitioner!r}: unknown; choose one of {PARTITIONERS}")
