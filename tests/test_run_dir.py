"""``hpcgnn train --out DIR`` on a DIR that holds a run: refused on every rank at start-up
(before any exchange) with one message naming DIR, what it holds and both fixes, unless
``--resume`` (continue it) or ``--force`` (a new run replaces it). Real ranks, real files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from _mpi import mpi_command, mpi_env, start_until
from conftest import check_ok, read_metrics, refused_before_torch, train
from test_train_resume import epochs_at_least

SETS = ("train.epochs=3", "model.hidden=8")


def _files(run_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


@pytest.mark.mpi
def test_a_stopped_run_is_refused_then_resumed_then_replaced(shards, tmp_path):
    shard_dir, run = shards("cora", 2), tmp_path / "run"
    check_ok(train(2, shard_dir, run, *SETS, config="configs/cora.toml", extra=("--stop-after", "2")))
    before = _files(run)
    assert "checkpoint.pt" in before and "summary.json" not in before

    again = train(2, shard_dir, run, *SETS, config="configs/cora.toml")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    errors = [ln for ln in again.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1, again.stderr                      # once, by rank 0, for both ranks
    line = errors[0]
    assert line.startswith("[rank 0/2] ERROR ranks 0-1: ") and str(run) in line
    assert "a run stopped after 2 epochs" in line and "checkpoint.pt" in line
    assert "--resume" in line and "--force" in line
    assert _files(run) == before                               # nothing touched

    check_ok(train(2, shard_dir, run, *SETS, config="configs/cora.toml", extra=("--resume",)))
    assert [r["epoch"] for r in read_metrics(run)] == [0, 1, 2]
    finished = train(2, shard_dir, run, *SETS, config="configs/cora.toml")
    assert finished.returncode == 2 and "a finished run (3 epochs" in finished.stderr

    forced = train(2, shard_dir, run, "train.epochs=2", "model.hidden=8", config="configs/cora.toml",
                   extra=("--force",))
    check_ok(forced)
    assert "--force: starting a new run in" in forced.stderr
    assert [r["epoch"] for r in read_metrics(run)] == [0, 1]
    assert json.loads((run / "summary.json").read_text())["epochs"] == 2
    commands = json.loads((run / "run.json").read_text())["commands"]
    assert len(commands) == 1 and "--force" in commands[0]["argv"]


@pytest.mark.mpi
def test_a_run_killed_past_its_checkpoint_is_described_by_the_checkpoint(shards, tmp_path):
    """A resumed run killed (SIGKILL: a time limit, a lost node) after its last checkpoint has
    more lines in metrics.jsonl than the checkpoint holds: `train` and `summary` said 'stopped
    after <the lines> epochs' while --resume went on from the checkpoint's, dropping the rest."""
    from hpcgnn.train.metrics import record_epoch
    from hpcgnn.train.rundir import describe_run
    shard_dir, run = shards("cora", 2), tmp_path / "run"
    sets = ("train.epochs=2000", "model.hidden=8")
    check_ok(train(2, shard_dir, run, *sets, config="configs/cora.toml", extra=("--stop-after", "2")))
    args = ["-m", "hpcgnn", "train", "--shards", str(shard_dir), "--config", "configs/cora.toml",
            "--out", str(run), "--resume", *sum((["--set", s] for s in sets), [])]
    started = []

    def start():
        started.append(subprocess.Popen(mpi_command(2, args), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env=mpi_env(), start_new_session=True))
        return started[-1]
    try:
        start_until(start, epochs_at_least(run, 6))
    finally:
        proc = started[-1]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)      # mpiexec, its daemon: no checkpoint
        proc.wait(timeout=30)
    lines = _settled(run / "metrics.jsonl")          # the ranks die once they see it gone
    done = len([e for e in map(record_epoch, lines) if e is not None])   # a torn last line
    assert done >= 6 and not (run / "preempted.json").exists()
    want = (f"a run stopped after 2 epochs as checkpointed (metrics.jsonl records {done}; "
            f"--resume continues from epoch 2 and drops the {done - 2} after it)")
    assert describe_run(run).startswith(want)
    again = train(2, shard_dir, run, *sets, config="configs/cora.toml")
    assert again.returncode == 2, again.stderr[-2000:]
    assert "holds a run stopped after 2 epochs as checkpointed (metrics.jsonl records " in again.stderr
    check_ok(train(2, shard_dir, run, *sets, config="configs/cora.toml",
                   extra=("--resume", "--stop-after", "3")))
    assert [r["epoch"] for r in read_metrics(run)] == [0, 1, 2]        # it went on from 2
    assert describe_run(run).startswith("a run stopped after 3 epochs (checkpoint.pt")


def _settled(path, quiet: float = 3.0, timeout: float = 60) -> list[str]:
    """The lines of ``path`` once it has not changed for ``quiet`` seconds (the ranks of a
    killed mpiexec go on for about a second before they notice)."""
    end, last, since = time.monotonic() + timeout, None, time.monotonic()
    while time.monotonic() < end:
        text = path.read_text()
        if text != last:
            last, since = text, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return text.splitlines()
        time.sleep(0.2)
    raise AssertionError(f"{path}: still written {timeout} s after the job was killed")


@pytest.mark.mpi
@pytest.mark.parametrize("case,ranks,want", [
    ("finished run", 2, "holds a finished run (3 epochs; summary.json)"),
    ("config", 2, "did you mean 'model.hidden'?"),
    ("rank count", 3, "the shard set has 2 parts but the job has 3 ranks"),
    ("out is a file", 2, "summary.json: exists and is not a directory; give --out a directory"),
    ("out under a file", 2, "summary.json is a file, not a directory; give --out a directory"),
    ("stopped run", 2, "holds a run stopped after 2 epochs as checkpointed (metrics.jsonl "
                       "records 5; --resume continues from epoch 2")])
def test_these_refusals_come_before_torch_is_imported(case, ranks, want, shards, tmp_path):
    """An --out holding a run (one whose checkpoint holds fewer epochs than its metrics: read
    without torch), a bad run-config key, a rank count that does not divide the parts and an
    --out that is or lies under a file are refused on every rank before any rank imports torch
    (``hpcgnn.train.early``): Python's import log of every rank (``PYTHONPROFILEIMPORTTIME``)
    names mpi4py, no torch."""
    run = tmp_path / "run"
    run.mkdir()
    if case == "stopped run":       # a checkpoint as torch.save writes it, tensors and all
        import torch
        torch.save({"model": {"w": torch.ones(3)}, "progress": {"epochs_done": 2, "best": 0.5}},
                   run / "checkpoint.pt")
        (run / "metrics.jsonl").write_text("".join(f'{{"epoch": {e}}}\n' for e in range(5)))
        proc = train(ranks, shards("cora", 2), run, *SETS, env={"PYTHONPROFILEIMPORTTIME": "1"})
        refused_before_torch(proc, ranks, want)
        return
    (run / "summary.json").write_text(json.dumps({"epochs": 3}))
    sets = ("model.hiden=8",) if case == "config" else SETS
    extra = () if case == "finished run" else ("--force",)
    out = {"out is a file": run / "summary.json",
           "out under a file": run / "summary.json" / "run"}.get(case, run)
    listening = tmp_path / ".ranks-listening"      # said only once every rank passed these
    proc = train(ranks, shards("cora", 2), out, *sets, extra=extra,
                 env={"PYTHONPROFILEIMPORTTIME": "1", "HPCGNN_LISTENING": str(listening)})
    refused_before_torch(proc, ranks, want)
    assert (run / "summary.json").read_text() == json.dumps({"epochs": 3})    # untouched
    assert not listening.exists()


@pytest.mark.mpi
def test_an_empty_or_foreign_directory_is_a_fine_out(shards, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine\n")                    # not a run's file
    check_ok(train(2, shards("cora", 2), run, "train.epochs=1", "model.hidden=8"))
    assert (run / "notes.txt").read_text() == "mine\n" and (run / "summary.json").is_file()


def test_describe_names_what_a_directory_holds(tmp_path):
    from hpcgnn.train.rundir import RunDirError, check_run_dir, clear_old_run, describe_run
    run = tmp_path / "r"
    assert describe_run(run) is None
    run.mkdir()
    assert describe_run(run) is None
    (run / "metrics.jsonl").write_text("".join(json.dumps({"epoch": e}) + "\n" for e in range(7)))
    assert describe_run(run).startswith("a run stopped after 7 epochs without a checkpoint")
    (run / "checkpoint.pt").write_bytes(b"x")
    (run / "preempted.json").write_text(json.dumps({"epoch": 29, "epochs_done": 30}))
    assert describe_run(run).startswith("a preempted run, stopped after 30 epochs")
    with pytest.raises(RunDirError, match=r"r: holds a preempted run, stopped after 30 epochs .*"
                                          r"--resume to continue .* --force to start a new run"):
        check_run_dir(run, resume=False, force=False)
    check_run_dir(run, resume=True, force=False)
    check_run_dir(run, resume=False, force=True)
    (run / "preempted.json").unlink()
    (run / "summary.json").write_text(json.dumps({"epochs": 200}))
    assert describe_run(run).startswith("a finished run (200 epochs")
    assert sorted(clear_old_run(run)) == ["checkpoint.pt", "summary.json"]
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


@pytest.mark.mpi
def test_a_finished_run_given_more_epochs_has_no_summary_until_it_finishes(shards, tmp_path):
    """``--resume --force`` with more ``train.epochs`` continues a finished run; stopped (or
    preempted, or killed) before the new end, its old summary.json must not stand for it."""
    import subprocess
    import sys
    shard_dir, run = shards("cora", 2), tmp_path / "run"
    check_ok(train(2, shard_dir, run, *SETS, config="configs/cora.toml"))
    assert json.loads((run / "summary.json").read_text())["epochs"] == 3
    more = ("train.epochs=6", "model.hidden=8")
    check_ok(train(2, shard_dir, run, *more, config="configs/cora.toml",
                   extra=("--resume", "--force", "--stop-after", "4")))
    assert not (run / "summary.json").exists()
    summary = subprocess.run([sys.executable, "-m", "hpcgnn", "summary", str(run)],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 2 and "summary.json: not found" in summary.stderr
    again = train(2, shard_dir, run, *more, config="configs/cora.toml")
    assert again.returncode == 2 and "a run stopped after 4 epochs" in again.stderr
    check_ok(train(2, shard_dir, run, *more, config="configs/cora.toml", extra=("--resume",)))
    assert json.loads((run / "summary.json").read_text())["epochs"] == 6
    assert [r["epoch"] for r in read_metrics(run)] == list(range(6))


@pytest.mark.mpi
def test_force_over_a_stale_run_removes_its_rank_files(shards, tmp_path):
    """A new run forced over a stopped stale run: the old checkpoint's rank files go with it
    (a run without staleness never saves rank files, so nothing else would remove them)."""
    shard_dir, run = shards("cora", 2), tmp_path / "run"
    check_ok(train(2, shard_dir, run, *SETS, "train.staleness=1", config="configs/cora.toml",
                   extra=("--stop-after", "2")))
    assert len(list(run.glob("checkpoint.rank-*.pt"))) == 2
    check_ok(train(2, shard_dir, run, *SETS, config="configs/cora.toml", extra=("--force",)))
    assert not list(run.glob("checkpoint.rank-*.pt"))
    assert json.loads((run / "summary.json").read_text())["epochs"] == 3


def test_the_temporaries_removed_at_start_are_those_of_every_file_written_so(tmp_path):
    """Each file the run directory gets through a temporary name (an abort on a full disk, or a
    kill, leaves its ``.NAME.tmp-PID``) is one ``remove_temporaries`` removes; others stay."""
    from hpcgnn.train.checkpoint import remove_temporaries
    from hpcgnn.train.metrics import METRICS_NAME, SUMMARY_NAME
    from hpcgnn.train.records import SCHEDULE_NAME
    from hpcgnn.train.rundir import CHECKPOINT_NAME, CONFIG_NAME, RUN_NAME
    ours = [f".{n}.tmp-{41 + i}" for i, n in enumerate(
        (METRICS_NAME, SUMMARY_NAME, SCHEDULE_NAME, CHECKPOINT_NAME, CONFIG_NAME, RUN_NAME,
         "checkpoint.rank-00001.0123456789ab.pt"))]
    others = [".notes.txt.tmp-7", ".metrics.jsonl.tmp-x", "metrics.jsonl.tmp-3", ".run.json.tmp-"]
    for name in ours + others:
        (tmp_path / name).write_text("partial")
    assert sorted(remove_temporaries(tmp_path)) == sorted(ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others)
