"""The metrics sink: ``RUN_DIR/metrics.jsonl`` (one JSON line per epoch) and
``RUN_DIR/summary.json``. Only rank 0 writes; every value it writes is already reduced
over ranks.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

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
            for line in self.path.read_text().splitlines():
                if line.strip() and json.loads(line)["epoch"] < keep_epochs_below:
                    kept.append(line)
        _atomic_write(self.path, "".join(k + "\n" for k in kept))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def summary(self, summary: dict) -> None:
        if self.enabled:
            _atomic_write(self.path.with_name(SUMMARY_NAME), json.dumps(summary, indent=2) + "\n")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
