"""``train.eval_features``: evaluation's first layer on the features' halo rows kept on the rank.

On real ranks, evaluation through kept rows gives the whole graph's logits (a dense GCN written
in the test, with the checkpoint's weights), in a synchronous run (``kept``) and in a stale one
(``auto``, where training keeps those rows anyway); training is not touched (the same losses bit
for bit as with ``exchange``); after the first evaluation the first layer sends nothing; and the
combinations it cannot serve are refused with the key and the fix."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _graphs import dense_gcn, partly_labelled_npz
from conftest import check_ok, read_metrics, train_together

RUNS = {"sync-exchange": ("train.eval_features=exchange",),
        "sync-kept": ("train.eval_features=kept",),
        "stale-exchange": ("train.staleness=1", "train.eval_features=exchange"),
        "stale-auto": ("train.staleness=1",)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The four runs of ``RUNS`` on 3 ranks: a 3-layer GCN on a random graph with partly
    labelled val/test splits, 3 random parts, evaluation every epoch."""
    from preprocess import partition_graph, write_shards
    from hpcgnn.data.datasets import load_dataset
    work = tmp_path_factory.mktemp("eval-features")
    arrays = partly_labelled_npz(work / "g.npz")
    graph = load_dataset(f"npz:{work / 'g.npz'}")
    write_shards(graph, partition_graph(graph, 3, "random", seed=0), work / "shards",
                 partitioner="random", seed=0, force=False, num_parts=3)
    common = ("train.epochs=6", "model.layers=3", "model.hidden=6", "model.dropout=0.5")
    runs = [(work / "shards", work / name, (*common, *sets), {}) for name, sets in RUNS.items()]
    for proc in train_together(3, runs, work / "jobs"):
        check_ok(proc)
    return arrays, {name: work / name for name in RUNS}


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
@pytest.mark.parametrize("name", ["sync-kept", "stale-auto"])
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


def test_what_kept_rows_cannot_serve_is_refused():
    from hpcgnn.combinations import check_combination
    from hpcgnn.config import ConfigError, load_config
    cases = [(["train.eval_features=kept", "parallel.algorithm=1.5d"], r"no halo rows to keep"),
             (["train.eval_features=kept", "train.method=retexo", "train.epochs=400"],
              r"train.method = 'retexo' evaluates its own way"),
             (["train.eval_features=kept", "train.eval_codec=train"],
              r"train.eval_codec = 'train'.*'exchange'"),
             (["train.eval_features=all"], r"use 'auto', 'exchange' or 'kept'")]
    for sets, match in cases:
        with pytest.raises(ConfigError, match=match):
            check_combination(load_config(None, sets))
    # a stale run's first layer trains on exact kept rows, so 'train' evaluation agrees with them
    check_combination(load_config(None, ["train.eval_features=kept", "train.eval_codec=train",
                                         "train.staleness=1"]))
    assert load_config(None, []).train.eval_features == "auto"
