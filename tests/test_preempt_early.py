"""A preemption signal during start-up is kept, not fatal: ``hpcgnn train`` installs its
SIGUSR1/SIGTERM flag before torch is imported, so a signal that reaches the ranks while they
import torch, read their shards and agree (a preemption right after the job starts, or a short
``--time``) checkpoints at the first epoch's end and exits 0, and ``--resume`` finishes the run.
Before, SIGUSR1's default action killed the ranks (exit 138 under SLURM, no checkpoint)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from _mpi import mpi_command, mpi_env, start_until
from conftest import check_ok, read_metrics, run_mpi

pytestmark = pytest.mark.mpi


def _ranks_importing_torch(out: Path) -> list[int]:
    """Pids of this job's ranks (their command line names ``out``) that have torch's library
    mapped: they are past the command line's first lines and not yet training."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if str(out).encode() not in cmd or b"hpcgnn" not in cmd:
                continue
            if b"libtorch" in Path(f"/proc/{pid}/maps").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_signal_during_start_up_checkpoints_after_the_first_epoch(shards, tmp_path):
    shard_dir, out = shards("cora", 2, "metis"), tmp_path / "run"
    args = ["-m", "hpcgnn", "train", "--shards", str(shard_dir), "--config", "configs/cora.toml",
            "--out", str(out), "--set", "train.epochs=30"]
    listening = tmp_path / ".ranks-listening"       # as jobs/lib/train.sh names it
    proc = start_until(lambda: subprocess.Popen(
        mpi_command(2, args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=mpi_env({"HPCGNN_LISTENING": str(listening)})),
        lambda: len(_ranks_importing_torch(out)) >= 2, timeout=60, poll=0.01)
    try:
        assert not (out / "metrics.jsonl").exists()          # start-up, no epoch yet
        # rank 0 said that every rank keeps a USR1 (the job script passes it on only then)
        # after the start-up checks and before torch
        assert listening.is_file()
        proc.send_signal(signal.SIGUSR1)                      # mpiexec forwards it to the ranks
        log, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, log
    marker = json.loads((out / "preempted.json").read_text())
    assert 1 <= marker["epochs_done"] < 30 and (out / "checkpoint.pt").is_file(), log
    assert "preempted at epoch" in log
    check_ok(run_mpi(2, args + ["--resume"], timeout=120))
    assert [r["epoch"] for r in read_metrics(out)] == list(range(30))
    assert not (out / "preempted.json").exists()
