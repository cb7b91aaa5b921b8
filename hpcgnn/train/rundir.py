"""Whether ``--out`` already holds a run, and what: so that ``hpcgnn train`` never silently
starts afresh over a stopped (resumable) or finished run.

``check_run_dir(run_dir, resume, force)`` runs on every rank at start-up, before any exchange
(``hpcgnn.train.launch.build_trainer``): a directory holding a run is refused unless
``--resume`` (continue it) or ``--force`` (start a new run over it). ``clear_old_run`` then
removes, on rank 0 and only after every rank agreed to start, the old run's checkpoint,
preemption marker and summary, so a forced restart that dies early leaves nothing of the old
run that looks like its own.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import socket
import tempfile
import zipfile
from pathlib import Path

from hpcgnn.train.metrics import METRICS_NAME, SUMMARY_NAME, record_epoch
from hpcgnn.train.preempt import PREEMPTED_NAME

# The run's checkpoint, record and resolved config (``hpcgnn.train.checkpoint`` and
# ``hpcgnn.train.records`` take their names from here): this module imports no torch, so
# ``hpcgnn train`` checks ``--out`` before importing it (``hpcgnn.train.early``).
CHECKPOINT_NAME, RUN_NAME, CONFIG_NAME = "checkpoint.pt", "run.json", "config.toml"

RUN_FILES = (CHECKPOINT_NAME, METRICS_NAME, RUN_NAME, PREEMPTED_NAME, SUMMARY_NAME)
STALE_FILES = (CHECKPOINT_NAME, PREEMPTED_NAME, SUMMARY_NAME)   # replaced by --force
RANK_FILES = "checkpoint.rank-*.pt"      # a stale run's per-rank checkpoint files (--force too)


class RunDirError(ValueError):
    """``--out`` holds a run and neither ``--resume`` nor ``--force`` was given."""


def check_run_dir(run_dir: str | Path, resume: bool, force: bool) -> None:
    """Raise ``RunDirError`` naming ``run_dir``, what it holds and both fixes when it holds a
    run and the command neither resumes nor forces. Reads a few small files; no MPI."""
    run_dir = Path(run_dir)
    check_dir_path(run_dir, "--out", "give --out a directory path (a new one, or a run's)")
    if resume or force:
        return
    what = describe_run(run_dir)
    if what is None:
        return
    raise RunDirError(
        f"{run_dir}: holds {what}; `hpcgnn train` does not start a new run over it. Fix: add "
        f"--resume to continue that run (same config, schedule and shards), or --force to start "
        f"a new run that replaces it (or give another --out directory)")


def check_dir_path(path: Path, flag: str, fix: str) -> None:
    """Raise ``RunDirError`` when ``path`` (an output directory, made if absent) is a file or
    lies under one, so that no rank fails to make it after the start-up agreement."""
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{flag} {path}: exists and is not a directory; {fix}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RunDirError(f"{flag} {path}: {parent} is a file, not a directory; {fix}")
            return


def check_writable(path: Path, flag: str = "--out") -> None:
    """Make ``path`` (and its parents) and create and remove a file in it, on this rank: raise
    ``RunDirError`` naming it, this rank's host and the fix where that fails (a file system
    missing or read-only on this node, no permission, a relative path from another working
    directory), so that the job ends at start-up, on every rank, not at this rank's first write
    after the others entered a collective."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".hpcgnn-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise RunDirError(
            f"{flag} {path}: cannot make or write it on this rank ({exc.strerror or exc}; host "
            f"{socket.gethostname()}, working directory {os.getcwd()}). Fix: give {flag} a "
            f"directory that every rank can write (on a file system mounted on every node, as "
            f"an absolute path where ranks start in other directories)") from exc


def describe_run(run_dir: Path) -> str | None:
    """What ``run_dir`` holds, e.g. 'a run stopped after 30 epochs (checkpoint.pt, ...)'; None
    when it holds no run (absent, empty, or files of other tools only)."""
    found = [name for name in RUN_FILES if (run_dir / name).is_file()]
    if not found:
        return None
    files = ", ".join(found)
    summary = _read_json(run_dir / SUMMARY_NAME)
    if summary is not None and not (run_dir / PREEMPTED_NAME).is_file():
        return f"a finished run ({summary.get('epochs', '?')} epochs; {files})"
    done = _epochs_done(run_dir)
    when = f"after {done} epoch{'s' * (done != 1)}" if done else "before its first epoch ended"
    saved = checkpoint_epochs(run_dir / CHECKPOINT_NAME)
    if saved is not None and saved < done:
        # killed past its last checkpoint: --resume goes on from the checkpoint, not the metrics
        when = (f"after {saved} epoch{'s' * (saved != 1)} as checkpointed (metrics.jsonl "
                f"records {done}; --resume continues from epoch {saved} and drops the "
                f"{done - saved} after it)")
    if (run_dir / PREEMPTED_NAME).is_file():
        return f"a preempted run, stopped {when} ({files})"
    if (run_dir / CHECKPOINT_NAME).is_file():
        return f"a run stopped {when} ({files})"
    return f"a run stopped {when} without a checkpoint ({files})"


def clear_old_run(run_dir: str | Path) -> list[str]:
    """Rank 0, after all ranks agreed to start with ``--force`` and no ``--resume``: remove the
    old run's checkpoint, its rank files (a stale run's), preemption marker and summary (metrics
    and records are rewritten at start). Returns the names removed."""
    removed = []
    for name in STALE_FILES:
        path = Path(run_dir) / name
        if path.is_file():
            path.unlink()
            removed.append(name)
    for path in sorted(Path(run_dir).glob(RANK_FILES)):
        path.unlink()
        removed.append(path.name)
    return removed


def _epochs_done(run_dir: Path) -> int:
    """Epochs finished: preempted.json's count, else the last epoch in metrics.jsonl + 1."""
    marker = _read_json(run_dir / PREEMPTED_NAME)
    if marker and isinstance(marker.get("epochs_done"), int):
        return marker["epochs_done"]
    try:
        lines = (run_dir / METRICS_NAME).read_text().splitlines()
    except (OSError, ValueError):
        return 0
    epochs = [e for e in map(record_epoch, lines) if e is not None]    # a torn line skipped
    return epochs[-1] + 1 if epochs else 0


class _Skeleton(pickle.Unpickler):
    """Reads a ``torch.save`` pickle's plain values (dicts, lists, numbers) without torch: a
    tensor or any other object comes back as a stub, its bytes unread, no code run."""

    class Stub:
        def __init__(self, *args, **kwargs):
            pass

        def __setstate__(self, state):
            pass

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            import collections
            return collections.OrderedDict
        return self.Stub

    def persistent_load(self, pid):
        return None


def checkpoint_epochs(path: Path) -> int | None:
    """The epochs done that ``checkpoint.pt`` holds (what ``--resume`` continues from), read
    without torch (its pickle only, no tensor data); None when absent or unreadable."""
    try:
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.rsplit("/", 1)[-1] == "data.pkl")
            state = _Skeleton(io.BytesIO(z.read(name))).load()
        done = state["progress"]["epochs_done"]
    except Exception:  # noqa: BLE001 (absent, another format, damaged: the metrics decide)
        return None
    return done if isinstance(done, int) else None


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
