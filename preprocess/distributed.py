"""Distributed preprocessing: ``mpirun -n P python -m mpi4py -m preprocess --partitioner
{ptscotch,random} ...`` (DESIGN.md, 'Distributed preprocessing').

Rank ``r`` holds the rows ``bounds[r]:bounds[r+1]`` (``bounds[r] = r * N // P``) of the input
and never the whole graph:

1. read its row slice (``h5:PATH``), or generate it (``rmat-sliced:``, ``csbm-sliced:``); other
   specs are loaded whole on every rank and sliced;
2. clean the slice (self-loops, duplicates: a row's edges are all local) and send every edge's
   reverse to the reverse row's owner (one Alltoallv of ``E/P`` pairs): the union is the
   symmetric graph the partitioner needs (and the written graph with ``--symmetrize``);
3. partition: PT-Scotch (``SCOTCH_dgraphPart``) on the symmetric graph, or a balanced random
   assignment that depends on the seed only (not on P);
4. send rows, their edges, features, labels and masks to the writer of their part (part ``p``
   is written by rank ``p * P // K``), in Alltoallv rounds under 2 GiB;
5. every writer asks the slice owners for the part and degree of its edges' distinct
   neighbours, builds its halo lists, and tells the writers of the neighbours' parts which rows
   they send (the halo invariant of DESIGN.md holds by construction: both sides sort by id);
6. every writer writes its parts with the one-process shard writer; rank 0 writes
   ``meta.json`` after all parts are in (the sha256s gathered), or removes them all on a failure.

Size limit: edges travel and sort as int64 keys ``row * N + col`` (and halo keys
``(q * K + p) * N + v``, checked in ``preprocess.halo.check_key_range``), so ``N`` is bounded by
``MAX_NODES`` (3e9: ``N^2 < 2^63``). Every rank checks ``N`` as soon as it knows it, before any
key is built (``check_node_count``); ``HPCGNN_MAX_NODES`` lowers the bound (tests).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcgnn.data.clean import MAX_NODES, edge_rows, unique_sorted
from hpcgnn.data import sliced
from hpcgnn.data.datasets import SLICED, load_dataset, parse_spec, sliced_spec
from hpcgnn.data.errors import DatasetError
from hpcgnn.data.h5input import GraphSlice, h5_num_nodes, read_h5_slice
from hpcgnn.data.shard import ShardFormatError
from preprocess.errors import PreprocessError
from preprocess.exchange import reply, send_to

log = logging.getLogger("hpcgnn.preprocess")
USER_ERRORS = (DatasetError, PreprocessError, ShardFormatError)
RANDOM_BLOCK = 1 << 16          # random partitioning permutes blocks of this many nodes
MAX_NODES_ENV = "HPCGNN_MAX_NODES"


def node_limit() -> int:
    """The most nodes whose keys ``row * N + col`` fit int64: ``MAX_NODES``, or less when
    ``HPCGNN_MAX_NODES`` says so (it can only lower the bound)."""
    raw = os.environ.get(MAX_NODES_ENV)
    if raw is None:
        return MAX_NODES
    try:
        return min(MAX_NODES, int(raw))
    except ValueError:
        raise PreprocessError(f"{MAX_NODES_ENV}={raw!r} is not an integer; unset it (the bound "
                              f"is then {MAX_NODES:,} nodes)") from None


def check_node_count(n: int, source: str) -> None:
    """Refuse a graph whose int64 edge keys ``row * N + col`` could overflow."""
    limit = node_limit()
    if n > limit:
        raise PreprocessError(
            f"{source}: {n:,} nodes is more than distributed preprocessing handles ({limit:,}"
            f"{f', lowered by {MAX_NODES_ENV}' if limit < MAX_NODES else ''}): its int64 edge "
            f"keys row * N + col would overflow; split the graph into inputs of at most "
            f"{limit:,} nodes" + (f", or unset {MAX_NODES_ENV}" if limit < MAX_NODES else ""))


def collective(comm, fn, *args, name_ranks: bool = True, **kwargs):
    """Run ``fn`` on every rank; if it raised a user error on any rank, raise it on all
    (the first failing rank's message), so no rank waits in a later collective. When only
    some ranks failed, the message says which (``on rank 2 only: ...``): an input file that
    one node does not see is then not reported as missing by the ranks that read it.
    ``name_ranks=False`` for a step that only rank 0 runs (its words alone)."""
    err, out = None, None
    try:
        out = fn(*args, **kwargs)
    except USER_ERRORS as exc:
        err = exc
    msgs = comm.allgather(None if err is None else str(err))
    bad = [r for r, m in enumerate(msgs) if m is not None]
    if len(bad) == comm.size:
        raise err
    if bad and not name_ranks:
        raise err if err is not None else PreprocessError(msgs[bad[0]])
    if bad:
        who = f"rank {bad[0]}" if len(bad) == 1 else f"ranks {', '.join(map(str, bad))}"
        raise PreprocessError(f"on {who} only: {msgs[bad[0]]}") from err
    return out


def on_root(comm, fn, *args):
    """``fn(*args)`` on rank 0 alone; its user error is raised on every rank, in its words."""
    return collective(comm, lambda: fn(*args) if comm.rank == 0 else None, name_ranks=False)


def row_bounds(num_nodes: int, size: int) -> np.ndarray:
    """int64 [P + 1]: rank r holds rows ``bounds[r]:bounds[r+1]``."""
    return np.arange(size + 1, dtype=np.int64) * num_nodes // size


def row_owner(bounds: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The rank holding each row of ``ids``."""
    return np.searchsorted(bounds, ids, side="right").astype(np.int64) - 1


def known_nodes(spec: str, symmetrize: bool) -> int | None:
    """The node count of ``spec`` where it is known before the input is read (an h5 file's
    ``num_nodes``, a sliced generator's option), else None. A ``metis-graph:`` file is
    refused: its text cannot be read by row slices, and its labels need the whole graph."""
    name, opts = parse_spec(spec)
    if name == "metis-graph":
        h5 = Path(opts["path"]).with_suffix(".h5")
        raise PreprocessError(
            f"{spec}: a METIS graph file is not read by row slices (its text is read whole, "
            f"and its stand-in labels follow the whole graph), so the distributed path does "
            f"not take it: convert it once in one process (python -m preprocess convert "
            f"--dataset {spec} --out {h5}) and pass --dataset h5:{h5}, or partition it in one "
            f"process (--partitioner metis, without mpirun)")
    if name in SLICED:
        return sliced_spec(spec, name, opts, symmetrize).nodes
    return h5_num_nodes(opts["path"]) if name == "h5" else None


def read_slice(spec: str, comm, symmetrize: bool) -> GraphSlice:
    """This rank's row slice of ``spec``: ``h5:PATH`` reads only the slice; any other spec is
    loaded whole (a graph that fits one process) and sliced."""
    name, opts = parse_spec(spec)
    if name in SLICED:
        gen = sliced_spec(spec, name, opts, symmetrize)
        check_node_count(gen.nodes, spec)
        return generate_slice(comm, spec, gen, row_bounds(gen.nodes, comm.size))
    if name == "h5":
        n = h5_num_nodes(opts["path"])
        check_node_count(n, opts["path"])
        b = row_bounds(n, comm.size)
        return read_h5_slice(opts["path"], int(b[comm.rank]), int(b[comm.rank + 1]), name=spec)
    log.info("%s: every rank loads the whole graph and keeps its slice; for a graph larger than "
             "one process, convert it first: python -m preprocess convert", spec)
    graph = load_dataset(spec, symmetrize=symmetrize)     # its reader checks MAX_NODES itself
    check_node_count(graph.num_nodes, spec)
    b = row_bounds(graph.num_nodes, comm.size)
    return GraphSlice.of_graph(graph, int(b[comm.rank]), int(b[comm.rank + 1]))


def generate_slice(comm, name: str, gen: sliced.Spec, bounds: np.ndarray) -> GraphSlice:
    """This rank's rows of a sliced generator: it draws edge chunks ``r * C // P ..`` and sends
    every edge (both directions when symmetric) to its row's owner: O(E/P) int64 pairs."""
    n, rank, size = gen.nodes, comm.rank, comm.size
    chunks = sliced.num_chunks(gen)
    got = [sliced.chunk_edges(gen, c) for c in range(rank * chunks // size,
                                                        (rank + 1) * chunks // size)]
    dst = np.concatenate([g[0] for g in got] or [np.zeros(0, dtype=np.int64)])
    src = np.concatenate([g[1] for g in got] or [np.zeros(0, dtype=np.int64)])
    del got
    if gen.symmetric:
        dst, src = np.concatenate([dst, src]), np.concatenate([src, dst])
    (dst, src), _ = send_to(comm, row_owner(bounds, dst), dst, src)
    keys = dst * np.int64(n) + src
    del dst, src
    keys.sort()
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    indptr, indices = csr_of_keys(keys, n, lo, hi)
    x, labels, masks = sliced.node_data(gen, lo, hi)
    return GraphSlice(name, n, lo, hi, indptr, indices, x, labels, masks)


def local_keys(sl: GraphSlice) -> np.ndarray:
    """Sorted distinct keys ``row * N + col`` of the slice's edges without self-loops (a row's
    duplicates are all on this rank, so this is the cleaned slice)."""
    n = np.int64(sl.num_nodes)
    rows = edge_rows(sl.indptr) + sl.lo
    keep = rows != sl.indices
    return unique_sorted(rows[keep] * n + sl.indices[keep])


def add_reverse(comm, keys: np.ndarray, n: int, bounds: np.ndarray) -> np.ndarray:
    """The keys of this rank's rows in the symmetric closure: ``keys`` plus every reverse edge
    ``(col, row)`` received from the owner of ``row``. Sends E/P int64 pairs per rank."""
    rows, cols = keys // n, keys % n
    (rev,), _ = send_to(comm, row_owner(bounds, cols), cols * n + rows)
    del rows, cols
    return unique_sorted(np.concatenate([keys, rev]))


def csr_of_keys(keys: np.ndarray, n: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Local CSR (int64 [hi-lo+1], global cols) of sorted keys of rows ``lo:hi``."""
    indptr = np.zeros(hi - lo + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys // n - lo, minlength=hi - lo), out=indptr[1:])
    return indptr, keys % n


def random_parts_slice(lo: int, hi: int, n: int, num_parts: int, seed: int) -> np.ndarray:
    """Parts of rows ``lo:hi`` under a balanced random assignment that depends on the seed
    only: node ``v`` in block ``b`` (``RANDOM_BLOCK`` nodes) gets position ``b * B +
    perm_b[v - b * B]`` (``perm_b`` a permutation of the block, the last one may be short) and
    part ``position % K``: positions cover 0..N-1 once, so part sizes differ by <= 1."""
    out = np.empty(hi - lo, dtype=np.int64)
    for b in range(lo // RANDOM_BLOCK, -(-hi // RANDOM_BLOCK)):
        start = b * RANDOM_BLOCK
        perm = np.random.default_rng([seed, b]).permutation(min(RANDOM_BLOCK, n - start)) + start
        a, z = max(lo, start), min(hi, start + RANDOM_BLOCK)
        out[a - lo:z - lo] = perm[a - start:z - start] % num_parts
    return out


@dataclass
class Moved:
    """What a writer rank received: its rows (unsorted) and their edges."""

    gid: np.ndarray        # int64 [m]
    part: np.ndarray       # int64 [m]
    degree: np.ndarray     # int64 [m]
    label: np.ndarray      # int64 [m]
    masks: np.ndarray      # bool [m, 3] train, val, test
    features: np.ndarray   # float32 [m, F]
    edge_keys: np.ndarray  # int64 sorted row * N + col


def writer_of(parts: np.ndarray, num_parts: int, size: int) -> np.ndarray:
    """Rank that writes each part: ``p * P // K`` (consecutive parts on one rank)."""
    return parts * size // num_parts


def move_to_writers(comm, sl: GraphSlice, indptr: np.ndarray, cols: np.ndarray,
                    parts: np.ndarray, num_parts: int) -> Moved:
    """Send every row (id, part, degree, label, masks, features) and its edges to its part's
    writer: O((N/P) * F * 4 + E/P * 16) bytes per rank, in rounds under 2 GiB."""
    n = np.int64(sl.num_nodes)
    dest = writer_of(parts, num_parts, comm.size)
    masks = np.stack([sl.masks[m] for m in ("train_mask", "val_mask", "test_mask")], axis=1)
    gid = np.arange(sl.lo, sl.hi, dtype=np.int64)
    (g, p, d, lab, m, x), _ = send_to(comm, dest, gid, parts, np.diff(indptr), sl.labels,
                                      masks, sl.features)
    row_of_edge = edge_rows(indptr)
    (keys,), _ = send_to(comm, dest[row_of_edge], (row_of_edge + sl.lo) * n + cols)
    return Moved(g, p, d, lab, m, x, unique_sorted(keys))


def lookup(comm, ids: np.ndarray, bounds: np.ndarray, parts: np.ndarray, degree: np.ndarray,
           lo: int) -> tuple[np.ndarray, np.ndarray]:
    """Part and degree of the sorted distinct global ``ids``, asked of their slice owners
    (O(len(ids)) int64 each way)."""
    (asked,), recv = send_to(comm, row_owner(bounds, ids), ids)
    got_part, got_deg = reply(comm, recv, parts[asked - lo], degree[asked - lo])
    return got_part, got_deg
