"""``bench/step_phases.py`` wraps the trainer's step and what it calls: on real ranks the timed
run must train what ``hpcgnn train`` trains (the same per-epoch losses, a stale run so that the
late gradients are in it) and record every phase of every step on every rank."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import check_ok, read_metrics, run_mpi, train

BENCH = Path(__file__).resolve().parents[1] / "bench" / "step_phases.py"
SETS = ("train.epochs=4", "train.staleness=1", "train.eval_every=2")


@pytest.mark.mpi
def test_step_phases_trains_what_train_trains_and_times_every_step(shards, tmp_path):
    data = shards("cora", 2)
    check_ok(train(2, data, tmp_path / "plain", *SETS, config="configs/cora.toml"))
    args = [str(BENCH), str(tmp_path / "phases.json"), "--", "train", "--shards", str(data),
            "--config", "configs/cora.toml", "--out", str(tmp_path / "timed")]
    for s in SETS:
        args += ["--set", s]
    proc = run_mpi(2, args, timeout=120)
    check_ok(proc)
    want, got = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "timed")
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    steps = json.loads((tmp_path / "phases.json").read_text())
    assert len(steps) == 2 and all(len(rank) == 4 for rank in steps)
    for rank in steps:
        assert [s["epoch"] for s in rank] == [0, 1, 2, 3]
        assert all(s[k] > 0 for s in rank for k in ("forward", "backward", "allreduce", "rest"))
    late = steps[0][-1]["parts"]                  # epoch 3: stale, past the warm-up
    assert late["HaloPropagation.aggregate_halo"] > 0 and late["StalePropagation.input_halo"] > 0
    assert "rank 0: step CPU ms median" in proc.stdout and "rank 1: step CPU ms" in proc.stdout
