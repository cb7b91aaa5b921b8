"""R ranks over a K-part shard set (R divides K): rank r merges K/R consecutive parts.

The oracle is the 1-part shard set of the same graph, written by ``preprocess`` (no merge
involved): the merged parts must hold exactly its nodes, features, labels, masks, edges and
degrees, and their halo plans must satisfy the exchange's invariant (checked here, in the
test, from the arrays). Training an 8-part set on 1, 2 and 4 ranks gives the 1-part set's
per-epoch losses.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import check_ok, read_metrics, run_mpi, train_here
from hpcgnn.data.shard import ShardFormatError
from hpcgnn.train.inputs import load_part

TRAIN_WORKER = str(Path(__file__).with_name("test_train.py"))


def _edges(shard) -> set[tuple[int, int]]:
    """(destination, source) global-id pairs of a shard's CSR."""
    gid = np.concatenate([shard.global_id, shard.halo_global_id])
    rows = np.repeat(shard.global_id, np.diff(shard.indptr))
    return set(zip(rows.tolist(), gid[shard.indices].tolist()))


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_merged_parts_hold_the_whole_graph(shards, ranks):
    _, whole = load_part(shards("cora", 1), 0, 1)
    merged = [load_part(shards("cora", 8, "metis"), r, ranks)[1] for r in range(ranks)]
    gid = np.concatenate([m.global_id for m in merged])
    assert np.array_equal(np.sort(gid), whole.global_id)       # every node owned once
    for m in merged:
        assert m.num_parts == ranks and np.all(np.diff(m.global_id) > 0)
        at = np.searchsorted(whole.global_id, m.global_id)
        for name in ("features", "label", "train_mask", "val_mask", "test_mask", "degree"):
            assert np.array_equal(getattr(m, name), getattr(whole, name)[at]), name
        hat = np.searchsorted(whole.global_id, m.halo_global_id)
        assert np.array_equal(m.halo_degree, whole.degree[hat])
        assert not np.isin(m.halo_global_id, m.global_id).any()   # a halo row is never owned
        assert m.recv_counts[m.part_id] == 0 and m.send_counts[m.part_id] == 0
    got = set().union(*(_edges(m) for m in merged))
    assert got == _edges(whole) and sum(m.num_edges for m in merged) == whole.num_edges


@pytest.mark.parametrize("ranks", [2, 4])
def test_merged_plans_satisfy_the_exchange_invariant(shards, ranks):
    """Rank q's send block for p, in global ids, is rank p's halo block from q, in order;
    and every halo row comes from the rank that owns it."""
    merged = [load_part(shards("cora", 8, "metis"), r, ranks)[1] for r in range(ranks)]
    owner = {int(g): m.part_id for m in merged for g in m.global_id}
    for p in merged:
        halo_blocks = np.split(p.halo_global_id, np.cumsum(p.recv_counts)[:-1])
        for q in merged:
            send = np.split(q.send_index, np.cumsum(q.send_counts)[:-1])[p.part_id]
            assert np.array_equal(q.global_id[send], halo_blocks[q.part_id]), (q.part_id, p.part_id)
            assert all(owner[int(g)] == q.part_id for g in halo_blocks[q.part_id])


def test_rank_count_must_divide_parts(shards):
    with pytest.raises(ShardFormatError, match=r"has 8 parts but the job has 3 ranks.*1, 2, 4, 8"):
        load_part(shards("cora", 8, "metis"), 0, 3)


@pytest.fixture(scope="module")
def whole_losses(shards, tmp_path_factory):
    """1-part set, 1 rank, in this process: the oracle's losses per variant."""
    sets = {"gcn": ("model.arch=gcn",), "sage": ("model.arch=sage",)}
    return {v: train_here(shards("cora", 1), tmp_path_factory.mktemp(v), "train.epochs=6", *s)
            for v, s in sets.items()}


def _assert_same(got: list[dict], want: list[dict]) -> None:
    assert [r["epoch"] for r in got] == list(range(6))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), g["epoch"]
        assert g["val_acc"] == pytest.approx(w["val_acc"], abs=2e-3), g["epoch"]


def test_eight_parts_on_one_rank_equals_the_whole_graph(shards, whole_losses, tmp_path):
    got = train_here(shards("cora", 8, "metis"), tmp_path, "train.epochs=6", "model.arch=gcn")
    _assert_same(got, whole_losses["gcn"])
    assert all(r["bytes_sent"] == 0 for r in got)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_eight_parts_on_fewer_ranks_give_the_single_rank_losses(shards, whole_losses, ranks,
                                                                tmp_path):
    """One launch trains GCN and SAGE (the worker of tests/test_train.py)."""
    proc = run_mpi(ranks, [TRAIN_WORKER, str(shards("cora", 8, "metis")), str(tmp_path),
                           "cora", "gcn", "sage"], timeout=180)
    check_ok(proc)
    for variant in ("gcn", "sage"):
        got = read_metrics(tmp_path / variant)
        _assert_same(got, whole_losses[variant])
        assert all(r["bytes_sent"] == r["bytes_full"] > 0 for r in got)
