"""The oracle: uncompressed training on 2, 3, 4 ranks gives the per-epoch losses of the 1-rank
run (dropout on, METIS and random parts and very uneven ones with an empty part and a part
without training nodes, GCN and SAGE, overlap on and off), and Cora on 4 ranks reaches Kipf &
Welling's accuracy.

One mpiexec launch trains several models (this file is also the MPI worker: see ``__main__``),
because starting ranks (importing torch) dominates a small run's time.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from _graphs import metis_examples
from conftest import CSBM, check_ok, read_metrics, run_mpi, train, train_here

EPOCHS = 6
CORA_CFG = "configs/cora.toml"

# one launch per (dataset, partitioner, ranks); each trains these variants (--set lists)
VARIANTS = {
    "gcn": ("model.arch=gcn",),
    "gcn-overlap": ("model.arch=gcn", "train.overlap=true"),
    "sage": ("model.arch=sage",),
    "sage-overlap": ("model.arch=sage", "train.overlap=true"),
    "sage-3layer": ("model.arch=sage", "model.layers=3", "model.hidden=20"),
}
LAUNCHES = [
    ("cora", "metis", 2, ("gcn", "sage-overlap")),
    ("cora", "random", 3, ("gcn-overlap", "sage")),
    (CSBM, "random", 4, ("gcn-overlap", "sage-3layer")),
    # METIS and random parts differ in size by a few %: here 2127, 40, 0 and 541 nodes, the
    # 40 with no training node, the third rank with nothing at all (``uneven_cora``)
    ("cora", "uneven", 4, ("gcn", "sage-overlap")),
]
# METIS's 4elt mesh (Debian's libmetis-doc) in METIS parts rides in the launch of each rank
# count (LAUNCHES row), where it is found: no launch of its own
MESH_RIDES = {2: 0, 3: 1, 4: 2}
MESH_VARIANTS = ("gcn", "sage-overlap")


def mesh_spec(folder: Path) -> str:
    return f"metis-graph:{folder / '4elt.graph'},features=16,classes=4,seed=1"


def _sets(variant: str, dataset: str = "cora") -> list[str]:
    """The variant's --set list; the cSBM's features are signed, so no row normalisation."""
    plain = [] if dataset == "cora" else ["data.normalize_features=false"]
    return [f"train.epochs={EPOCHS}", *VARIANTS[variant], *plain]


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """1-rank losses (trained in this process) per (dataset, variant)."""
    cache: dict = {}

    def get(dataset: str, variant: str) -> list[dict]:
        model = tuple(s for s in VARIANTS[variant] if s.startswith("model."))
        if (dataset, model) not in cache:
            out = tmp_path_factory.mktemp("ref")
            cache[(dataset, model)] = train_here(shards(dataset, 1), out, *_sets(variant, dataset))
        return cache[(dataset, model)]

    return get


@pytest.fixture(scope="module")
def uneven_cora(tmp_path_factory):
    """Cora in 4 very uneven parts (written by the real ``write_shards``): part 0 about 4/5 of
    the nodes, part 1 40 nodes none of which is a training node, part 2 empty, part 3 the rest."""
    import numpy as np

    from hpcgnn.data.datasets import load_dataset
    from preprocess import write_shards
    g = load_dataset("cora")
    rng = np.random.default_rng(0)
    parts = np.zeros(g.num_nodes, dtype=np.int64)
    small = rng.choice(np.setdiff1d(np.arange(g.num_nodes), g.train_idx), 40, replace=False)
    parts[rng.choice(np.setdiff1d(np.arange(g.num_nodes), small), g.num_nodes // 5,
                     replace=False)] = 3
    parts[small] = 1
    out = tmp_path_factory.mktemp("uneven") / "set"
    write_shards(g, parts, out, partitioner="custom", seed=0, force=False, num_parts=4)
    assert np.bincount(parts, minlength=4).tolist() == [2127, 40, 0, 541]
    assert np.bincount(parts[g.train_idx], minlength=4)[1:3].tolist() == [0, 0]
    return out


@pytest.fixture(scope="module")
def launched(shards, request, tmp_path_factory):
    """``launched(row) -> (CompletedProcess, work dir)``: LAUNCHES[row]'s job, run once; the
    4elt mesh rides in the job that MESH_RIDES names, where METIS's example graphs are found."""
    done: dict = {}

    def get(row: int):
        if row not in done:
            dataset, partitioner, ranks, variants = LAUNCHES[row]
            work = tmp_path_factory.mktemp(f"launch-{row}")
            shard_dir = (request.getfixturevalue("uneven_cora") if partitioner == "uneven"
                         else shards(dataset, ranks, partitioner))
            runs = [[str(shard_dir), str(work / v), dataset, v] for v in variants]
            folder, _ = metis_examples()
            if folder is not None and MESH_RIDES.get(ranks) == row:
                spec = mesh_spec(folder)
                runs += [[str(shards(spec, ranks, "metis")), str(work / f"mesh-{v}"), spec, v]
                         for v in MESH_VARIANTS]
            (work / "runs.json").write_text(json.dumps(runs))
            done[row] = (run_mpi(ranks, [__file__, str(work / "runs.json")], timeout=180), work)
        return done[row]

    return get


def _check_equal(run_dir: Path, want: list[dict], variant: str) -> None:
    """The per-epoch losses of ``run_dir`` (several ranks) are the 1-rank run's ``want``."""
    got = read_metrics(run_dir)
    assert [r["epoch"] for r in got] == [r["epoch"] for r in want] == list(range(EPOCHS))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), (variant, g["epoch"])
        assert g["val_acc"] == pytest.approx(w["val_acc"], abs=2e-3), (variant, g["epoch"])
        assert g["val_loss"] == pytest.approx(w["val_loss"], rel=1e-5), (variant, g["epoch"])
    # the halo rows cross in both directions; the 1-rank run sends nothing
    assert all(r["bytes_sent"] == r["bytes_full"] > 0 for r in got)
    assert want[0]["bytes_sent"] == 0
    assert got[0]["loss"] > got[-1]["loss"]


@pytest.mark.mpi
@pytest.mark.parametrize("row", range(len(LAUNCHES)),
                         ids=[f"{d.split(':')[0]}-{p}-{r}" for d, p, r, _ in LAUNCHES])
def test_losses_equal_single_rank(row, launched, reference):
    dataset, _, _, variants = LAUNCHES[row]
    proc, work = launched(row)
    check_ok(proc)
    for variant in variants:
        _check_equal(work / variant, reference(dataset, variant), variant)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", sorted(MESH_RIDES))
def test_metis_4elt_mesh_losses_equal_single_rank(ranks, metis_graphs, launched, reference):
    """A real mesh (METIS's 4elt, 7,434 vertices, read from its .graph file) in METIS parts."""
    proc, work = launched(MESH_RIDES[ranks])
    check_ok(proc)
    for variant in MESH_VARIANTS:
        _check_equal(work / f"mesh-{variant}", reference(mesh_spec(metis_graphs), variant),
                     variant)


@pytest.mark.mpi
def test_cora_4_ranks_reaches_published_accuracy(shards, tmp_path):
    """Kipf & Welling: 2-layer GCN, 16 hidden, 200 epochs -> ~81.5 % test accuracy."""
    check_ok(train(4, shards("cora", 4, "metis"), tmp_path, config=CORA_CFG, timeout=240))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ranks"] == 4 and summary["epochs"] == 200
    assert summary["test_acc"] >= 0.79, summary
    assert summary["bytes_sent"] == summary["bytes_full"] > 0
    assert len(read_metrics(tmp_path)) == 200
    # bytes, not ru_maxrss's KiB: a rank holds torch (> 100 MiB) and Cora (a few MiB)
    assert 100 * 2**20 < summary["peak_rss_bytes"] < 4 * 2**30, summary
    assert summary["malloc"] in ("tuned", "not glibc") and "peak_device_bytes" not in summary
    assert summary["thp"] is True               # set before torch was imported


def test_an_epochs_time_counts_the_ranks_agreement_at_its_end(shards, tmp_path, monkeypatch):
    """``epoch_s`` runs until the ranks have agreed on the step (the epoch-end ``Allreduce``
    that a stale run's halo gradients, posted just before it, can hold back on an in-order
    link), and ``wall_s`` is that plus the evaluation: here that reduction is made to take
    40 ms (1 rank, 4 epochs, evaluation at the last only)."""
    import time

    from hpcgnn.train import trainer as trainer_module
    agree = trainer_module.sum_float64

    def slow(ctx, values):
        time.sleep(0.04)
        return agree(ctx, values)

    monkeypatch.setattr(trainer_module, "sum_float64", slow)
    rows = train_here(shards("cora", 1), tmp_path / "run", "train.epochs=4", "train.eval_every=100")
    assert len(rows) == 4
    for r in rows:
        assert r["epoch_s"] >= 0.04, r
        assert r["wall_s"] == r["epoch_s"] + r["eval_s"]
    assert rows[-1]["eval_s"] >= 0.04 > max(r["eval_s"] for r in rows[:-1])   # its own reduction
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["train_time_s"] == pytest.approx(sum(r["epoch_s"] for r in rows))


def _worker(runs: list[list[str]]) -> None:
    """Run on every rank: train each ``[shard_dir, out, dataset, variant]`` in turn."""
    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.log import setup_logging
    from hpcgnn.train.build import prepare_trainer
    ctx = CommContext.from_world("cpu")
    setup_logging(ctx.rank, ctx.size)
    for shard_dir, out, dataset, variant in runs:
        cfg = load_config(CORA_CFG, _sets(variant, dataset))
        trainer = prepare_trainer(ctx, cfg, shard_dir, Path(out))
        trainer.start()
        trainer.run()


if __name__ == "__main__":
    # RUNS.json, or SHARD_DIR OUT DATASET VARIANT... (tests/test_rank_merge.py): into OUT/VARIANT
    _worker(json.loads(Path(sys.argv[1]).read_text()) if len(sys.argv) == 2 else
            [[sys.argv[1], str(Path(sys.argv[2]) / v), sys.argv[3], v] for v in sys.argv[4:]])
