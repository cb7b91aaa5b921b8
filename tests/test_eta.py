"""Rank 0's progress lines: every 5 % of the epochs or every 5 s of wall time, with an ETA
(checked on a clock the test advances, and in a real 1-rank run's log)."""
from __future__ import annotations

import subprocess
import sys

from _mpi import mpi_env
from hpcgnn.train.eta import EpochReporter, format_eta


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_due_every_five_percent_or_five_seconds():
    clock = Clock()
    rep = EpochReporter(0, 1000, interval_s=5.0, clock=clock)      # 5 % = 50 epochs
    due = []
    for epoch in range(120):
        clock.t += 0.01 if epoch < 100 else 3.0                       # slow epochs from 100 on
        if rep.due(epoch):
            due.append(epoch)
    assert due == [49, 99, 101, 103, 105, 107, 109, 111, 113, 115, 117, 119]
    assert rep.eta_s(119) == (clock.t - 100.0) / 120 * 880


def test_eta_after_resume_counts_this_segment_only():
    clock = Clock()
    rep = EpochReporter(40, 50, clock=clock)                          # resumed after 40 epochs
    clock.t += 20.0                                                   # epochs 40..44 took 20 s
    assert rep.eta_s(44) == 20.0                                      # 4 s x 5 epochs left
    assert rep.eta_s(49) == 0.0


def test_format_eta():
    assert [format_eta(s) for s in (0.4, 12, 185, 3725)] == ["0s", "12s", "3m05s", "1h02m"]


def test_a_run_logs_progress_with_eta(shards, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpcgnn", "train", "--shards", str(shards("cora", 1)),
                           "--out", str(tmp_path), "--config", "configs/cora.toml", "--set",
                           "train.epochs=40"], capture_output=True, text=True, timeout=120,
                          env=mpi_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if " ETA " in ln]
    assert len(lines) >= 20 and "epoch 1 (2/40)" in lines[0] and "epoch 39 (40/40)" in lines[-1]
    assert lines[-1].endswith("ETA 0s")
