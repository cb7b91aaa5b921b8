"""The PT-Scotch strategy choice and the isolated-vertex fill (preprocess/ptscotch.py), in one
process (MPI.COMM_SELF); the distributed runs are in test_preprocess_dist.py."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from preprocess import ptscotch as pts


def test_fill_isolated_evens_the_parts():
    rng = np.random.default_rng(0)
    parts = np.repeat(np.arange(4), [50, 30, 10, 0])          # non-isolated: 90 vertices
    isolated = np.zeros(150, dtype=bool)
    parts = np.concatenate([parts, np.zeros(60, dtype=np.int64)])
    isolated[90:] = True
    perm = rng.permutation(150)
    from mpi4py import MPI                                 # a real one-rank communicator
    out = pts.fill_isolated(MPI.COMM_SELF, parts[perm], isolated[perm], 4)
    assert (out[~isolated[perm]] == parts[perm][~isolated[perm]]).all()   # others untouched
    assert sorted(np.bincount(out, minlength=4)) == [33, 33, 34, 50]     # 60 filled below 50


def test_strategy_env(monkeypatch):
    monkeypatch.delenv(pts.STRATEGY_ENV, raising=False)
    assert pts.strategy_flags() is None                                  # "fast"
    monkeypatch.setenv(pts.STRATEGY_ENV, "speed,balance")
    assert pts.strategy_flags() == 0x6
    monkeypatch.setenv(pts.STRATEGY_ENV, "fastest")
    with pytest.raises(pts.PtScotchError, match="fastest"):
        pts.strategy_flags()
    monkeypatch.setenv(pts.REFINE_VERT_ENV, "auto")
    assert pts.refine_vert() is None
    monkeypatch.setenv(pts.REFINE_VERT_ENV, "-3")
    with pytest.raises(pts.PtScotchError, match=pts.REFINE_VERT_ENV):
        pts.refine_vert()


@pytest.mark.parametrize("procs,refine", [(1, 20000), (4, 20000), (64, 0)])
def test_fast_strategy_parses(procs, refine):
    try:
        lib = ctypes.CDLL(pts._find_library())
    except (pts.PtScotchError, OSError) as exc:
        pytest.skip(f"PT-Scotch not loadable here: {exc}")
    strat = (ctypes.c_double * 32)()
    lib.SCOTCH_stratInit(strat)
    try:
        assert lib.SCOTCH_stratDgraphMap(
            strat, ctypes.c_char_p(pts.fast_strategy(procs, 0.03, refine).encode())) == 0
    finally:
        lib.SCOTCH_stratExit(strat)
