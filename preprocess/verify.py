"""Independent re-check of a shard set: checksums, counts, each part's edges, the halo
invariant. It shares only the file format with the writer, none of its logic; the check of a
part against its ``meta.json`` entry is the one training's load runs
(``hpcgnn.data.shardset.check_part_against_meta``)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcgnn.data.shard import Shard, ShardFormatError, num_train, part_name, read_meta, \
    read_shard, sha256_file
from hpcgnn.data.shardset import check_part_against_meta
from hpcgnn.data.validate import PREDICT_ONLY

log = logging.getLogger("hpcgnn.preprocess")
FIX = "re-run `python -m preprocess ... --force` to rewrite the shard set"


@dataclass
class PartPlan:
    """What the global checks need of one part (not its features or edges)."""

    global_id: np.ndarray
    degree: np.ndarray
    halo_global_id: np.ndarray
    halo_degree: np.ndarray
    recv_counts: np.ndarray
    send_counts: np.ndarray
    sent_global_id: np.ndarray       # global ids of send_index, grouped by destination


@dataclass(frozen=True)
class VerifyReport:
    num_parts: int
    num_nodes: int
    num_edges: int
    num_halo: int
    edge_cut: int

    def __str__(self) -> str:
        return (f"{self.num_parts} parts, {self.num_nodes:,} nodes, {self.num_edges:,} edges, "
                f"{self.num_halo:,} halo rows, edge cut {self.edge_cut:,}")


def _need(cond: bool, where: Path | str, what: str) -> None:
    if not cond:
        raise ShardFormatError(f"{where}: {what}; {FIX}")


def _check_file(directory: Path, p: int, entries: list[dict]) -> Path:
    path, entry = directory / part_name(p), entries[p]
    _need(entry["file"] == path.name, directory / "meta.json",
          f"parts[{p}] names {entry['file']!r}, expected {path.name!r}")
    _need(path.is_file(), path, "missing")
    sha = sha256_file(path)
    if sha != entry["sha256"]:
        same = [e["file"] for e in entries if e["sha256"] == sha]
        _need(False, path, f"holds the bytes meta.json gives for {same[0]}: part files were "
              f"swapped or renamed (give each its own name back)" if same else "sha256 differs "
              "from meta.json (the file is corrupted, truncated or from another run)")
    return path


def _check_edges(s: Shard, path: Path) -> None:
    """Local CSR: full in-neighbourhoods, no self-loops, no duplicates, every halo slot used."""
    n, width = s.n_owned, s.n_owned + s.n_halo
    _need(np.array_equal(np.diff(s.indptr), s.degree), path,
          "graph/indptr row lengths differ from nodes/degree (an in-neighbourhood is incomplete)")
    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(s.indptr))
    _need(not bool(np.any(rows == s.indices)), path, "graph/indices holds a self-loop")
    keys = np.sort(rows * width + s.indices)
    _need(not bool(np.any(keys[1:] == keys[:-1])), path, "graph/indices repeats an edge")
    used = np.bincount(s.indices[s.indices >= n] - n, minlength=s.n_halo)
    _need(bool(np.all(used > 0)), path, "a halo slot is used by no edge")


def _check_halo_groups(s: Shard, path: Path) -> None:
    owner = np.repeat(np.arange(s.num_parts), s.recv_counts)
    key = owner * (int(s.halo_global_id.max(initial=0)) + 1) + s.halo_global_id
    _need(bool(np.all(np.diff(key) > 0)), path, "halo/global_id is not ascending within each "
          "owner's group")


def _read_part(directory: Path, p: int, meta: dict) -> tuple[PartPlan, int, int]:
    entry = meta["parts"][p]
    path = _check_file(directory, p, meta["parts"])
    s = read_shard(path, part_id=p, num_parts=meta["num_parts"])
    check_part_against_meta(s, path, entry, meta, FIX)
    _check_edges(s, path)
    _check_halo_groups(s, path)
    plan = PartPlan(s.global_id, s.degree, s.halo_global_id, s.halo_degree, s.recv_counts,
                    s.send_counts, s.global_id[s.send_index])
    return plan, int(np.count_nonzero(s.indices >= s.n_owned)), num_train(s)


def _check_nodes(directory: Path, plans: list[PartPlan], meta: dict) -> np.ndarray:
    """Owned nodes partition 0..N-1; returns the owner of every node."""
    n = meta["num_nodes"]
    ids = np.concatenate([pl.global_id for pl in plans])
    _need(len(ids) == n and np.array_equal(np.sort(ids), np.arange(n)), directory,
          f"the parts' owned nodes are not exactly the nodes 0..{n - 1}")
    owner = np.empty(n, dtype=np.int64)
    owner[ids] = np.repeat(np.arange(len(plans)), [len(pl.global_id) for pl in plans])
    return owner


def _check_count_matrix(directory: Path, plans: list[PartPlan]) -> None:
    """What p receives from q is what q says it sends to p."""
    recv = np.stack([pl.recv_counts for pl in plans])
    send = np.stack([pl.send_counts for pl in plans])
    bad = np.argwhere(recv != send.T)
    if bad.size:
        p, q = bad[0]
        _need(False, directory / part_name(p), f"halo/recv_counts from part {q} differ from "
              f"part {q}'s halo/send_counts to it")


def _check_halo_owners(directory: Path, plans: list[PartPlan], owner: np.ndarray) -> None:
    """Each halo node comes from its owner, with the owner's degree."""
    degree = np.empty(len(owner), dtype=np.int64)
    for pl in plans:
        degree[pl.global_id] = pl.degree
    groups = np.arange(len(plans))
    for p, pl in enumerate(plans):
        where = directory / part_name(p)
        _need(np.array_equal(owner[pl.halo_global_id], np.repeat(groups, pl.recv_counts)),
              where, "a halo node is not owned by the part it is received from")
        _need(np.array_equal(pl.halo_degree, degree[pl.halo_global_id]), where,
              "halo/degree differs from the owner's nodes/degree")


def _check_send_order(directory: Path, plans: list[PartPlan]) -> None:
    """The invariant: all sends ordered by (destination, source, position), as global ids,
    equal all halos in file order (each grouped by owner)."""
    k = len(plans)
    dst = np.concatenate([np.repeat(np.arange(k), pl.send_counts) for pl in plans])
    src = np.concatenate([np.full(len(pl.sent_global_id), q) for q, pl in enumerate(plans)])
    seq = np.concatenate([np.arange(len(pl.sent_global_id)) for pl in plans])
    sent = np.concatenate([pl.sent_global_id for pl in plans])[np.lexsort((seq, src, dst))]
    halo = np.concatenate([pl.halo_global_id for pl in plans])
    if not np.array_equal(sent, halo):
        first = int(np.argmax(sent != halo))
        ends = np.cumsum([len(pl.halo_global_id) for pl in plans])
        p = int(np.searchsorted(ends, first, side="right"))
        _need(False, directory / part_name(p), "halo/global_id differs from what its peers' "
              "halo/send_index sends it (halo invariant broken)")


def verify_shards(directory: str | Path) -> VerifyReport:
    """Check the shard set in ``directory``; raise ShardFormatError naming the file and fix."""
    directory = Path(directory)
    meta = read_meta(directory)
    plans, cut, train, t0 = [], 0, 0, time.perf_counter()
    bad: list[str] = []                  # every damaged part is named, not only the first
    for p in range(meta["num_parts"]):
        try:
            plan, part_cut, part_train = _read_part(directory, p, meta)
        except ShardFormatError as exc:
            bad.append(str(exc))
            log.info("part %d/%d: damaged (%.1f s)", p + 1, meta["num_parts"],
                     time.perf_counter() - t0)
            continue
        plans.append(plan)
        cut += part_cut
        train += part_train
        log.info("part %d/%d: checked %s owned, %s halo, %s edges (%.1f s)", p + 1,
                 meta["num_parts"], f"{len(plan.global_id):,}", f"{len(plan.halo_global_id):,}",
                 f"{meta['parts'][p]['num_edges']:,}", time.perf_counter() - t0)
    if len(bad) > 1:                     # one line (a batch log's error line), one fix
        each = "; ".join(b.removesuffix(f"; {FIX}") for b in bad)
        raise ShardFormatError(f"{each} ({len(bad)} of {meta['num_parts']} parts failed the "
                               f"check); {FIX}")
    if bad:
        raise ShardFormatError(bad[0])
    if train == 0:
        log.warning("%s: no part holds a labelled training node: %s", directory, PREDICT_ONLY)
    owner = _check_nodes(directory, plans, meta)
    _check_count_matrix(directory, plans)
    _check_halo_owners(directory, plans, owner)
    _check_send_order(directory, plans)
    edges = sum(e["num_edges"] for e in meta["parts"])
    _need(edges == meta["num_edges"], directory / "meta.json",
          f"parts hold {edges} edges, num_edges says {meta['num_edges']}")
    _need(cut == meta["edge_cut"], directory / "meta.json",
          f"parts hold {cut} cut edges, edge_cut says {meta['edge_cut']}")
    halo = sum(len(pl.halo_global_id) for pl in plans)
    log.info("across parts: owners, counts and the halo invariant hold (%.1f s)",
             time.perf_counter() - t0)
    return VerifyReport(meta["num_parts"], meta["num_nodes"], edges, halo, cut)
