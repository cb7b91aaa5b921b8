"""Halo maps on the writer ranks of the distributed preprocessing (see ``distributed.py``).

A writer holds whole parts (rows + their edges). For every part ``p`` it needs the owner part
and degree of each neighbour (a distributed lookup at the slice owners), lists ``p``'s halo
grouped by owner part and ascending in each group, and tells the writer of owner ``q`` the rows
``q`` must send to ``p``. The receiver sorts them the same way, so ``q``'s send block to ``p``
equals ``p``'s halo block from ``q``, in order (DESIGN.md's invariant).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcgnn.data.shard import Shard
from preprocess.distributed import Moved, lookup, writer_of
from preprocess.exchange import send_to
from preprocess.halo import check_key_range


@dataclass
class PartRows:
    """One part's owned rows (ascending id) with their data, and its edges."""

    part: int
    gid: np.ndarray
    sel: np.ndarray          # indices into Moved's row arrays, in gid order
    rows: np.ndarray         # int64 [nnz] global row of every edge, ascending
    cols: np.ndarray         # int64 [nnz] global col
    col_part: np.ndarray     # int64 [nnz]


def my_parts(num_parts: int, rank: int, size: int) -> np.ndarray:
    return np.flatnonzero(writer_of(np.arange(num_parts), num_parts, size) == rank)


def split_parts(moved: Moved, n: int, mine: np.ndarray, col_part_of) -> list[PartRows]:
    """The writer's rows and edges, by part (edges stay sorted by (row, col))."""
    order = np.argsort(moved.gid, kind="stable")
    gid_sorted = moved.gid[order]
    rows, cols = moved.edge_keys // n, moved.edge_keys % n
    row_part = moved.part[order[np.searchsorted(gid_sorted, rows)]]
    out = []
    for p in mine:
        sel = order[moved.part[order] == p]
        e = row_part == p
        out.append(PartRows(int(p), moved.gid[sel], sel, rows[e], cols[e], col_part_of(cols[e])))
    return out


def halo_of(pr: PartRows, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Halo keys ``owner * N + v`` (sorted, distinct) of a part and the edge mask of remote
    edges."""
    remote = pr.col_part != pr.part
    return np.unique(pr.col_part[remote] * n + pr.cols[remote]), remote


def local_indices(pr: PartRows, halo_keys: np.ndarray, remote: np.ndarray, n: int) -> np.ndarray:
    """Local column ids: an owned neighbour's index, or ``n_owned + halo slot``."""
    out = np.searchsorted(pr.gid, pr.cols)
    out[remote] = len(pr.gid) + np.searchsorted(halo_keys, pr.col_part[remote] * n +
                                                pr.cols[remote])
    return out


def send_plans(comm, asks: list[tuple[int, np.ndarray]], mine: np.ndarray, num_parts: int,
               n: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``asks``: (part p, its halo keys owner*N+v). Each key goes to the writer of its owner
    q as ``(q * K + p) * N + v``; returns, per own part q, the (destination parts, nodes)
    grouped by destination and ascending in each group."""
    k = np.int64(num_parts)
    keys = [((h // n) * k + p) * n + h % n for p, h in asks]
    keys = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
    (got,), _ = send_to(comm, writer_of(keys // n // k, num_parts, comm.size), keys)
    got.sort()
    out = {}
    for q in mine:
        lo, hi = np.searchsorted(got, [q * k * n, (q + 1) * k * n])
        block = got[lo:hi]
        out[int(q)] = ((block // n) % k, block % n)
    return out


def build_shards(comm, moved: Moved, num_parts: int, bounds: np.ndarray, parts: np.ndarray,
                 degree: np.ndarray, lo: int, n: int) -> tuple[list[Shard], int]:
    """The shards of this rank's parts and their edge cut (directed cut edges). Collective:
    two lookups/exchanges of O(distinct neighbours) int64 per rank."""
    check_key_range(n, num_parts)
    mine = my_parts(num_parts, comm.rank, comm.size)
    uniq = np.unique(moved.edge_keys % n)
    upart, udeg = lookup(comm, uniq, bounds, parts, degree, lo)
    prs = split_parts(moved, n, mine, lambda c: upart[np.searchsorted(uniq, c)])
    halos = [halo_of(pr, n) for pr in prs]
    plans = send_plans(comm, [(pr.part, h) for pr, (h, _) in zip(prs, halos)], mine,
                       num_parts, n)
    shards, cut = [], 0
    for pr, (hkeys, remote) in zip(prs, halos):
        cut += int(remote.sum())
        dests, sent = plans[pr.part]
        halo, owners = hkeys % n, hkeys // n
        indptr = np.zeros(len(pr.gid) + 1, dtype=np.int64)
        np.cumsum(np.bincount(np.searchsorted(pr.gid, pr.rows), minlength=len(pr.gid)),
                  out=indptr[1:])
        s = pr.sel
        shards.append(Shard(
            part_id=pr.part, num_parts=num_parts, global_id=pr.gid,
            features=moved.features[s], label=moved.label[s], degree=moved.degree[s],
            train_mask=moved.masks[s, 0], val_mask=moved.masks[s, 1], test_mask=moved.masks[s, 2],
            halo_global_id=halo, halo_degree=udeg[np.searchsorted(uniq, halo)],
            recv_counts=np.bincount(owners, minlength=num_parts).astype(np.int64),
            send_counts=np.bincount(dests, minlength=num_parts).astype(np.int64),
            send_index=np.searchsorted(pr.gid, sent).astype(np.int64),
            indptr=indptr, indices=local_indices(pr, hkeys, remote, n)))
    return shards, cut
