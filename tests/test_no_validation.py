"""A graph without labelled validation nodes (an empty ``val_idx``, which preprocessing accepts):
there is no best validation to select on. ``val_acc`` and ``val_loss`` were written as 0.0, every
evaluation tied at 0.0, so ``summary.json``'s ``test_acc`` "at the best validation" was epoch 0's
(Cora: 0.17 against 0.72 at the end, "at best validation 0.0000"), and RETEXO restored each
stage's first-round weights, training the next stage on an untrained embedding and predicting
with it. Now they are null, the last evaluation counts (``test_acc`` = ``final_test_acc``), RETEXO
keeps each stage's last state, and rank 0 warns once. Checked on 2 real ranks against the test
accuracy computed here from ``hpcgnn predict``'s output and the input's labels.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import check_ok, run_together


@pytest.fixture(scope="module")
def no_val(tmp_path_factory):
    """Cora with an empty ``val_idx``, as an npz input: ``(path, labels, test_idx)``."""
    from hpcgnn.data.datasets import load_dataset
    g = load_dataset("cora")
    x = g.dense_features() if callable(g.dense_features) else g.dense_features
    path = tmp_path_factory.mktemp("noval") / "cora-noval.npz"
    np.savez(path, num_nodes=np.int64(g.num_nodes), adj_indptr=g.indptr.astype(np.int64),
             adj_indices=g.indices.astype(np.int64), features=np.asarray(x, dtype=np.float32),
             labels=g.labels.astype(np.int64), train_idx=g.train_idx.astype(np.int64),
             val_idx=np.zeros(0, np.int64), test_idx=g.test_idx.astype(np.int64))
    return path, np.asarray(g.labels), np.asarray(g.test_idx)


@pytest.mark.mpi
def test_without_validation_nodes_the_last_evaluation_counts(shards, no_val, tmp_path):
    from hpcgnn.predict import read_predictions
    path, labels, test_idx = no_val
    shard_dir = shards(f"npz:{path}", 2)
    runs = {"gcn": ("configs/cora.toml", ["--set", "train.epochs=30"]),
            "retexo": ("configs/retexo.toml", ["--set", "train.epochs=30",
                                               "--set", "train.rounds_per_layer=15"])}
    commands = [(["train", "--shards", shard_dir, "--config", cfg, "--out", tmp_path / name, *extra], {})
                for name, (cfg, extra) in runs.items()]
    commands += [(["predict", "--run", tmp_path / name, "--shards", shard_dir,
                   "--out", tmp_path / f"pred-{name}"], {}) for name in runs]
    procs = run_together(2, commands, tmp_path / "jobs", timeout=300)
    for proc in procs:
        check_ok(proc)
    for name, proc in zip(runs, procs):
        assert proc.stderr.count("no labelled validation node") == 1, proc.stderr[-3000:]
        lines = [json.loads(ln) for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert all(r["val_acc"] is None and r["val_loss"] is None for r in lines if "test_acc" in r)
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        pred = read_predictions(tmp_path / f"pred-{name}")
        assert (pred["global_id"] == np.arange(len(labels))).all()
        test_acc = float((pred["pred"][test_idx] == labels[test_idx]).mean())   # independent
        assert summary["best_val_acc"] is None and summary["best_epoch"] == 29, (name, summary)
        assert summary["test_acc"] == summary["final_test_acc"] == lines[-1]["test_acc"], (name, summary)
        assert abs(summary["test_acc"] - test_acc) < 1e-9, (name, summary["test_acc"], test_acc)
        assert test_acc > 0.4, (name, test_acc)              # trained, not epoch 0's weights
        shown = subprocess.run([sys.executable, "-m", "hpcgnn", "summary", str(tmp_path / name)],
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0 and "no labelled validation node: the last evaluation's" \
            in shown.stdout, shown.stdout + shown.stderr
