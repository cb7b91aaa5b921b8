"""The metrics sink: ``RUN_DIR/metrics.jsonl`` (one JSON line per epoch) and
``RUN_DIR/summary.json``. Only rank 0 writes; every value it writes is already reduced
over ranks.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from hpcgnn.log import get_logger
from hpcgnn.train.writes import atomic_write_text

METRICS_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"


class MetricsSink:
    """Appends epoch records; on resume, drops records of epochs after the checkpoint."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.path = Path(run_dir) / METRICS_NAME
        self.enabled = enabled

    def start(self, keep_epochs_below: int) -> None:
        """Keep only the records with ``epoch < keep_epochs_below`` (0 = start a fresh file)."""
        if not self.enabled:
            return
        kept = []
        if keep_epochs_below > 0 and self.path.is_file():
            for number, line in enumerate(self.path.read_text().splitlines(), 1):
                epoch = record_epoch(line)
                if epoch is None and line.strip():     # e.g. torn by a kill during its write
                    get_logger().warning(
                        "%s: line %d is not an epoch record (torn by a kill?); dropped on resume",
                        self.path, number)
                elif epoch is not None and epoch < keep_epochs_below:
                    kept.append(line)
        atomic_write_text(self.path, "".join(k + "\n" for k in kept))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(strict_json(record) + "\n")
            f.flush()

    def drop_summary(self) -> None:
        """Remove ``summary.json``: the run has epochs left to train (a finished run resumed
        with more ``train.epochs``), so until it finishes again it has no summary."""
        if self.enabled:
            self.path.with_name(SUMMARY_NAME).unlink(missing_ok=True)

    def summary(self, summary: dict) -> None:
        if self.enabled:
            atomic_write_text(self.path.with_name(SUMMARY_NAME), strict_json(summary, indent=2) + "\n")


def strict_json(value, indent: int | None = None) -> str:
    """``value`` as standard JSON: a float that is not finite (a diverged run's loss, its
    validation loss) is written as ``null``; ``json.dumps`` would write ``NaN`` or
    ``Infinity``, which are not JSON and which strict readers (``jq``, JavaScript) refuse."""
    return json.dumps(_finite(value), indent=indent, allow_nan=False)


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def record_epoch(line: str) -> int | None:
    """The record's ``epoch``, or None for a line that is not a whole epoch record."""
    try:
        epoch = json.loads(line)["epoch"]
    except (ValueError, KeyError, TypeError):
        return None
    return epoch if isinstance(epoch, int) else None
