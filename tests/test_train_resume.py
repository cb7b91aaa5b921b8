"""Checkpoints, ``--resume`` and preemption: 10 epochs equal 5 + resume + 5 (same losses, same
final weights; also past a metrics line torn by a kill), and a real SIGUSR1 to a real mpiexec job checkpoints and exits 0, and
its resume equals the uninterrupted run."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from _mpi import mpi_command, mpi_env, start_until
from conftest import check_ok, read_metrics, train, train_here, train_together
from test_resume_exact import same_runs

SETS = ("model.arch=sage", "model.hidden=12")


def _weights(run_dir) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]


def test_resume_equals_straight_run(shards, tmp_path):
    shard_dir = shards("cora", 1)
    straight = train_here(shard_dir, tmp_path / "a", *SETS, "train.epochs=10")
    first = train_here(shard_dir, tmp_path / "b", *SETS, "train.epochs=10", stop_after=5)
    assert len(first) == 5
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:    # a kill tore the next record
        f.write('{"epoch": 5, "loss": 1.2')
    resumed = train_here(shard_dir, tmp_path / "b", *SETS, "train.epochs=10", resume=True)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]   # bit for bit
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["epochs"] == 10


def test_checkpoint_every_and_mismatched_resume(shards, tmp_path):
    shard_dir = shards("cora", 1)
    train_here(shard_dir, tmp_path, *SETS, "train.epochs=4", "run.checkpoint_every=2")
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["progress"]["epochs_done"] == 4 and "optimizer" in state and "torch_rng" in state
    from hpcgnn.train.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="checkpoint.pt.*model.arch: checkpoint 'sage', now 'gcn'"):
        train_here(shard_dir, tmp_path, "model.arch=gcn", "train.epochs=6", resume=True)
    # --force resumes other settings, but not a model of other shapes: refused before any comm
    with pytest.raises(CheckpointError, match=r"layers.0.bias: checkpoint \[12\], now "
                       r"\[20\].*not even with --force"):
        train_here(shard_dir, tmp_path, "model.arch=sage", "model.hidden=20", "train.epochs=6",
                   resume=True, force=True)
    # nor a run already past the epochs asked for (it trained nothing and summed up 4 epochs)
    with pytest.raises(CheckpointError, match=r"trained 4 epochs, more than train.epochs = 3"):
        train_here(shard_dir, tmp_path, *SETS, "train.epochs=3", resume=True, force=True)


@pytest.mark.mpi
def test_sigusr1_preempts_then_resume_finishes(shards, tmp_path):
    """A real signal to a real mpiexec, mid-training: checkpoint, preempted.json, exit 0; then
    --resume ends bit for bit where the uninterrupted run on the same 2 ranks ends."""
    shard_dir, out = shards("cora", 2, "metis"), tmp_path / "run"
    sets = (*SETS, "train.epochs=60", "train.keep_features=true")   # a fetch a resume redoes
    args = ["-m", "hpcgnn", "train", "--shards", str(shard_dir), "--config", "configs/cora.toml",
            "--out", str(out), *sum((["--set", s] for s in sets), [])]
    proc = None
    try:
        proc = start_until(lambda: subprocess.Popen(
            mpi_command(2, args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=mpi_env()), epochs_at_least(out, 2))
        proc.send_signal(signal.SIGUSR1)                      # mpiexec forwards it to the ranks
        log, _ = proc.communicate(timeout=60)
    finally:
        if proc is not None:
            proc.kill()
    assert proc.returncode == 0, log
    marker = json.loads((out / "preempted.json").read_text())
    assert "preempted at epoch" in log and "--resume" in log
    assert marker["epochs_done"] < 60 and (out / "checkpoint.pt").is_file()
    assert len(read_metrics(out)) == marker["epochs_done"]
    # the resume, then the uninterrupted run on the same 2 ranks, in one job
    config = ("--config", "configs/cora.toml")
    for done in train_together(2, [(shard_dir, out, sets, {}, (*config, "--resume")),
                                    (shard_dir, tmp_path / "ref", sets, {}, config)],
                               tmp_path / "jobs"):
        check_ok(done)
    assert not (out / "preempted.json").exists()
    same_runs(tmp_path / "ref", out, 60)        # bit for bit: metrics, checkpoint, summary


def epochs_at_least(run_dir: Path, n: int) -> Callable[[], bool]:
    """Has ``run_dir/metrics.jsonl`` ``n`` lines yet? (``start_until``'s ``ready``)."""
    path = Path(run_dir) / "metrics.jsonl"
    return lambda: path.is_file() and len(path.read_text().splitlines()) >= n


@pytest.mark.mpi
def test_a_damaged_checkpoint_is_refused_with_a_fix_that_works(shards, tmp_path):
    """A truncated checkpoint.pt (a full disk, a bad copy) is refused on --resume; the fix the
    message gives starts the run over (deleting the checkpoint and running without --resume
    would be refused: the directory still holds the run)."""
    shard_dir, out = shards("cora", 2), tmp_path / "run"
    sets = (*SETS, "train.epochs=4")
    check_ok(train(2, shard_dir, out, *sets, config="configs/cora.toml",
                   extra=("--stop-after", "2")))
    data = (out / "checkpoint.pt").read_bytes()
    (out / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    proc = train(2, shard_dir, out, *sets, config="configs/cora.toml", extra=("--resume",))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "checkpoint.pt: unreadable checkpoint" in proc.stderr
    assert "start the run over with --force instead of --resume" in proc.stderr
    check_ok(train(2, shard_dir, out, *sets, config="configs/cora.toml", extra=("--force",)))
    assert [r["epoch"] for r in read_metrics(out)] == [0, 1, 2, 3]


@pytest.mark.mpi
def test_a_resume_on_another_rank_count_says_so_and_is_recorded(shards, tmp_path):
    """A synchronous run may resume on another rank count (the weights are every rank's), but
    it is then no rank count's uninterrupted run: rank 0 warns, and run.json records each
    start's ranks (summary.json holds only the last)."""
    shard_dir, out = shards("cora", 4), tmp_path / "run"
    sets = (*SETS, "train.epochs=4", "train.eval_every=3")    # evaluated: epochs 2 and 3
    check_ok(train(2, shard_dir, out, *sets, config="configs/cora.toml",
                   extra=("--stop-after", "2")))          # between two evaluations
    proc = train(4, shard_dir, out, *sets, config="configs/cora.toml", extra=("--resume",))
    check_ok(proc)
    assert "--resume on 4 ranks of a run checkpointed on 2" in proc.stderr
    commands = json.loads((out / "run.json").read_text())["commands"]
    assert [c["ranks"] for c in commands] == [2, 4]
    lines = read_metrics(out)
    assert [r["epoch"] for r in lines] == [0, 1, 2, 3]
    # the per-rank figures of 2 ranks do not go on with 4: they start again at the resume
    per_rank = json.loads((out / "summary.json").read_text())["per_rank"]
    assert (per_rank["from_epoch"], per_rank["epochs"]) == (2, 2)
    assert per_rank["bytes_sent"]["mean"] * 4 == pytest.approx(sum(r["bytes_sent"] for r in lines[2:]))
    # the 2-rank figures gathered at the stop (epochs 0-1, no evaluation yet) are not 4 ranks'
    assert lines[2]["per_rank"]["epochs"] == 1 and "per_rank" not in lines[1]
    # and `hpcgnn summary` says from when its per-rank line counts
    said = subprocess.run([sys.executable, "-m", "hpcgnn", "summary", str(out)], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert said.returncode == 0 and "  per rank from epoch 2: sent " in said.stdout, said.stdout


@pytest.mark.mpi
def test_resume_force_trains_with_the_new_optimiser_settings(shards, tmp_path):
    """``--resume --force`` with another ``train.lr`` or ``train.weight_decay`` trains with the
    new values (torch's load_state_dict kept the checkpoint's, silently, while the warning and
    run.json said the new ones applied); another ``train.weight_decay_on`` regroups Adam's state,
    so it is refused on rank 0 before any exchange (was a traceback on every rank)."""
    import shutil
    shard_dir, out = shards("cora", 2), tmp_path / "run"
    sets = (*SETS, "train.epochs=4")
    check_ok(train(2, shard_dir, out, *sets, config="configs/cora.toml",
                   extra=("--stop-after", "2")))
    shutil.copytree(out, tmp_path / "copy")
    check_ok(train(2, shard_dir, out, *sets, "train.lr=0.002", "train.weight_decay=0.0",
                   config="configs/cora.toml", extra=("--resume", "--force")))
    groups = torch.load(out / "checkpoint.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(0.002, 0.0)]
    proc = train(2, shard_dir, tmp_path / "copy", *sets, "train.weight_decay_on=weights",
                 config="configs/cora.toml", extra=("--resume", "--force"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "[rank 0/2] ERROR rank 0: " in proc.stderr
    assert "train.weight_decay_on: checkpoint 'all', now 'weights'" in proc.stderr
    assert "not even with --force" in proc.stderr


def test_a_background_launch_whose_launcher_failed_is_started_again(tmp_path):
    """``start_until``: a job that exits 213 before it is ready (prterun failing before any rank
    ran, seen about once in 900 launches of a loaded CI run) is started once more; any other
    early exit is the test's failure."""
    ready = tmp_path / "ready"
    jobs = iter([["bash", "-c", "exit 213"], ["bash", "-c", f"touch {ready}; sleep 5"]])
    proc = start_until(lambda: subprocess.Popen(next(jobs), stdout=subprocess.PIPE), ready.exists,
                       timeout=20)
    assert ready.exists() and proc.poll() is None
    proc.kill()
    proc.wait()
    with pytest.raises(AssertionError, match=r"ended early \(exit 3\)"):
        start_until(lambda: subprocess.Popen(["bash", "-c", "exit 3"], stdout=subprocess.PIPE),
                    lambda: False, timeout=20)
