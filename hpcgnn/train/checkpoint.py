"""Checkpoints: one file ``RUN_DIR/checkpoint.pt``, written atomically by rank 0.

Holds the model and optimiser state, the number of finished epochs (which is also the
schedule position and the dropout-key position), the torch RNG state, the running totals of
the metrics, the best-validation bookkeeping and the run record (``hpcgnn.train.records``:
config, schedule, shard-set hash, checked by ``--resume``) — everything ``--resume`` needs so
that 5 epochs + resume + 5 epochs equal 10 epochs.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import torch

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; names the file and the fix."""


def save_checkpoint(run_dir: Path, state: dict) -> Path:
    """Write ``state`` to ``run_dir/checkpoint.pt`` via a temporary file, fsync and rename."""
    path = Path(run_dir) / CHECKPOINT_NAME
    tmp = path.with_name(f".{CHECKPOINT_NAME}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save({"version": CHECKPOINT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_checkpoint_bytes(run_dir: Path) -> bytes | None:
    """The raw checkpoint file, or None when there is none."""
    path = Path(run_dir) / CHECKPOINT_NAME
    return path.read_bytes() if path.is_file() else None


def decode_checkpoint(data: bytes, run_dir: Path) -> dict:
    """Bytes (as read by rank 0 and broadcast) -> the state dict; checks the version."""
    path = Path(run_dir) / CHECKPOINT_NAME
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (torch raises many kinds for a corrupt file)
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc}); delete it and run "
                              f"without --resume to start over") from exc
    if state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}: checkpoint version {state.get('version')!r}, this hpcgnn "
                              f"writes {CHECKPOINT_VERSION}; start over without --resume")
    return state
