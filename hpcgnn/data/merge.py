"""R ranks over a K-part shard set: rank ``r`` loads the ``g = K / R`` consecutive parts
``r*g .. r*g+g-1`` and merges them into ONE ``Shard`` of an R-part set (in memory only).

What changes in the merge (all local: every rank derives its own merged plan from its own
parts, no communication, no size handshake):

- owned rows: the union of the member parts' owned nodes, ascending global id (the format's
  order); their mutual halo rows become owned rows, so the edges between member parts no
  longer cross the wire;
- halo rows: the remaining halo rows of the members, deduplicated (two members may both need
  node ``v``), grouped by the *rank* that owns them (``owner part // g``), ascending global id
  inside each group;
- send blocks: for every other rank ``P``, the owned nodes that some part of ``P`` needs from
  some member part, deduplicated, ascending global id.

Invariant (what makes the exchange need no size handshake): rank ``Q``'s send block for ``P``
mapped to global ids equals rank ``P``'s halo block from ``Q``, in order. Both are
"the nodes of ``Q``'s parts that appear in a halo of ``P``'s parts, ascending", because each
part's ``send_index`` block for part ``p`` is part ``p``'s halo block from it (the shard
format's own invariant).

Memory: the merged owned arrays are allocated once, in merged order, and each member's rows are
scattered into them; with ``files`` the members were read without their features
(``read_shard(..., features=False)``) and their rows go from the file straight into the merged
array in blocks (``read_features_into``), so the rank holds its features once plus one block
(concatenating the members and then reordering held about 3x).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcgnn.data.shard import Shard, read_features_into

OWNED_FIELDS = ("features", "label", "train_mask", "val_mask", "test_mask", "degree")


def member_parts(rank: int, ranks: int, parts: int) -> range:
    """The consecutive parts rank ``rank`` of ``ranks`` loads from a ``parts``-part set."""
    g = parts // ranks
    return range(rank * g, (rank + 1) * g)


def merge_parts(members: list[Shard], rank: int, ranks: int,
                files: list[Path] | None = None) -> Shard:
    """One Shard (``part_id = rank``, ``num_parts = ranks``) from the consecutive parts
    ``members`` of a K-part set, K = ``ranks * len(members)``. ``files``: the members' part
    files, when the members were read without their features (then read from there)."""
    g = len(members)
    owned_gid = np.concatenate([m.global_id for m in members])
    order = np.argsort(owned_gid, kind="stable")
    owned_gid = owned_gid[order]
    dest = np.empty_like(order)
    dest[order] = np.arange(order.shape[0])          # member row (concatenated) -> merged row
    owned = _merged_owned(members, dest, files)
    halo_gid, halo_deg, recv_counts = _merged_halo(members, rank, ranks, g)
    send_gid, send_counts = _merged_sends(members, rank, ranks, g)
    send_index = np.searchsorted(owned_gid, send_gid).astype(np.int64)
    indptr, indices = _merged_graph(members, order, owned_gid, halo_gid)
    return Shard(part_id=rank, num_parts=ranks, global_id=owned_gid, **owned,
                 halo_global_id=halo_gid, halo_degree=halo_deg, recv_counts=recv_counts,
                 send_counts=send_counts, send_index=send_index, indptr=indptr, indices=indices)


def _merged_owned(members: list[Shard], dest: np.ndarray, files: list[Path] | None) -> dict:
    """The OWNED_FIELDS of the merged part, each allocated once and filled member by member
    (features from ``files`` when given, else from the members' arrays)."""
    owned, start = {}, 0
    for f in OWNED_FIELDS:
        first = getattr(members[0], f)
        owned[f] = np.empty((dest.shape[0], *first.shape[1:]), dtype=first.dtype)
    for i, m in enumerate(members):
        rows = dest[start:start + m.n_owned]
        for f in OWNED_FIELDS:
            if f == "features" and files is not None:
                read_features_into(files[i], owned[f], rows)
            else:
                owned[f][rows] = getattr(m, f)
        start += m.n_owned
    return owned


def _halo_owner_parts(m: Shard) -> np.ndarray:
    """Owner part of each of ``m``'s halo slots (the slots are grouped by owner part)."""
    return np.repeat(np.arange(m.num_parts), m.recv_counts)


def _merged_halo(members: list[Shard], rank: int, ranks: int, g: int):
    """(halo global ids, their degrees, recv_counts [ranks]): members' halo rows owned by
    other ranks, unique, sorted by (owner rank, global id)."""
    gid = np.concatenate([m.halo_global_id for m in members])
    deg = np.concatenate([m.halo_degree for m in members])
    owner = np.concatenate([_halo_owner_parts(m) for m in members]) // g
    keep = owner != rank
    gid, deg, owner = gid[keep], deg[keep], owner[keep]
    order = np.lexsort((gid, owner))
    gid, deg, owner = gid[order], deg[order], owner[order]
    first = np.ones(gid.shape[0], dtype=bool)
    first[1:] = gid[1:] != gid[:-1]                  # same node => same owner: adjacent
    gid, deg, owner = gid[first], deg[first], owner[first]
    return gid, deg, np.bincount(owner, minlength=ranks).astype(np.int64)


def _merged_sends(members: list[Shard], rank: int, ranks: int, g: int):
    """(global ids to send, grouped by destination rank and ascending, send_counts [ranks])."""
    gid, dest = [], []
    for m in members:
        dest_part = np.repeat(np.arange(m.num_parts), m.send_counts)
        gid.append(m.global_id[m.send_index])
        dest.append(dest_part // g)
    gid, dest = np.concatenate(gid), np.concatenate(dest)
    keep = dest != rank
    gid, dest = gid[keep], dest[keep]
    order = np.lexsort((gid, dest))
    gid, dest = gid[order], dest[order]
    first = np.ones(gid.shape[0], dtype=bool)
    first[1:] = (gid[1:] != gid[:-1]) | (dest[1:] != dest[:-1])
    gid, dest = gid[first], dest[first]
    return gid, np.bincount(dest, minlength=ranks).astype(np.int64)


def _merged_graph(members: list[Shard], order: np.ndarray, owned_gid: np.ndarray,
                  halo_gid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR over the merged owned rows: columns renumbered to merged owned / halo slots."""
    n = owned_gid.shape[0]
    halo_sorted = np.argsort(halo_gid, kind="stable")
    counts, cols = [], []
    for m in members:
        col_gid = np.concatenate([m.global_id, m.halo_global_id])[m.indices]
        pos, is_owned = _find(owned_gid, col_gid)
        hpos, _ = _find(halo_gid[halo_sorted], col_gid)
        cols.append(np.where(is_owned, pos, n + halo_sorted[hpos] if halo_gid.size else 0))
        counts.append(np.diff(m.indptr))
    counts = np.concatenate(counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    cols = np.concatenate(cols)
    counts, starts = counts[order], starts[order]              # rows in merged owned order
    gather = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + \
        np.arange(int(counts.sum()))
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return indptr, cols[gather]


def _find(sorted_keys: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position of each query in ``sorted_keys`` (clipped), whether it is there)."""
    if sorted_keys.size == 0:
        return np.zeros(query.shape, np.int64), np.zeros(query.shape, bool)
    pos = np.searchsorted(sorted_keys, query).clip(max=sorted_keys.size - 1)
    return pos, sorted_keys[pos] == query
