"""Evaluation counts labelled nodes only: a small npz graph with unlabelled (-1) nodes inside its
val/test splits; preprocess warns naming the file and the count; the accuracies the trainer
reports on 2 ranks equal a count done here from a dense whole-graph GCN with the checkpoint's
weights over the labelled nodes of each split."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from _graphs import dense_gcn, partly_labelled_npz
from _mpi import mpi_env
from conftest import check_ok, read_metrics, train

pytestmark = pytest.mark.mpi


def test_accuracy_counts_labelled_nodes_only(tmp_path):
    arrays = partly_labelled_npz(tmp_path / "g.npz")
    labels = arrays["labels"]
    proc = subprocess.run([sys.executable, "-m", "preprocess", "--dataset", f"npz:{tmp_path / 'g.npz'}",
                           "--parts", "2", "--partitioner", "random", "--out", str(tmp_path / "shards")],
                          capture_output=True, text=True, timeout=120, env=mpi_env(), stdin=subprocess.DEVNULL)
    check_ok(proc)
    for name in ("val_idx", "test_idx"):
        count = int((labels[arrays[name]] < 0).sum())
        assert count > 0 and f"g.npz: {name} selects {count} unlabelled node(s)" in proc.stderr
    assert "train_idx selects" not in proc.stderr
    check_ok(train(2, tmp_path / "shards", tmp_path / "run", "train.epochs=5", "model.hidden=8",
                   "train.lr=0.05"))
    last = read_metrics(tmp_path / "run")[-1]
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["model"]
    pred = dense_gcn(arrays, state)[1].argmax(axis=1)
    for name in ("train", "val", "test"):
        idx = arrays[f"{name}_idx"]
        labelled = idx[labels[idx] >= 0]
        correct = int((pred[labelled] == labels[labelled]).sum())
        assert 0 < correct
        assert last[f"{name}_acc"] == pytest.approx(correct / len(labelled), abs=1e-12), name
        if name != "train":                       # the old count (unlabelled = wrong) differs
            assert last[f"{name}_acc"] != pytest.approx(correct / len(idx))
    assert np.all(labels[arrays["train_idx"]] >= 0)
