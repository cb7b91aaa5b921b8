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

import numpy as np

from hpcgnn.data.merge import member_parts, merge_parts
from hpcgnn.data.shard import (META_NAME, Shard, ShardFormatError, part_name, read_global_ids,
                               read_meta, read_shard, sha256_file)


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

    def read_part(self, part: int, verify_hash: bool = True, features: bool = True) -> Shard:
        path = self.part_path(part)
        if verify_hash and path.is_file() and sha256_file(path) != self.meta["parts"][part]["sha256"]:
            raise ShardFormatError(f"{path}: sha256 differs from meta.json (corrupt or replaced "
                                   f"file); re-run `python -m preprocess` to rewrite the shard set")
        return read_shard(path, part_id=part, num_parts=self.num_parts, features=features)
