"""A shard set on disk, opened once: ``DIR/meta.json`` read and checked a single time, its hash
taken from the same bytes, and the parts handed to whoever needs them (the halo algorithm's
rank, the CAGNET grids' block builders, the run record). Nothing else re-reads ``meta.json``.

A K-part set runs on any R ranks with R dividing K: ``load(rank, R)`` reads the K/R consecutive
parts ``hpcgnn.data.merge.member_parts`` and merges them into one part of an R-part set.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from hpcgnn.data.errors import H5_ERRORS, hdf5_fix
from hpcgnn.data.merge import member_parts, merge_parts
from hpcgnn.data.shard import (DATASETS, META_NAME, NUM_TRAIN, Shard, ShardFormatError, num_train,
                               part_name, read_global_ids, read_meta, read_shard, sha256_file)


@dataclass(frozen=True)
class ShardSet:
    """``path``: the directory; ``meta``: its checked ``meta.json``; ``meta_sha256``: the hash
    of those bytes (what a run records and ``--resume`` compares)."""

    path: Path
    meta: dict
    meta_sha256: str

    @classmethod
    def open(cls, path: str | Path) -> "ShardSet":
        """Read and check ``path/meta.json``; raises ``ShardFormatError`` naming the fix."""
        path = Path(path)
        meta = read_meta(path)
        return cls(path, meta, hashlib.sha256((path / META_NAME).read_bytes()).hexdigest())

    @property
    def num_parts(self) -> int:
        return int(self.meta["num_parts"])

    @property
    def part_sizes(self) -> list[int]:
        """Owned rows of every part."""
        return [int(p["num_owned"]) for p in self.meta["parts"]]

    def part_path(self, part: int) -> Path:
        return self.path / self.meta["parts"][part].get("file", part_name(part))

    def global_ids(self, part: int) -> np.ndarray:
        """Part ``part``'s owned global ids (one dataset of its file)."""
        return read_global_ids(self.path, part)

    def check_ranks(self, size: int) -> None:
        """Refuse ``size`` ranks unless it divides the part count (the fix names the counts)."""
        k = self.num_parts
        if size < 1 or k % size:
            fits = [r for r in range(1, k + 1) if k % r == 0]
            raise ShardFormatError(
                f"{self.path / META_NAME}: the shard set has {k} parts but the job has {size} "
                f"ranks; launch with `mpirun -n R` for R dividing {k} ({', '.join(map(str, fits))}), "
                f"or re-run `python -m preprocess --parts {size} --out DIR` (or a multiple of {size})")

    def load(self, rank: int, size: int, verify_hash: bool = True) -> Shard:
        """Rank ``rank`` of ``size``'s part: one part, or the K/R parts merged."""
        self.check_ranks(size)
        parts = member_parts(rank, size, self.num_parts)
        if len(parts) == 1:
            return self.read_part(parts[0], verify_hash)
        # merged: the members' features go from their files straight into the merged array
        members = [self.read_part(p, verify_hash, features=False) for p in parts]
        return merge_parts(members, rank, size, [self.part_path(p) for p in parts])

    def check_trainable(self, own: int | None = None) -> None:
        """Raise ``ShardFormatError`` for a set without a labelled training node (one to predict
        on), from ``meta.json``'s counts. A set written before ``meta.json`` counted them is
        checked by a rank whose own rows hold ``own = 0`` training nodes: it reads the other
        parts' masks (no message passing, so every such rank decides alike)."""
        counts = [p.get(NUM_TRAIN) for p in self.meta["parts"]]
        if None not in counts:
            if sum(counts) == 0:
                _no_training_node(self.path / META_NAME, "its parts' num_train sum to 0")
            return
        if own == 0 and not any(read_train_count(self.part_path(p)) for p in range(self.num_parts)):
            _no_training_node(self.path, "no part's nodes/train_mask selects a labelled node")

    def read_part(self, part: int, verify_hash: bool = True, features: bool = True) -> Shard:
        path = self.part_path(part)
        if verify_hash and path.is_file() and sha256_file(path) != self.meta["parts"][part]["sha256"]:
            raise ShardFormatError(f"{path}: sha256 differs from meta.json (corrupt or replaced "
                                   f"file); re-run `python -m preprocess` to rewrite the shard set")
        shard = read_shard(path, part_id=part, num_parts=self.num_parts, features=features)
        check_part_against_meta(shard, path, self.meta["parts"][part], self.meta)
        return shard


def check_part_against_meta(s: Shard, path: Path, entry: dict, meta: dict,
                            fix: str = "re-run `python -m preprocess` to rewrite the shard "
                                       "set") -> None:
    """What ``meta.json`` records of a part (its ``entry``) against the arrays read from
    ``path``, and its labels against ``num_classes`` (a part swapped in with a recomputed
    sha256); training's load and ``python -m preprocess verify`` both run it."""
    for key, value in (("num_owned", s.n_owned), ("num_halo", s.n_halo),
                       ("num_edges", s.num_edges), (NUM_TRAIN, num_train(s))):
        if entry.get(key, value) != value:
            raise ShardFormatError(f"{path}: holds {value} for {key}, {META_NAME} says "
                                   f"{entry[key]} (a part of another shard set?); {fix}")
    if s.n_owned and s.feature_dim != meta["feature_dim"]:
        raise ShardFormatError(f"{path}: features have {s.feature_dim} columns, {META_NAME} "
                               f"says feature_dim = {meta['feature_dim']}; {fix}")
    low, high = (int(s.label.min()), int(s.label.max())) if s.n_owned else (-1, -1)
    if low < -1 or high >= meta["num_classes"]:
        raise ShardFormatError(
            f"{path}: nodes/label holds {low if low < -1 else high}, but {META_NAME} says "
            f"num_classes = {meta['num_classes']} (labels must be -1 or 0..num_classes-1); {fix}")
    if bool(np.any(s.train_mask & (s.label < 0))):
        raise ShardFormatError(f"{path}: nodes/train_mask selects an unlabelled node (label "
                               f"-1); {fix} from an input whose training nodes are labelled")


def read_train_count(path: Path) -> int:
    """Labelled training nodes of one part file, from its mask and labels alone."""
    try:
        with h5py.File(path, "r") as f:
            mask = np.asarray(f[DATASETS["train_mask"][0]][...], dtype=bool)
            label = np.asarray(f[DATASETS["label"][0]][...], dtype=np.int64)
    except H5_ERRORS as exc:
        fix = hdf5_fix(exc, "re-run `python -m preprocess` to rewrite the shard set")
        raise ShardFormatError(f"{path}: cannot read nodes/train_mask ({exc}); {fix}") from exc
    return int(np.count_nonzero(mask & (label >= 0))) if mask.shape == label.shape else 0


def _no_training_node(where: Path, why: str) -> None:
    raise ShardFormatError(f"{where}: the shard set has no labelled training node ({why}), so "
                           f"training would learn nothing (it is a set to predict on); re-run "
                           f"`python -m preprocess` on an input with a training split (train_idx "
                           f"of labelled nodes)")
