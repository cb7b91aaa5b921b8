"""Merging K/R parts on a rank holds at most ~1.5x the rank's own feature bytes.

``load_part`` on R ranks of a K-part set reads K/R members and merges them. The members'
features go from their files straight into the one merged array (in merged order, a block at a
time), so the peak of the numpy allocations (numpy reports them to ``tracemalloc``) stays near
the merged features themselves; concatenating the members and then reordering held about 3x.
Features are wide here (512 floats per node against ~8 edges), so they dominate what a rank
holds, as on the graphs where this matters.
"""
from __future__ import annotations

import shutil
import tracemalloc

import h5py
import numpy as np
import pytest

from hpcgnn.data.shard import ShardFormatError
from hpcgnn.train.inputs import load_part

WIDE = "csbm:nodes=30000,classes=4,degree=8,features=512,seed=3"


@pytest.mark.parametrize("ranks", [2, 4])
def test_merge_peak_is_at_most_1_5x_the_features(shards, ranks):
    shard_dir = shards(WIDE, 8, "metis")
    load_part(shard_dir, 0, 8)                      # imports and caches warm, outside the count
    tracemalloc.start()
    try:
        _, merged = load_part(shard_dir, 0, ranks)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    features = merged.features.nbytes
    assert merged.features.shape == (merged.n_owned, 512) and merged.features.flags.writeable
    assert peak <= 1.5 * features, f"peak {peak / features:.2f}x the merged features"
    _, whole = load_part(shard_dir, 0, 1) if ranks == 2 else (None, None)
    if whole is not None:                           # the values, in merged order
        at = np.searchsorted(whole.global_id, merged.global_id)
        assert np.array_equal(merged.features, whole.features[at])


def test_a_member_with_nan_features_is_refused_naming_it(shards, tmp_path):
    bad = tmp_path / "shards"
    shutil.copytree(shards("cora", 4, "metis"), bad)
    with h5py.File(bad / "part-00001.h5", "r+") as f:
        f["nodes/features"][3, 2] = np.nan
    with pytest.raises(ShardFormatError, match=r"part-00001\.h5: nodes/features holds NaN"):
        load_part(bad, 0, 2, verify_hash=False)      # parts 0 and 1 merged on rank 0
