"""CAGNET's 1.5D algorithm on real ranks: the per-epoch losses of 1 rank at P = 4 (c = 1, 2)
and P = 8 (c = 2), GCN and SAGE; bytes equal the cost formula written here; bad grids fail."""
from __future__ import annotations

import pytest

from conftest import CSBM, check_ok, read_metrics, together, train, train_here

EPOCHS = 5
N, F_IN, HIDDEN, CLASSES = 3000, 24, 16, 4


def spmm_bytes(k: int, c: int, width: int) -> int:
    """One SpMM over all ranks: K - 1 copies of every block row (Bcast), 2 (c - 1) for the
    row-group Allreduce, 4 bytes a value."""
    return 4 * N * width * ((k - 1) + 2 * (c - 1))


def epoch_bytes(k: int, c: int, arch: str) -> int:
    # layer 0 aggregates its grad-free input first (width 24, GCN) or SAGE's (24 < 2 x 16 x 2);
    # layer 1 transforms first (width 4) and needs the backward SpMM too
    return spmm_bytes(k, c, F_IN) + 2 * spmm_bytes(k, c, CLASSES)


@pytest.fixture(scope="module")
def one_rank(shards, tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = train_here(shards(CSBM, 1), tmp_path_factory.mktemp("ref"),
                                     f"model.arch={arch}", f"train.epochs={EPOCHS}", config=None)
        return cache[arch]
    return get


CASES = [(4, 1, "gcn"), (4, 2, "gcn"), (8, 2, "gcn"), (4, 2, "sage")]     # (ranks, c, arch)


@pytest.fixture(scope="module")
def case_runs(shards, tmp_path_factory):
    """The runs of CASES, those of one rank count in one job (``conftest.together``)."""
    return together(tmp_path_factory, {
        (ranks, c, arch): (ranks, shards(CSBM, ranks // c, "random"),
                           (f"model.arch={arch}", f"train.epochs={EPOCHS}",
                            "parallel.algorithm=1.5d", f"parallel.replication={c}"), {})
        for ranks, c, arch in CASES})


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,c,arch", CASES)
def test_15d_equals_one_rank_and_the_byte_formula(ranks, c, arch, one_rank, case_runs):
    k = ranks // c
    proc, run = case_runs((ranks, c, arch))
    check_ok(proc)
    got = read_metrics(run)
    want = one_rank(arch)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    assert [r["test_acc"] for r in got] == [r["test_acc"] for r in want]
    assert all(r["bytes_sent"] == epoch_bytes(k, c, arch) for r in got)


@pytest.mark.mpi
def test_15d_rank_count_and_replication_errors(shards, tmp_path):
    d = shards(CSBM, 2, "random")
    proc = train(3, d, tmp_path / "a", "parallel.algorithm=1.5d", "parallel.replication=2", timeout=120)
    assert proc.returncode != 0 and "needs 4 ranks, the job has 3" in proc.stderr
    proc = train(2, shards(CSBM, 1), tmp_path / "b", "parallel.algorithm=1.5d",
                 "parallel.replication=2", timeout=120)
    assert proc.returncode != 0 and "divisible by c^2 = 4" in proc.stderr
    proc = train(2, d, tmp_path / "c", "parallel.replication=2", timeout=120)
    assert proc.returncode != 0 and "parallel.replication" in proc.stderr
