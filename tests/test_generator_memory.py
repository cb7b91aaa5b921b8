"""The cSBM generator makes its float32 features without float64 copies of the whole matrix.

``csbm`` draws ``signal * mu_class + N(0, I)`` in float64 and rounds it to float32. Drawn for
the whole matrix at once it held two float64 temporaries beside the float32 result (numpy's
peak about 4x the features: 710 MiB resident for a 300k x 128 graph whose features are 147 MiB);
drawn by blocks of rows it holds the result and one block, with the same draws and bits.
"""
from __future__ import annotations

import tracemalloc

import numpy as np

from hpcgnn.data import synthetic

OPTS = dict(nodes=20000, classes=4, degree=4, features=128, homophily=0.8, signal=1.0, seed=3)


def reference_features(nodes, classes, degree, features, signal, seed, **_):
    """The cSBM's features drawn as one float64 matrix, replaying the generator's draws in
    order (labels, the edges' four draws, the class means, the noise)."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(nodes, dtype=np.int64) % classes)
    m = int(nodes * degree / 2)
    rng.integers(0, nodes, size=m, dtype=np.int64)
    rng.random(m)
    rng.integers(1, classes, size=m)
    rng.random(m)
    means = rng.standard_normal((classes, features))
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    return (signal * means[labels] + rng.standard_normal((nodes, features))).astype(np.float32)


def test_features_are_the_whole_matrix_draws_bit_for_bit(monkeypatch):
    monkeypatch.setattr(synthetic, "CHUNK", 1000)         # many blocks, the last one short
    g = synthetic.csbm(**OPTS)
    np.testing.assert_array_equal(g.features, reference_features(**OPTS))
    assert g.features.dtype == np.float32


def test_peak_allocation_stays_near_the_features(monkeypatch):
    monkeypatch.setattr(synthetic, "CHUNK", 1 << 16)      # blocks of 512 KiB of float64
    synthetic.csbm(nodes=100, features=8)                 # caches warm, outside the count
    tracemalloc.start()
    try:
        g = synthetic.csbm(**OPTS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    edges = int(OPTS["nodes"] * OPTS["degree"] / 2)
    # the float32 features, two float64 blocks, and the edges' int64 temporaries (generous)
    bound = g.features.nbytes + 2 * 8 * (1 << 16) + 16 * 8 * 2 * edges
    assert peak <= bound, f"peak {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"
