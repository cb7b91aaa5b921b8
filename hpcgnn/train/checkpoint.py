"""Checkpoints: ``RUN_DIR/checkpoint.pt``, written atomically by rank 0, and, for a stale run,
one rank file per rank beside it.

``checkpoint.pt`` holds what every rank shares: the model and optimiser state, the number of
finished epochs (which is also the schedule position and the dropout-key position), the torch
RNG state, the running totals of the metrics, the best-validation bookkeeping, the run record
(``hpcgnn.train.records``: config, schedule, shard-set hash, checked by ``--resume``), the rank
count (``ranks``) and the tag of its rank files (``rank_files``; None without staleness) —
everything ``--resume`` needs so that 5 epochs + resume + 5 epochs equal 10 epochs.

**Rank files** (``train.staleness >= 1``): the halo rows and gradients in flight belong to each
rank's own part, so each rank writes its own (``model.stale_state()``, opaque here) to
``checkpoint.rank-RRRRR.TAG.pt`` and reads back only its own: no gather to rank 0, nothing of
another rank loaded. A save writes the rank files (each atomically) under a fresh tag, then
rank 0 replaces ``checkpoint.pt`` naming that tag, then every rank removes its files of older
tags: at any moment ``checkpoint.pt`` names a complete set. Each rank file records its tag,
rank, rank count and epoch, so a file of another checkpoint or rank count is refused, naming
the file. The temporary files of a save cut short by a kill are removed at the next start. A
stale run resumes on its own rank count only (the rows in flight are per part). The run
directory must then be on a file system every rank sees.
"""
from __future__ import annotations

import io
import os
import re
import secrets
from pathlib import Path

import torch

from hpcgnn.train.rundir import CHECKPOINT_NAME
CHECKPOINT_VERSION = 2          # 2: rank count and per-rank stale state (1: stale gathered, read 1)
RANK_FILE = re.compile(r"checkpoint\.rank-(\d{5,})\.([0-9a-f]+)\.pt")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; names the file and the fix."""


def save_checkpoint(run_dir: Path, state: dict) -> Path:
    """Write ``state`` to ``run_dir/checkpoint.pt`` via a temporary file, fsync and rename."""
    path = Path(run_dir) / CHECKPOINT_NAME
    _atomic_save(path, {"version": CHECKPOINT_VERSION, **state})
    return path


def _atomic_save(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# The run directory's files that are written under a temporary name, ``.NAME.tmp-PID``
# (checkpoint.pt and the rank files besides).
WRITTEN_NAMES = ("metrics.jsonl", "summary.json", "config.toml", "run.json", "schedule.toml")
TEMPORARY = re.compile(r"\.(checkpoint.*\.pt|" + "|".join(map(re.escape, WRITTEN_NAMES))
                       + r")\.tmp-\d+")


def remove_temporaries(run_dir: Path) -> list[str]:
    """Rank 0 at start, before any save: remove the temporary files of saves a kill (or an
    abort: a full disk) cut short (``checkpoint.pt``'s, the rank files', the records'); nothing
    reads them, and each kill during a save left one per writing rank. Returns the names
    removed."""
    removed = []
    for path in Path(run_dir).glob(".*.tmp-*"):
        if TEMPORARY.fullmatch(path.name):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def read_checkpoint_bytes(run_dir: Path) -> bytes | None:
    """The raw checkpoint file, or None when there is none."""
    path = Path(run_dir) / CHECKPOINT_NAME
    return path.read_bytes() if path.is_file() else None


RESUME_FIX = ("start the run over with --force instead of --resume (it replaces the run), or "
              "use another --out")


def decode_checkpoint(data: bytes, run_dir: Path, fix: str = RESUME_FIX) -> dict:
    """Bytes (as read by rank 0 and broadcast) -> the state dict; checks the version. ``fix``:
    what the error tells the user to do (the default is ``hpcgnn train --resume``'s)."""
    path = Path(run_dir) / CHECKPOINT_NAME
    state = _load(io.BytesIO(data), path, fix)
    if state.get("version") not in (1, CHECKPOINT_VERSION):
        raise CheckpointError(f"{path}: checkpoint version {state.get('version')!r}, this hpcgnn "
                              f"writes {CHECKPOINT_VERSION}; {fix}")
    return state


def _load(source, path: Path, fix: str = RESUME_FIX) -> dict:
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (torch raises many kinds for a corrupt file)
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc}); {fix}") from exc


# -- rank files (stale runs) ---------------------------------------------------------------------
def new_tag() -> str:
    """A fresh tag for one save's rank files (rank 0 draws it; every rank uses it)."""
    return secrets.token_hex(6)


def rank_file(run_dir: Path, rank: int, tag: str) -> Path:
    return Path(run_dir) / f"checkpoint.rank-{rank:05d}.{tag}.pt"


def save_rank_state(run_dir: Path, rank: int, ranks: int, tag: str, epochs_done: int,
                    state) -> Path:
    """This rank's own state (opaque) to its rank file of ``tag``, atomically."""
    path = rank_file(run_dir, rank, tag)
    _atomic_save(path, {"version": CHECKPOINT_VERSION, "tag": tag, "rank": rank, "ranks": ranks,
                        "epochs_done": epochs_done, "state": state})
    return path


def load_rank_state(run_dir: Path, rank: int, ranks: int, head: dict):
    """This rank's state from the rank file ``head`` (the decoded ``checkpoint.pt``) names;
    raises ``CheckpointError`` with the reason and the fix when there is none for this rank
    count, or the file belongs to another checkpoint."""
    where = Path(run_dir) / CHECKPOINT_NAME
    tag, saved = head.get("rank_files"), int(head.get("ranks", 0))
    if tag is None:
        raise CheckpointError(
            f"{where}: holds no per-rank stale state (written by a run without train.staleness, "
            f"or by an older hpcgnn), but this run is stale; resume it with the run's own "
            f"config, or start a new run (another --out, no --resume)")
    if saved != ranks:
        raise CheckpointError(
            f"{where}: this stale run (train.staleness >= 1) was checkpointed on {saved} ranks "
            f"and cannot resume on {ranks}: the halo rows and gradients in flight belong to "
            f"each rank's own part; resume with `mpirun -n {saved}`, or start a new run on "
            f"{ranks} ranks (another --out, no --resume)")
    path = rank_file(run_dir, rank, tag)
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; {CHECKPOINT_NAME} names rank files '{tag}' for {saved} ranks (a "
            f"deleted file, or a run directory that not every rank sees); restore it, or start "
            f"the run over with --force instead of --resume")
    data = _load(path, path)
    got = [data.get(k) for k in ("version", "tag", "rank", "ranks", "epochs_done")]
    want = [CHECKPOINT_VERSION, tag, rank, ranks, int(head["progress"]["epochs_done"])]
    if got != want:
        raise CheckpointError(
            f"{path}: belongs to another checkpoint (version, tag, rank, ranks, epochs {got}; "
            f"{CHECKPOINT_NAME} wants {want}): a mixed set; restore the run directory's "
            f"files together, or start the run over with --force instead of --resume")
    return data["state"]


def prune_rank_files(run_dir: Path, rank: int, ranks: int, keep: str) -> None:
    """Remove this rank's rank files of tags other than ``keep``; rank 0 also removes those of
    ranks ``>= ranks`` (left by a run on more ranks). Call it once ``checkpoint.pt`` names
    ``keep``."""
    for path in Path(run_dir).glob("checkpoint.rank-*.pt"):
        m = RANK_FILE.fullmatch(path.name)
        if m is None:
            continue
        r, tag = int(m.group(1)), m.group(2)
        if (r == rank and tag != keep) or (rank == 0 and r >= ranks):
            path.unlink(missing_ok=True)
