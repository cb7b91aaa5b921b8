"""``data.normalize_features`` on signed (real-valued) features: rows whose sum is not positive
or is near zero next to their absolute values are refused at start-up, naming a few global ids
and the fix, instead of being divided by ~0; all-zero rows (Citeseer has some) stay zero."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from _mpi import mpi_env
from conftest import check_ok, train

from hpcgnn.train.inputs import FeatureNormError, row_normalize

N, F = 60, 6
NEGATIVE, NEAR_ZERO = (7, 41), (23,)            # signed rows, by construction
ZERO = (5, 33)                                  # all-zero rows: legitimate


def features() -> np.ndarray:
    """Non-negative rows, two all-zero rows, two with a negative sum, one summing to ~1e-5."""
    rng = np.random.default_rng(1)
    x = rng.random((N, F)).astype(np.float32) + 0.1
    x[list(ZERO)] = 0.0
    x[list(NEGATIVE)] = -x[list(NEGATIVE)]
    x[NEAR_ZERO[0]] = [1.0, -1.0, 2.0, -2.0, 0.5, -0.49999]
    return x


def test_row_normalize_keeps_zero_rows_and_divides_the_others():
    x = np.delete(features(), list(NEGATIVE + NEAR_ZERO), axis=0)
    got = row_normalize(x)
    for i, row in enumerate(x.astype(np.float64)):
        want = row / row.sum() if row.any() else np.zeros(F)
        np.testing.assert_allclose(got[i], want, rtol=1e-6)
    zero = ~x.any(axis=1)
    assert got.dtype == np.float32 and zero.sum() == len(ZERO) and not got[zero].any()


def test_row_normalize_refuses_signed_rows_naming_them():
    ids = np.arange(N, dtype=np.int64) * 10 + 3                 # global ids differ from rows
    with pytest.raises(FeatureNormError) as err:
        row_normalize(features(), ids, part=1)
    text = str(err.value)
    assert "3 feature row(s) of part 1" in text
    for row in NEGATIVE + NEAR_ZERO:
        assert f"{row * 10 + 3} (sum " in text
    for row in ZERO:
        assert f"{row * 10 + 3} (sum" not in text
    assert "data.normalize_features = false" in text


def _directed_npz(path) -> None:
    """A directed random graph (edges one way only) with the features above."""
    rng = np.random.default_rng(2)
    dst, src = rng.integers(0, N, 240), rng.integers(0, N, 240)
    keep = dst != src
    dst, src = dst[keep], src[keep]
    order = np.lexsort((src, dst))
    indptr = np.r_[0, np.cumsum(np.bincount(dst, minlength=N))].astype(np.int64)
    idx = rng.permutation(N)
    np.savez(path, num_nodes=np.int64(N), adj_indptr=indptr, adj_indices=src[order].astype(np.int64),
             features=features(), labels=(np.arange(N) % 3).astype(np.int64),
             train_idx=np.sort(idx[:30]), val_idx=np.sort(idx[30:45]), test_idx=np.sort(idx[45:]))


@pytest.mark.mpi
def test_training_refuses_signed_features_with_row_normalisation(tmp_path):
    _directed_npz(tmp_path / "g.npz")
    shard_dir = tmp_path / "shards"
    check_ok(subprocess.run([sys.executable, "-m", "preprocess", "--dataset", f"npz:{tmp_path / 'g.npz'}",
                             "--parts", "3", "--partitioner", "random", "--out", str(shard_dir), "-q"],
                            capture_output=True, text=True, timeout=120, env=mpi_env(),
                            stdin=subprocess.DEVNULL))
    run = tmp_path / "run"
    proc = train(3, shard_dir, run, "data.normalize_features=true", "train.epochs=2", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    for row in NEGATIVE + NEAR_ZERO:                   # node ids are the npz rows
        assert f" {row} (sum " in proc.stderr, proc.stderr
    assert "--set data.normalize_features=false" in proc.stderr
    assert not (run / "metrics.jsonl").exists()        # stopped before the first epoch
    check_ok(train(3, shard_dir, run, "data.normalize_features=false", "train.epochs=2", timeout=120))
