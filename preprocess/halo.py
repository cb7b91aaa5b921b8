"""Halo maps: from a part assignment to one ``Shard`` per part.

Every cross-part edge ``u <- v`` (``v`` owned by ``q``, ``u`` by ``p``) makes ``v`` a halo node
of ``p`` received from ``q``. The distinct pairs ``(v, p)`` (found part by part) are kept in two
orders: by ``(p, q, v)`` they are every part's halo lists, by ``(q, p, v)`` every part's send
lists. Both orders list the
same ``v`` ascending within a ``(q, p)`` block, which is the invariant: ``q``'s send block to
``p`` equals ``p``'s halo block from ``q``, in order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcgnn.data.graph import Graph
from hpcgnn.data.shard import Shard
from preprocess.errors import PreprocessError


@dataclass(frozen=True)
class PartLayout:
    """Owned nodes of every part (ascending global id) and every node's local index."""

    num_parts: int
    parts: np.ndarray      # int64 [N], part of each node
    order: np.ndarray      # int64 [N], nodes grouped by part, ascending within a part
    offsets: np.ndarray    # int64 [P + 1], part p owns order[offsets[p]:offsets[p + 1]]
    local: np.ndarray      # int64 [N], index of each node among its part's owned nodes

    @classmethod
    def build(cls, parts: np.ndarray, num_parts: int) -> "PartLayout":
        order = np.argsort(parts, kind="stable").astype(np.int64)
        counts = np.bincount(parts, minlength=num_parts)
        offsets = np.zeros(num_parts + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        local = np.empty(len(parts), dtype=np.int64)
        local[order] = np.arange(len(parts), dtype=np.int64) - np.repeat(offsets[:-1], counts)
        return cls(num_parts, parts, order, offsets, local)

    def owned(self, p: int) -> np.ndarray:
        return self.order[self.offsets[p]:self.offsets[p + 1]]


@dataclass(frozen=True)
class HaloPairs:
    """Distinct (halo node, receiving part) pairs, as keys in the two orders described above."""

    num_nodes: int
    num_parts: int
    by_sender: np.ndarray      # sorted keys (q * P + p) * N + v
    by_receiver: np.ndarray    # sorted keys (p * P + q) * N + v
    edge_cut: int              # directed edges (CSR entries) whose ends lie in different parts

    @classmethod
    def build(cls, graph: Graph, layout: PartLayout) -> "HaloPairs":
        """One pass over the parts: each part's distinct remote in-neighbours, found by marking
        them in an N-sized bitmap (O(N + edges of the part), no sort of the cut edges)."""
        n, k, parts = np.int64(graph.num_nodes), np.int64(layout.num_parts), layout.parts
        mark = np.zeros(graph.num_nodes, dtype=bool)
        blocks, edge_cut = [], 0
        for p in range(layout.num_parts):
            _, cols = gather_rows(graph.indptr, graph.indices, layout.owned(p))
            remote = cols[parts[cols] != p]
            edge_cut += len(remote)
            mark[remote] = True
            halo = np.flatnonzero(mark)                   # distinct, ascending
            mark[halo] = False
            blocks.append(np.sort((p * k + parts[halo]) * n + halo))
        by_receiver = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)
        v, pq = by_receiver % n, by_receiver // n
        by_sender = np.sort(((pq % k) * k + pq // k) * n + v)      # distinct pairs only
        return cls(graph.num_nodes, layout.num_parts, by_sender, by_receiver, edge_cut)

    def _block(self, keys: np.ndarray, part: int) -> tuple[np.ndarray, np.ndarray]:
        """(nodes, peer part) of the keys whose leading part is ``part``."""
        n, k = np.int64(self.num_nodes), np.int64(self.num_parts)
        lo, hi = np.searchsorted(keys, [part * k * n, (part + 1) * k * n])
        block = keys[lo:hi]
        return block % n, (block // n) % k

    def halo(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        """Part ``p``'s halo nodes (grouped by owner, ascending) and their owners."""
        return self._block(self.by_receiver, p)

    def sends(self, q: int) -> tuple[np.ndarray, np.ndarray]:
        """Nodes part ``q`` sends (grouped by destination, ascending) and their destinations."""
        return self._block(self.by_sender, q)


def check_key_range(num_nodes: int, num_parts: int) -> None:
    """Keys ``(part * P + part) * N + node`` must fit int64."""
    if num_parts * num_parts * num_nodes >= np.iinfo(np.int64).max:
        raise PreprocessError(f"{num_parts} parts x {num_nodes:,} nodes overflow the int64 halo "
                              f"keys (parts^2 x nodes must stay below 2^63); use fewer parts")


def gather_rows(indptr: np.ndarray, indices: np.ndarray,
                rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sub-CSR of ``rows``: (local indptr, the global column ids of those rows)."""
    deg = indptr[rows + 1] - indptr[rows]
    sub_indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(deg, out=sub_indptr[1:])
    pos = np.arange(sub_indptr[-1], dtype=np.int64) + np.repeat(indptr[rows] - sub_indptr[:-1], deg)
    return sub_indptr, indices[pos]


def local_columns(cols: np.ndarray, owned: np.ndarray, halo: np.ndarray,
                  scratch: np.ndarray) -> np.ndarray:
    """Global column ids -> local ids (owned index, or ``n_owned + halo slot``) by one gather
    from ``scratch`` (int64 [N], reused across parts: only this part's entries are read)."""
    scratch[owned] = np.arange(len(owned), dtype=np.int64)
    scratch[halo] = np.arange(len(owned), len(owned) + len(halo), dtype=np.int64)
    return scratch[cols]


def masks(graph: Graph) -> dict[str, np.ndarray]:
    """bool [N] train/val/test masks."""
    out = {}
    for name in ("train", "val", "test"):
        m = np.zeros(graph.num_nodes, dtype=bool)
        m[getattr(graph, f"{name}_idx")] = True
        out[f"{name}_mask"] = m
    return out


def build_shard(graph: Graph, layout: PartLayout, pairs: HaloPairs, node_masks: dict,
                degree: np.ndarray, p: int, scratch: np.ndarray) -> Shard:
    """The shard of part ``p``: owned nodes, halo, send plan and local CSR."""
    owned = layout.owned(p)
    halo, owners = pairs.halo(p)
    sent, dests = pairs.sends(p)
    indptr, cols = gather_rows(graph.indptr, graph.indices, owned)
    k = layout.num_parts
    return Shard(
        part_id=p, num_parts=k, global_id=owned, features=graph.dense_features(owned),
        label=graph.labels[owned], degree=degree[owned],
        **{name: m[owned] for name, m in node_masks.items()},
        halo_global_id=halo, halo_degree=degree[halo],
        recv_counts=np.bincount(owners, minlength=k).astype(np.int64),
        send_counts=np.bincount(dests, minlength=k).astype(np.int64),
        send_index=layout.local[sent],
        indptr=indptr, indices=local_columns(cols, owned, halo, scratch))
