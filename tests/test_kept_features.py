"""The features' halo rows kept on the rank: ``train.keep_features`` (a synchronous run's first
layer computes its halo terms itself and never exchanges) and ``train.eval_features``
(evaluation's first layer on the kept rows).

On real ranks: training with kept features equals an independent whole-graph computation of
the same model (``tests/_pipegcn.py`` with staleness 0: dropout 0.5 keyed by global id, Adam)
for GCN with 3 layers on Cora's sparse features and uneven METIS parts, SAGE on random parts,
GAT with attention dropout, and a directed graph, on 2-4 ranks, and its first layer sends
nothing after the one fetch; evaluation through kept rows gives the whole graph's logits (a
dense GCN written in the test, with the checkpoint's weights), in a synchronous run (``kept``)
and in a stale one (``auto``), on an undirected graph and on a directed one, and leaves training alone (the same losses bit for bit as with
``exchange``); ``hpcgnn predict`` of such a run gives the trainer's accuracy; and the
combinations they cannot serve are refused with the key and the fix. summary.json's ``test_acc`` is
the one at the first best validation epoch (these runs tie at their best)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from _graphs import dense_gcn, partly_labelled_npz
from conftest import CSBM, check_ok, initial_params, read_metrics, run_together, together, train_together
from test_directed import lattice_arrays
from test_methods_exact import EPOCHS, GAT_GRAPH, _parts, reference_model

RUNS = {"sync-exchange": ("train.eval_features=exchange",),
        "sync-kept": ("train.eval_features=kept",),
        "stale-exchange": ("train.staleness=1", "train.eval_features=exchange"),
        "stale-auto": ("train.staleness=1",),
        "sync-keep": ("train.keep_features=true",)}


@pytest.fixture(scope="module", params=["undirected", "directed"])
def runs(request, tmp_path_factory):
    """The runs of ``RUNS`` on 3 ranks: a 3-layer GCN, 3 random parts, evaluation every epoch,
    on an undirected random graph with partly labelled val/test splits, and on the one-way
    lattice of ``test_directed`` (the halo rows of a part come from its predecessors only)."""
    from preprocess import partition_graph, write_shards
    from hpcgnn.data.datasets import load_dataset
    work = tmp_path_factory.mktemp(f"eval-features-{request.param}")
    if request.param == "directed":
        arrays = lattice_arrays()
        np.savez(work / "g.npz", **arrays)
    else:
        arrays = partly_labelled_npz(work / "g.npz")
    graph = load_dataset(f"npz:{work / 'g.npz'}")
    write_shards(graph, partition_graph(graph, 3, "random", seed=0), work / "shards",
                 partitioner="random", seed=0, force=False, num_parts=3)
    common = ("train.epochs=6", "model.layers=3", "model.hidden=6", "model.dropout=0.5")
    runs = [(work / "shards", work / name, (*common, *sets), {}) for name, sets in RUNS.items()]
    for proc in train_together(3, runs, work / "jobs"):
        check_ok(proc)
    return arrays, {**{name: work / name for name in RUNS}, "shards": work / "shards"}


def _whole_graph_figures(arrays: dict, run_dir) -> dict:
    """val/test accuracy and val loss of the dense whole-graph GCN with the run's final weights."""
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    logits = dense_gcn(arrays, state)[1]
    labels, out = arrays["labels"], {}
    for name in ("val", "test"):
        idx = arrays[f"{name}_idx"]
        idx = idx[labels[idx] >= 0]
        out[f"{name}_acc"] = float((logits[idx].argmax(axis=1) == labels[idx]).mean())
        if name == "val":
            z = logits[idx] - logits[idx].max(axis=1, keepdims=True)
            out["val_loss"] = float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(idx)), labels[idx]]))
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["sync-kept", "stale-auto", "sync-keep"])
def test_evaluation_on_kept_rows_equals_the_whole_graph(runs, name):
    arrays, dirs = runs
    last = read_metrics(dirs[name])[-1]
    want = _whole_graph_figures(arrays, dirs[name])
    assert last["val_acc"] == want["val_acc"] and last["test_acc"] == want["test_acc"]
    assert last["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_kept_rows_leave_training_alone_and_the_first_layer_silent(runs, mode):
    _, dirs = runs
    kept = read_metrics(dirs[f"{mode}-{'kept' if mode == 'sync' else 'auto'}"])
    exch = read_metrics(dirs[f"{mode}-exchange"])
    assert [r["loss"] for r in kept] == [r["loss"] for r in exch]          # training untouched
    for a, b in zip(kept, exch):
        assert a["val_acc"] == b["val_acc"] and a["test_acc"] == b["test_acc"]
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5, abs=1e-7)
    # after the first evaluation (which fetches the rows in a synchronous run) the first layer
    # exchanges nothing: what evaluation sends is the exchange run's less layer 0's share
    later = {r["eval_bytes"] for r in kept[1:]}
    assert len(later) == 1 and 0 < later.pop() < exch[1]["eval_bytes"]
    if mode == "stale":                       # the rows were kept by training: nothing fetched
        assert kept[0]["eval_bytes"] == kept[1]["eval_bytes"]


@pytest.mark.mpi
def test_summary_reports_the_first_best_validation_epoch(runs):
    """docs/formats.md: ``test_acc`` is the test accuracy at the best validation accuracy, the
    FIRST such epoch on ties, ``final_test_acc`` the last evaluation's; recomputed from each
    run's metrics lines (every epoch evaluated). The undirected graph's 16 labelled validation
    nodes give ties at the best, so the rule is tested, not only the maximum."""
    arrays, dirs = runs
    tied = False
    for name in RUNS:
        records = read_metrics(dirs[name])
        summary = json.loads((dirs[name] / "summary.json").read_text())
        vals = [r["val_acc"] for r in records]
        best = vals.index(max(vals))
        tied |= vals.count(max(vals)) > 1
        assert (summary["best_epoch"], summary["best_val_acc"]) == (best, vals[best]), (name, vals)
        assert summary["test_acc"] == records[best]["test_acc"], (name, summary)
        assert summary["final_test_acc"] == records[-1]["test_acc"], (name, summary)
    if len(arrays["labels"]) == 80:                     # partly_labelled_npz: ties at the best
        assert tied


def test_what_kept_rows_cannot_serve_is_refused(tmp_path):
    from hpcgnn.combinations import check_combination
    from hpcgnn.config import ConfigError, load_config
    cases = [(["train.eval_features=kept", "parallel.algorithm=1.5d"], r"no halo rows to keep"),
             (["train.keep_features=true", "parallel.algorithm=1.5d"], r"keep_features.*no halo rows"),
             (["train.keep_features=true", "train.method=retexo", "train.epochs=400"],
              r"keep_features.*exchanges each layer's rows once"),
             (["train.eval_features=kept", "train.method=retexo", "train.epochs=400"],
              r"train.method = 'retexo' evaluates its own way"),
             (["train.eval_features=kept", "train.eval_codec=train"],
              r"train.eval_codec = 'train'.*'exchange'"),
             (["train.eval_features=all"], r"use 'auto', 'exchange' or 'kept'")]
    for sets, match in cases:
        with pytest.raises(ConfigError, match=match):
            check_combination(load_config(None, sets))
    from hpcgnn.schedule import load_schedule
    learned = tmp_path / "learned.toml"
    learned.write_text('codec = "learned"\nkind = "constant"\nratio = 4\n')
    with pytest.raises(ConfigError, match=r"keep_features = true does not combine with the 'learned'"):
        check_combination(load_config(None, ["train.keep_features=true"]), load_schedule(learned))
    # a stale run's first layer trains on exact kept rows, so 'train' evaluation agrees with them
    check_combination(load_config(None, ["train.eval_features=kept", "train.eval_codec=train",
                                         "train.staleness=1"]))
    assert load_config(None, []).train.eval_features == "auto"


@pytest.mark.mpi
def test_kept_features_leave_the_first_layer_no_exchange(runs):
    """Layer 0 (3 or 6 features -> 6, aggregating first) exchanges the features, forward only:
    with kept features training sends exactly that much less per step, after the one fetch at
    epoch 0."""
    from hpcgnn.data.shard import read_shard
    arrays, dirs = runs
    keep, exch = read_metrics(dirs["sync-keep"]), read_metrics(dirs["sync-exchange"])
    halo_rows = sum(read_shard(dirs["shards"] / f"part-{r:05d}.h5").n_halo for r in range(3))
    layer0 = halo_rows * arrays["features"].shape[1] * 4      # fp32 feature rows, every halo row
    assert [r["loss"] for r in keep] == pytest.approx([r["loss"] for r in exch], rel=1e-5)
    assert keep[0]["bytes_sent"] == exch[0]["bytes_sent"]       # fetched once, the same rows
    assert all(k["bytes_sent"] == e["bytes_sent"] - layer0 for k, e in zip(keep[1:], exch[1:]))


# (dataset, ranks, partitioner, --set list): kept features train the synchronous model
DIRECTED = "directed"
KEEP_CASES = {
    "gcn3-cora-3ranks-metis": ("cora", 3, "metis", ("model.arch=gcn", "model.layers=3",
                                                    "model.hidden=16")),
    "sage-csbm-4ranks-random": (CSBM, 4, "random", ("model.arch=sage", "model.hidden=32")),
    "gat-2ranks-attn-dropout": (GAT_GRAPH, 2, "metis", ("model.arch=gat", "model.heads=2",
                                                        "model.hidden=8", "model.attn_dropout=0.3")),
    "gcn-directed-3ranks": (DIRECTED, 3, "random", ("model.arch=gcn", "model.hidden=16")),
}


@pytest.fixture(scope="module")
def spec_of(tmp_path_factory):
    """A case's dataset spec: the one-way lattice of ``test_directed`` written as an npz."""
    path = tmp_path_factory.mktemp("directed") / "lattice.npz"
    np.savez(path, **lattice_arrays())
    return lambda name: f"npz:{path}" if name == DIRECTED else name


def _keep_sets(case: str) -> tuple[str, ...]:
    return (*KEEP_CASES[case][3], "model.dropout=0.5", f"train.epochs={EPOCHS}")


@pytest.fixture(scope="module")
def keep_runs(shards, spec_of, tmp_path_factory):
    return together(tmp_path_factory, {
        case: (ranks, shards(spec_of(spec), ranks, partitioner),
               (*_keep_sets(case), "train.keep_features=true"), {})
        for case, (spec, ranks, partitioner, _) in KEEP_CASES.items()})


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(KEEP_CASES))
def test_kept_features_train_the_whole_graph_model(case, shards, spec_of, keep_runs, tmp_path):
    from _pipegcn import pipegcn_losses
    from hpcgnn.data.datasets import load_dataset
    spec, ranks, partitioner, model_sets = KEEP_CASES[case]
    spec = spec_of(spec)
    proc, run = keep_runs(case)
    check_ok(proc)
    init = initial_params(shards(spec, 1), *_keep_sets(case)[:-1])     # a fresh model's
    shard_dir = shards(spec, ranks, partitioner)
    g, parts = load_dataset(spec), _parts(shard_dir, ranks)
    if partitioner == "metis" and spec == "cora":
        assert len(set(np.bincount(parts).tolist())) > 1                  # uneven parts
    got = [r["loss"] for r in read_metrics(run)]
    want = pipegcn_losses(g, parts, init, reference_model(model_sets), 0, 0.0, EPOCHS)
    assert got == pytest.approx(want, rel=2e-5)


@pytest.mark.mpi
def test_predict_of_a_kept_features_run_gives_the_trainers_accuracy(shards, tmp_path):
    """``hpcgnn predict`` builds the run's model, whose first layer keeps the features' halo
    rows: its predictions give the trainer's final test accuracy."""
    from hpcgnn.data.datasets import load_dataset
    from hpcgnn.predict import read_predictions
    run, shard_dir = tmp_path / "run", shards("cora", 3)
    for proc in run_together(3, [(["train", "--shards", shard_dir, "--out", run, "--config",
                                   "configs/cora.toml", "--set", "train.epochs=8",
                                   "--set", "train.keep_features=true"], {}),
                                 (["predict", "--run", run, "--shards", shard_dir,
                                   "--out", tmp_path / "pred"], {})], tmp_path / "jobs"):
        check_ok(proc)
    got, graph = read_predictions(tmp_path / "pred"), load_dataset("cora")
    idx = graph.test_idx[graph.labels[graph.test_idx] >= 0]
    acc = float((got["pred"][idx] == graph.labels[idx]).sum()) / len(idx)
    assert acc == json.loads((run / "summary.json").read_text())["final_test_acc"]


@pytest.mark.mpi
def test_a_schedule_only_the_kept_first_layer_would_use_is_refused(shards, tmp_path):
    """Staleness and ``keep_features`` keep the first layer's halo rows, so a schedule that
    compresses the first layer and no later one (``compress_last_layer = false`` on 2 layers)
    would change nothing: refused on every rank before any exchange, naming the schedule and
    the fix (it trained uncompressed, its metrics saying ratio 8 for layer 0). Accepted: a
    deeper model (the metrics give the first layer ratio 1: it sends nothing), and a schedule
    that compresses nothing itself (``codec = "none"``, the baseline)."""
    from hpcgnn.combinations import check_combination
    from hpcgnn.config import ConfigError, load_config
    from hpcgnn.schedule import load_schedule
    from conftest import train
    shard_dir = shards(CSBM, 2, "metis")
    (tmp_path / "t8.toml").write_text('codec = "truncate"\nkind = "constant"\nratio = 8.0\n')
    (tmp_path / "none.toml").write_text('codec = "none"\nkind = "constant"\nratio = 1.0\n')
    sched = ("--schedule", str(tmp_path / "t8.toml"))
    proc = train(2, shard_dir, tmp_path / "refused", "train.staleness=1", "train.epochs=2",
                 extra=sched)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "t8.toml: compress_last_layer = false is not allowed" in proc.stderr
    assert "set compress_last_layer = true, or drop --schedule" in proc.stderr
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
    (tmp_path / "t8-all.toml").write_text('codec = "truncate"\nkind = "constant"\nratio = 8.0\n'
                                          'compress_last_layer = true\n')
    for sets, name in ((["train.keep_features=true"], "t8"),
                       (["train.keep_features=true", "model.layers=1"], "t8-all")):
        with pytest.raises(ConfigError, match=r"would change nothing"):
            check_combination(load_config(None, sets), load_schedule(tmp_path / f"{name}.toml"))
    check_combination(load_config(None, ["train.keep_features=true", "train.eval_codec=train",
                                         "train.eval_features=exchange"]),
                      load_schedule(tmp_path / "t8.toml"))   # evaluation's first layer uses it
    runs = [(shard_dir, tmp_path / "deep", ["train.staleness=1", "train.epochs=2",
                                            "model.layers=3"], {}, sched),
            (shard_dir, tmp_path / "none", ["train.staleness=1", "train.epochs=2"], {},
             ("--schedule", str(tmp_path / "none.toml")))]
    for proc in train_together(2, runs, tmp_path / "jobs"):
        check_ok(proc)
    assert [r["ratio"] for r in read_metrics(tmp_path / "deep")] == [[1.0, 8.0, 1.0]] * 2
    assert [r["ratio"] for r in read_metrics(tmp_path / "none")] == [[1.0, 1.0]] * 2
