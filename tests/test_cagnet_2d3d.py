"""CAGNET's 2D (SUMMA, P = q^2) and 3D (split-3D, P = q^3) algorithms on real ranks:

- per-epoch losses and accuracies equal 1 rank, GCN and SAGE, at P = 4 and 9 (2D) and 8 (3D),
  on METIS parts of unequal sizes, on random parts and on a directed graph;
- bytes per epoch equal the closed forms written here;
- the same losses and bytes with every collective split into rounds (a lowered
  ``HPCGNN_MAX_MESSAGE``), for 1.5D, 2D and 3D (2D and 3D in the cases above);
- a run stopped and resumed gives the same losses, and predict reads its checkpoint;
- a wrong rank count is refused on every rank with the valid counts; a corrupt shard on one
  rank ends the job cleanly (the grid's communicators are made after the start-up agreement).
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import scipy.sparse as sp

from conftest import (CSBM, check_ok, read_metrics, run_together, together, train, train_here,
                      train_together)

pytestmark = pytest.mark.mpi

EPOCHS = 3
F_IN, CLASSES = 24, 4
DIRECTED = "rmat:scale=9,edge_factor=6,features=24,classes=4,symmetric=false,seed=5"


# -- the closed forms (bytes over all ranks; 4-byte indices and values) -------------------------
def graph_size(spec: str, arch: str) -> tuple[int, int]:
    """(n, nnz of A): in-edges without self-loops or duplicates, GCN's n self-loops added."""
    from hpcgnn.data.datasets import load_dataset
    g = load_dataset(spec)
    n = g.num_nodes
    a = sp.csr_matrix((np.ones(len(g.indices)), g.indices, g.indptr), shape=(n, n))
    a.sum_duplicates()
    nnz = a.nnz - int((a.diagonal() != 0).sum())
    return n, nnz + (n if arch == "gcn" else 0)


def spmm_bytes(alg: str, q: int, n: int, nnz: int, f: int, backward: bool) -> int:
    """One SpMM. A block travels as CSR: 4 (rows + 1) + 8 nnz bytes, Bcast to q - 1 ranks;
    dense slices 4 bytes a value. 2D: the A blocks, the H slices, the Allgatherv along the row
    (backward: A^T blocks, Reduce_scatter along the row, Reduce down the columns). 3D: the same
    in each of the q layers, A split q^2 ways by columns, plus the sum across the layers
    (Reduce_scatter; backward: Allgatherv)."""
    if alg == "2d":
        return (q - 1) * (4 * q * (n + q) + 8 * nnz + 8 * n * f)
    rows = 4 * q * (n + q * q) if backward else 4 * q * q * (n + q)
    return (q - 1) * (rows + 8 * nnz + 12 * n * f)


def epoch_bytes(alg: str, q: int, spec: str, arch: str) -> int:
    """Layer 0 aggregates its grad-free input (width 24, no backward SpMM); layer 1 transforms
    first (width 4) and needs the backward SpMM (``hpcgnn.nn.layers.choose_order``)."""
    n, nnz = graph_size(spec, arch)
    return (spmm_bytes(alg, q, n, nnz, F_IN, False) + spmm_bytes(alg, q, n, nnz, CLASSES, False)
            + spmm_bytes(alg, q, n, nnz, CLASSES, True))


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank(shards, tmp_path_factory):
    cache = {}

    def get(spec, arch, epochs=EPOCHS):
        key = (spec, arch, epochs)
        if key not in cache:
            cache[key] = train_here(shards(spec, 1), tmp_path_factory.mktemp("ref"),
                                    f"model.arch={arch}", f"train.epochs={epochs}", config=None)
        return cache[key]
    return get


def same_run(got: list[dict], want: list[dict]) -> None:
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    assert [r["test_acc"] for r in got] == pytest.approx([r["test_acc"] for r in want], abs=1e-9)


def uneven(shard_dir) -> bool:
    from hpcgnn.data.shard import read_meta
    return len({p["num_owned"] for p in read_meta(shard_dir)["parts"]}) > 1


# -- exactness and bytes ------------------------------------------------------------------------
ROUNDS = {"HPCGNN_MAX_MESSAGE": "900"}
"""900 bytes a call: the H slices (~3000 x 12 x 4 bytes) and A blocks go in ~100 rounds."""
CASES = [  # (algorithm, ranks, q, graph, partitioner, parts, arch, environment)
    ("2d", 4, 2, CSBM, "metis", 4, "gcn", ROUNDS),
    ("2d", 4, 2, DIRECTED, "random", 2, "sage", {}),
    ("2d", 9, 3, CSBM, "metis", 3, "sage", {}),
    ("2d", 9, 3, DIRECTED, "random", 6, "gcn", {}),
    ("3d", 8, 2, CSBM, "metis", 4, "gcn", ROUNDS),
    ("3d", 8, 2, DIRECTED, "random", 8, "sage", {}),
]


@pytest.fixture(scope="module")
def case_runs(shards, tmp_path_factory):
    """The runs of CASES and the 1.5D run in rounds, those of one rank count in one job
    (``conftest.together``)."""
    plan = {i: (c[1], shards(c[3], c[5], c[4]),
                (f"model.arch={c[6]}", f"train.epochs={EPOCHS}", f"parallel.algorithm={c[0]}"), c[7])
            for i, c in enumerate(CASES)}
    plan["1.5d-rounds"] = (4, shards(CSBM, 2, "metis"), (f"train.epochs={EPOCHS}",
                           "parallel.algorithm=1.5d", "parallel.replication=2"), ROUNDS)
    return together(tmp_path_factory, plan)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-P{c[1]}-{c[3][:4]}-{c[4]}-K{c[5]}-{c[6]}"
                                             + ("-rounds" if c[7] else "") for c in CASES])
def test_equals_one_rank_and_the_closed_form(case, shards, one_rank, case_runs):
    alg, ranks, q, spec, partitioner, parts, arch, env = case
    d = shards(spec, parts, partitioner)
    assert uneven(d) or partitioner == "random"           # METIS parts of unequal sizes
    proc, run = case_runs(CASES.index(case))
    check_ok(proc)
    got = read_metrics(run)
    same_run(got, one_rank(spec, arch))
    want = epoch_bytes(alg, q, spec, arch)
    assert [r["bytes_sent"] for r in got] == [want] * EPOCHS
    assert all(r["bytes_full"] == r["bytes_sent"] for r in got)
    assert f"; {training_nodes(spec)} training nodes in all" in proc.stderr   # once each, not per copy


def training_nodes(spec) -> int:
    from hpcgnn.data.datasets import load_dataset
    return len(load_dataset(spec).train_idx)


def test_rounds_past_a_lowered_limit_give_the_same_losses(one_rank, case_runs):
    """1.5D on 4 ranks (c = 2) in rounds of 900 bytes (2D and 3D: ``CASES``)."""
    proc, run = case_runs("1.5d-rounds")
    check_ok(proc)
    assert f"; {training_nodes(CSBM)} training nodes in all" in proc.stderr
    same_run(read_metrics(run), one_rank(CSBM, "gcn"))


def test_resume_and_predict(shards, one_rank, tmp_path):
    """2D on 4 ranks: stopped after 2 epochs and resumed to 4 equals 1 rank's 4 epochs; predict
    (on the halo algorithm, 1 rank) reads the checkpoint and equals 1 rank's predict."""
    from hpcgnn.predict import read_predictions
    d, run = shards(CSBM, 4, "metis"), tmp_path / "run"
    base = ("train.epochs=4", "parallel.algorithm=2d")
    stop, resume = train_together(4, [(d, run, base, {}, ("--stop-after", "2")),
                                      (d, run, base, {}, ("--resume",))], tmp_path)
    check_ok(stop)
    check_ok(resume)
    assert "stopped after 2 epochs" in stop.stderr and "after epoch 1" in resume.stderr
    same_run(read_metrics(run), one_rank(CSBM, "gcn", 4))
    ref = tmp_path / "ref"
    train_here(shards(CSBM, 1), ref, "train.epochs=4", config=None)
    for proc in run_together(1, [(["predict", "--run", r, "--shards", d, "--out", tmp_path / out], {})
                                 for r, out in ((run, "p2d"), (ref, "p1"))], tmp_path / "predict"):
        check_ok(proc)
    two, one = read_predictions(tmp_path / "p2d"), read_predictions(tmp_path / "p1")
    assert np.array_equal(two["pred"], one["pred"])
    np.testing.assert_allclose(two["logits"], one["logits"], rtol=1e-4, atol=1e-5)


# -- refusals and failures ----------------------------------------------------------------------
@pytest.mark.parametrize("alg,ranks,parts,valid", [
    ("2d", 2, 4, "P in 1, 4, 16 for this 4-part set"), ("2d", 4, 3, "P in 1, 9 for this 3-part set"),
    ("3d", 4, 4, "P in 1, 8 for this 4-part set")])
def test_wrong_rank_count_is_refused_on_every_rank(alg, ranks, parts, valid, shards, tmp_path):
    proc = train(ranks, shards(CSBM, parts, "metis"), tmp_path / "run",
                 f"parallel.algorithm={alg}", timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # every rank refused it: rank 0 says so once, naming them all
    assert f"[rank 0/{ranks}] ERROR ranks 0-{ranks - 1}: " in proc.stderr
    assert proc.stderr.count(valid) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("alg,ranks,parts,sets", [
    ("1.5d", 4, 2, ("parallel.replication=2",)), ("2d", 4, 4, ()), ("3d", 8, 4, ())])
def test_a_corrupt_shard_ends_the_job_cleanly(alg, ranks, parts, sets, shards, tmp_path):
    bad = tmp_path / "shards"
    shutil.copytree(shards(CSBM, parts, "metis"), bad)
    part = bad / f"part-{parts - 1:05d}.h5"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    proc = train(ranks, bad, tmp_path / "run", f"parallel.algorithm={alg}", *sets, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert part.name in proc.stderr and "preprocess" in proc.stderr
    # the ranks that read the broken part say so; the others stop because of them
    assert f"[rank 0/{ranks}] ERROR " in proc.stderr
    assert "no error; stopping with the others" in proc.stderr
    assert "Traceback" not in proc.stderr
