"""A rank's training inputs: its shard (and only its shard), checked against the job.

``load_part`` opens the shard set (``hpcgnn.data.shardset``) and reads this rank's part(s)
(one part when the set has as many parts as the job has ranks; K/R consecutive parts merged
into one when R divides K); it fails with a message naming the file and the fix when the shard
set does not fit the job (R does not divide K, missing or corrupt file). ``part_tensors`` turns
the part into tensors on the rank's device (with optional, checked, row normalisation).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hpcgnn.data.shard import Shard
from hpcgnn.data.shardset import ShardSet


@dataclass
class PartInputs:
    """Tensors of the owned nodes on the rank's device."""

    x: torch.Tensor            # float32 (n_owned, F)
    y: torch.Tensor            # int64 (n_owned,)
    train: torch.Tensor        # bool (n_owned,)
    val: torch.Tensor
    test: torch.Tensor
    global_id: torch.Tensor    # int64 (n_owned,)


def load_part(shards: str | Path, rank: int, size: int, verify_hash: bool = True) -> tuple[dict, Shard]:
    """(meta, this rank's Shard) of the shard set at ``shards`` (``ShardSet.load``)."""
    shard_set = ShardSet.open(shards)
    return shard_set.meta, shard_set.load(rank, size, verify_hash)


# A row is divided by its sum only when the sum is at least this share of the row's absolute
# sum: bag-of-words rows (non-negative) have share 1; signed rows can sum to ~0 and explode.
MIN_SUM_SHARE = 1e-2
SHOWN_ROWS = 5


class FeatureNormError(ValueError):
    """``data.normalize_features`` on rows that cannot be row-normalised (signed features)."""


def row_normalize(x: np.ndarray, global_id: np.ndarray | None = None, part: int | None = None) -> np.ndarray:
    """Each row divided by its sum (all-zero rows stay 0), float32 ``(n, F)``.

    Raises ``FeatureNormError`` naming a few rows (``global_id``, else row numbers) when a
    non-zero row's sum is not positive or under ``MIN_SUM_SHARE`` of its absolute sum: dividing
    by it would blow the row up (real-valued features want ``data.normalize_features = false``)."""
    s64 = x.sum(axis=1, dtype=np.float64)
    bad = np.flatnonzero(s64 < MIN_SUM_SHARE * np.abs(x).sum(axis=1, dtype=np.float64))
    bad = bad[np.any(x[bad] != 0, axis=1)]
    if bad.size:
        raise FeatureNormError(_norm_error(s64, bad, global_id, part))
    s = x.sum(axis=1, keepdims=True)
    return (x / np.where(s == 0, 1.0, s)).astype(np.float32, copy=False)   # already float32


def _norm_error(s: np.ndarray, bad: np.ndarray, global_id: np.ndarray | None, part: int | None) -> str:
    ids = bad if global_id is None else np.asarray(global_id)[bad]
    shown = ", ".join(f"{int(i)} (sum {s[r]:.3g})" for i, r in zip(ids[:SHOWN_ROWS], bad[:SHOWN_ROWS]))
    more = f" and {bad.size - SHOWN_ROWS} more" if bad.size > SHOWN_ROWS else ""
    where = f" of part {part}" if part is not None else ""
    return (f"data.normalize_features = true, but {bad.size} feature row(s){where} have a sum that is "
            f"not positive or is near zero next to their absolute values (global ids {shown}{more}); "
            f"dividing by it would blow those rows up. Fix: set data.normalize_features = false "
            f"in the run config (or --set data.normalize_features=false) for real-valued or signed "
            f"features; row normalisation is for non-negative (bag-of-words) features")


def part_tensors(shard: Shard, normalize: bool, device: torch.device) -> PartInputs:
    x = row_normalize(shard.features, shard.global_id, shard.part_id) if normalize else shard.features
    t = lambda a, dt: torch.as_tensor(np.ascontiguousarray(a), dtype=dt).to(device)  # noqa: E731
    return PartInputs(x=t(x, torch.float32), y=t(shard.label, torch.long),
                      train=t(shard.train_mask, torch.bool), val=t(shard.val_mask, torch.bool),
                      test=t(shard.test_mask, torch.bool), global_id=t(shard.global_id, torch.long))
