"""Faults of a running job, injected into the real program on real ranks (``run_injected``):
each ends the job, promptly and with its documented exit code, and leaves a run directory that
resumes. Kills, a full disk and a bug on one rank: ``test_train_errors.py``; a signal during
start-up: ``test_preempt_early.py``."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from _mpi import REPO, injected_command, mpi_env, run_injected, start_until
from conftest import check_ok, read_metrics, run_mpi

pytestmark = pytest.mark.mpi


def _launch(fault: str, args: list) -> subprocess.Popen:
    return subprocess.Popen(injected_command(2, "hpcgnn", fault, args), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=mpi_env(), cwd=str(REPO))


def _launch_until(fault: str, args: list, path: Path) -> subprocess.Popen:
    """``_launch`` until ``path`` exists (started once more where the launcher failed)."""
    return start_until(lambda: _launch(fault, args), path.exists, timeout=90, poll=0.01)


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 90) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, f"job ended early: {proc.communicate()[0]}"
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.01)


RANK_0_SAVES_SLOWLY = """\
import time
from pathlib import Path
import hpcgnn.train.checkpoint as ckpt
real = ckpt.save_checkpoint
def save_checkpoint(run_dir, state):
    Path(run_dir, "..", "saving").touch()
    time.sleep(3)
    return real(run_dir, state)
ckpt.save_checkpoint = save_checkpoint
"""


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_a_second_signal_while_rank_0_writes_the_checkpoint_is_ignored(shards, tmp_path, signum):
    """A preemption signal to every rank (as srun sends it), then another while rank 0 writes
    the preemption's checkpoint (slowed here): rank 1, its part done, was leaving through
    MPI_Finalize with the signal's default action back (Python's teardown restores it), so the
    second signal killed it and the launcher killed rank 0 mid-write: exit 138 or 143, no
    checkpoint.pt, no preempted.json. Now the job exits 0 with both, and --resume finishes."""
    from test_train_errors import _rank_pids
    shard_dir, out = shards("cora", 2, "metis"), tmp_path / "run"
    args = ["train", "--shards", shard_dir, "--config", "configs/cora.toml", "--out", out,
            "--set", "train.epochs=200"]
    proc = _launch_until(RANK_0_SAVES_SLOWLY, args, out / "metrics.jsonl")
    try:
        ranks = _rank_pids(proc.pid)
        for pid in ranks:
            os.kill(pid, signum)
        _wait_for(tmp_path / "saving", proc)
        time.sleep(1)                                    # rank 1 is leaving; rank 0 writes
        for pid in ranks:
            os.kill(pid, signum)
        log, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, log
    marker = json.loads((out / "preempted.json").read_text())
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["progress"]["epochs_done"] == marker["epochs_done"] < 200, log
    check_ok(run_mpi(2, ["-m", "hpcgnn", *map(str, args), "--resume"], timeout=120))
    assert [r["epoch"] for r in read_metrics(out)] == list(range(200))


RANK_1_DIVERGES_AT_EPOCH_3 = """\
from mpi4py import MPI
import hpcgnn.train.trainer as trainer
real = trainer.Trainer.finish_step
def finish_step(self, logits, *args):
    if MPI.COMM_WORLD.Get_rank() == 1 and self.progress.epochs_done == 3:
        logits = logits * float("nan")
    return real(self, logits, *args)
trainer.Trainer.finish_step = finish_step
"""


@pytest.mark.parametrize("progress", ["test", "thread"])
def test_a_stale_run_that_diverges_on_one_rank_exits_3(shards, tmp_path, progress):
    """A NaN loss on rank 1 alone (injected) at epoch 3 of a stale run: every rank stops at that
    epoch with exit code 3, the checkpoint before it kept. The halo rows and gradients the
    stale layers had posted were left in flight, and with the progress thread still testing them
    MPI_Finalize aborted the job (exit 14, 'MPI_Testall() called after MPI_FINALIZE')."""
    out = tmp_path / "run"
    proc = run_injected(2, "hpcgnn", RANK_1_DIVERGES_AT_EPOCH_3, [
        "train", "--shards", shards("cora", 2, "metis"), "--config", "configs/cora.toml",
        "--out", out, "--set", "train.epochs=20", "--set", "train.staleness=1",
        "--set", "run.checkpoint_every=2"], timeout=120, env={"HPCGNN_PROGRESS": progress})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.count("epoch 3: the training loss is nan: training diverged") == 1
    assert "MPI_FINALIZE" not in proc.stderr
    assert [r["epoch"] for r in read_metrics(out)] == [0, 1, 2, 3]
    assert torch.load(out / "checkpoint.pt", weights_only=True)["progress"]["epochs_done"] == 2
    assert not (out / "summary.json").exists()


EPOCH_3_EVALUATES_SLOWLY = """\
import time
from pathlib import Path
import hpcgnn.train.trainer as trainer
real = trainer.Trainer.evaluate
def evaluate(self, epoch):
    if epoch == 3:
        Path(self.run_dir, "..", "evaluating").touch()
        time.sleep(2)
    return real(self, epoch)
trainer.Trainer.evaluate = evaluate
"""


def test_a_signal_during_evaluation_stops_at_that_epochs_end(shards, tmp_path):
    """SIGUSR1 while the ranks evaluate epoch 3 (slowed here): the ranks stop at epoch 3's end.
    The flag was read before evaluation, so such a signal trained and evaluated one more epoch
    first: more than the lead time docs/cluster.md asks for (one epoch with evaluation and a
    checkpoint)."""
    out = tmp_path / "run"
    proc = _launch_until(EPOCH_3_EVALUATES_SLOWLY, [
        "train", "--shards", shards("cora", 2, "metis"), "--config", "configs/cora.toml",
        "--out", out, "--set", "train.epochs=50"], tmp_path / "evaluating")
    try:
        proc.send_signal(signal.SIGUSR1)
        log, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, log
    assert json.loads((out / "preempted.json").read_text()) == {"epoch": 3, "epochs_done": 4}, log
    assert [r["epoch"] for r in read_metrics(out)] == [0, 1, 2, 3]


RANK_1_PROGRESS_THREAD_FAILS = """\
import threading
from mpi4py import MPI
import hpcgnn.comm.progress as progress
real = progress.Progress._test
calls = []
def _test(self):
    if threading.current_thread().name == "hpcgnn-progress" and MPI.COMM_WORLD.Get_rank() == 1:
        calls.append(1)
        if len(calls) == 5:
            raise OSError("a fault injected into rank 1's progress thread")
    return real(self)
progress.Progress._test = _test
"""


def test_an_exception_in_the_progress_thread_ends_the_job(shards, tmp_path):
    """An exception in rank 1's progress thread (``comm.progress = "thread"``, injected) ends
    the job with its traceback and no summary; it was printed by the thread alone ('Exception in
    thread hpcgnn-progress') and the run went on to write summary.json and exit 0."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_injected(2, "hpcgnn", RANK_1_PROGRESS_THREAD_FAILS, [
        "train", "--shards", shards("cora", 2, "metis"), "--config", "configs/cora.toml",
        "--out", out, "--set", "train.epochs=30", "--set", "train.staleness=1"], timeout=120,
        env={"HPCGNN_PROGRESS": "thread"})
    assert proc.returncode not in (0, None) and time.monotonic() - t0 < 60, proc.stderr
    assert "RuntimeError: the progress thread failed: OSError(\"a fault injected" in proc.stderr
    assert not (out / "summary.json").exists() and len(read_metrics(out)) < 30


def test_an_interrupt_on_one_rank_ends_the_job(shards, tmp_path):
    """SIGINT (Ctrl-C) to rank 1 alone of ``mpiexec python -m hpcgnn`` (no mpi4py runner, as
    the README allows): the job aborts with code 130 as under ``-m mpi4py``; the interrupted
    rank left through MPI_Finalize while rank 0 waited in the epoch's collective, until the job's
    time limit. The periodic checkpoint resumes."""
    from test_train_errors import _rank_pids
    shard_dir, out = shards("cora", 2, "metis"), tmp_path / "run"
    args = ["train", "--shards", shard_dir, "--config", "configs/cora.toml", "--out", out,
            "--set", "run.checkpoint_every=2"]
    proc = _launch_until("", args + ["--set", "train.epochs=100000"], out / "checkpoint.pt")
    try:
        os.kill(_rank_pids(proc.pid)[1], signal.SIGINT)
        log, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "KeyboardInterrupt" in log, log
    done = torch.load(out / "checkpoint.pt", weights_only=True)["progress"]["epochs_done"]
    check_ok(run_mpi(2, ["-m", "hpcgnn", *map(str, args), "--set", f"train.epochs={done + 2}",
                         "--resume", "--force"], timeout=120))
    assert [r["epoch"] for r in read_metrics(out)] == list(range(done + 2))
