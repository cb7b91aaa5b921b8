"""CAGNET's 1.5D algorithm on real ranks: the per-epoch losses of 1 rank at P = 4 (c = 1, 2)
and P = 8 (c = 2), GCN and SAGE; bytes equal the cost formula written here; at P = 9 (c = 3) on
a directed graph in uneven parts, the words per rank of the paper's grid; bad grids fail."""
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


DIRECTED = "rmat:scale=9,edge_factor=6,features=24,classes=4,symmetric=false,seed=5"


@pytest.mark.mpi
def test_15d_words_per_rank_follow_the_papers_grid_at_c3(shards, tmp_path):
    """P = 9 ranks, c = 3, on a directed graph in uneven METIS parts: the words each rank moves
    per epoch on average are what the paper's P/c x c grid moves, counted here from its
    definition, and the losses are 1 rank's. Per SpMM of width f: each of the c column groups
    (P/c ranks) broadcasts its P/c^2 blocks of H to the other P/c - 1 ranks of the group, so
    every row of H reaches P/c - 1 ranks once; each of the P/c row groups all-reduces a block of
    the partial product over c ranks, 2 (c - 1) copies of the block (a ring). Both hold for
    blocks of any size, so uneven parts change nothing."""
    from hpcgnn.data.datasets import load_dataset
    from hpcgnn.data.shard import read_meta
    p, c = 9, 3
    d = shards(DIRECTED, p // c, "metis")
    assert len({part["num_owned"] for part in read_meta(d)["parts"]}) > 1     # uneven parts
    n = load_dataset(DIRECTED).num_nodes
    per_spmm = lambda f: n * f * ((p // c - 1) + 2 * (c - 1)) / p        # noqa: E731  words a rank
    # layer 0 aggregates its grad-free 24 features (no backward SpMM); layer 1 transforms first
    # (4 channels) and multiplies forward and backward
    want = per_spmm(F_IN) + 2 * per_spmm(CLASSES)
    proc = train(p, d, tmp_path / "run", "train.epochs=3", "parallel.algorithm=1.5d",
                 f"parallel.replication={c}", timeout=300)
    check_ok(proc)
    got = read_metrics(tmp_path / "run")
    assert [r["bytes_sent"] / 4 / p for r in got] == pytest.approx([want] * 3, rel=0, abs=1e-9)
    ref = train_here(shards(DIRECTED, 1), tmp_path / "ref", "train.epochs=3", config=None)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
