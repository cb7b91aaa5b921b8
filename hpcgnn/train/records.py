"""Run records: what a run directory remembers of how it was started, and the ``--resume`` check.

Written by rank 0 at start (files replaced atomically):
  ``RUN_DIR/config.toml``    the resolved config, every key (``--config`` + ``--set`` + defaults)
  ``RUN_DIR/schedule.toml``  a byte copy of ``--schedule`` (absent without one)
  ``RUN_DIR/run.json``       package version, command lines (one per start), the shard set's path
                             and ``meta.json`` sha256, the schedule's path and sha256
The checkpoint carries the same record (``RunRecord.fingerprint()``), and ``--resume`` tells apart
- keys that do not change the math (``HARMLESS_KEYS``: where the run lives, how often it
  evaluates and checkpoints): a change is accepted, logged, and recorded in ``run.json`` (the
  command's ``changed``);
- everything else (every other config key, the schedule, the shard set): a change is refused,
  naming each key with both values, unless ``--force`` (then recorded as ``forced``).
``train.eval_every`` changes the math of ``train.method = 'retexo'`` (each stage keeps its
best-validation state among the evaluated rounds), so there it is refused like the others.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from hpcgnn import memory
from hpcgnn.comm.settings import CommSettings, hpcgnn_environment
from hpcgnn.config import Config
from hpcgnn.data.shardset import ShardSet
from hpcgnn.train.checkpoint import CheckpointError
from hpcgnn.train.rundir import CONFIG_NAME, RUN_NAME
from hpcgnn.train.writes import atomic_write_text

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

SCHEDULE_NAME = "schedule.toml"
HARMLESS_KEYS = ("run.out", "run.checkpoint_every", "train.eval_every", "comm.transport",
                 "comm.max_message", "comm.progress", "comm.cuda_aware")
"""Config keys a resume may change: none of them changes a loss, a weight or a byte sent (but
for rounding: on 3 or more ranks a ``comm.max_message`` below the gradient buffer's bytes sums
the gradients in pieces, which MPI may add in another order; docs/cluster.md)."""


class ResumeMismatch(CheckpointError):
    """``--resume`` of a run started with other settings; names every key that differs."""


@dataclass(frozen=True)
class RunRecord:
    """How a run was started: resolved config, schedule (parsed and raw), shard set."""

    config: dict
    schedule_path: str | None
    schedule_text: str | None
    shards_path: str
    meta_sha256: str
    changed: tuple[str, ...] = ()   # set on --resume: harmless keys changed (accepted)
    forced: tuple[str, ...] = ()    # set on --resume --force: other differences resumed anyway

    @classmethod
    def make(cls, cfg: Config, schedule_path: str | None, shards: ShardSet) -> "RunRecord":
        """Reads the schedule file (small); the shard set's hash comes from ``shards``."""
        text = Path(schedule_path).read_text() if schedule_path else None
        return cls(cfg.to_dict(), str(schedule_path) if schedule_path else None, text,
                   str(shards.path.resolve()), shards.meta_sha256)

    def fingerprint(self) -> dict:
        """What the checkpoint stores and ``--resume`` compares."""
        return {"config": self.config, "schedule": self.schedule_text,
                "schedule_path": self.schedule_path, "shards": self.shards_path,
                "meta_sha256": self.meta_sha256}

    def write(self, run_dir: Path, resumed: bool, ranks: int = 1) -> None:
        """config.toml, schedule.toml (or none) and run.json in ``run_dir`` (rank 0 only;
        ``ranks``: the job's rank count, recorded with its command)."""
        run_dir = Path(run_dir)
        atomic_write_text(run_dir / CONFIG_NAME, to_toml(self.config))
        if self.schedule_text is not None:
            atomic_write_text(run_dir / SCHEDULE_NAME, self.schedule_text)
        else:
            (run_dir / SCHEDULE_NAME).unlink(missing_ok=True)
        atomic_write_text(run_dir / RUN_NAME,
                      json.dumps(self._run_json(run_dir, resumed, ranks), indent=2) + "\n")

    def _run_json(self, run_dir: Path, resumed: bool, ranks: int) -> dict:
        old = _read_json(run_dir / RUN_NAME) if resumed else {}
        command = {"argv": list(sys.orig_argv), "cwd": os.getcwd(),
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ranks": ranks, "resume": resumed}
        if resumed:
            command.update(changed=list(self.changed), forced=list(self.forced))
        comm = CommSettings.resolve(self.config.get("comm"))
        command.update(environment=hpcgnn_environment(), memory=memory.state(),
                       comm={**asdict(comm), "overridden_by": comm.overridden()})
        sched = None if self.schedule_text is None else {
            "path": self.schedule_path, "sha256": _sha256(self.schedule_text.encode())}
        return {"hpcgnn_version": package_version(), "commands": old.get("commands", []) + [command],
                "shards": {"path": self.shards_path, "meta_sha256": self.meta_sha256},
                "schedule": sched}


def check_resume(saved: dict | None, now: RunRecord, where: Path,
                 force: bool) -> tuple[list[str], list[str]]:
    """(differences that change the math, accepted changes of ``HARMLESS_KEYS``) between a
    checkpoint's record and this start; raises ``ResumeMismatch`` naming the first kind and
    the fix unless ``force`` (then they are returned for a warning)."""
    if saved is None:
        return [], []                 # a checkpoint from before run records: model is checked apart
    diffs, accepted = differences(saved, now.fingerprint()), harmless_changes(saved, now.fingerprint())
    if diffs and not force:
        raise ResumeMismatch(
            f"{where}: --resume refused, this run differs from its checkpoint: " + "; ".join(diffs)
            + f"; fix: resume with the run's own settings ({Path(where).parent / CONFIG_NAME}, "
            f"its schedule and shard set), use another --out for a new run, or add --force to "
            f"resume anyway")
    return diffs, accepted


def harmless_keys(config: dict) -> tuple[str, ...]:
    """The ``HARMLESS_KEYS`` of a run with ``config`` (RETEXO: not ``train.eval_every``)."""
    if config.get("train", {}).get("method") == "retexo":
        return tuple(k for k in HARMLESS_KEYS if k != "train.eval_every")
    return HARMLESS_KEYS


def _config_diffs(saved: dict, now: dict) -> tuple[list[str], list[str]]:
    """(config differences that change the math, those of harmless keys)."""
    # a key the checkpoint's version did not have yet (e.g. model.heads) had its default
    old_config = {**flatten(Config().to_dict()), **flatten(saved["config"])}
    diffs = _diff_flat(old_config, flatten(now["config"]), "")
    harmless = harmless_keys(now["config"])
    return ([d for d in diffs if d.split(":")[0] not in harmless],
            [d for d in diffs if d.split(":")[0] in harmless])


def harmless_changes(saved: dict, now: dict) -> list[str]:
    """``key: checkpoint A, now B`` for every harmless key that changed (accepted)."""
    return _config_diffs(saved, now)[1]


def differences(saved: dict, now: dict) -> list[str]:
    """``key: checkpoint A, now B`` for every config key that changes the math, schedule key
    and shard-set hash."""
    diffs = _config_diffs(saved, now)[0]
    old_s, new_s = saved["schedule"], now["schedule"]
    if (old_s is None) != (new_s is None):
        diffs.append(f"--schedule: checkpoint {saved['schedule_path'] or 'none'}, "
                     f"now {now['schedule_path'] or 'none'}")
    elif old_s is not None:
        diffs += _diff_flat(flatten(tomllib.loads(old_s)), flatten(tomllib.loads(new_s)), "schedule.")
    if saved["meta_sha256"] != now["meta_sha256"]:
        diffs.append(f"shard set meta.json sha256: checkpoint {saved['meta_sha256'][:12]}... "
                     f"({saved['shards']}), now {now['meta_sha256'][:12]}... ({now['shards']})")
    return diffs


def _diff_flat(old: dict, new: dict, prefix: str) -> list[str]:
    missing = "(absent)"
    return [f"{prefix}{k}: checkpoint {old.get(k, missing)!r}, now {new.get(k, missing)!r}"
            for k in sorted(set(old) | set(new)) if old.get(k, missing) != new.get(k, missing)]


def flatten(value, prefix: str = "") -> dict:
    """Nested tables and arrays of tables -> ``{"a.b": v, "phase[0].ratio": v}``."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def to_toml(config: dict) -> str:
    """A config dict of sections of scalars -> TOML text that ``load_config`` reads back."""
    lines = []
    for section, table in config.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(v)}" for key, v in table.items()]
        lines.append("")
    return "\n".join(lines)


def _toml_value(v) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))       # a JSON string is a TOML basic string


def package_version() -> str:
    try:
        return metadata.version("hpcgnn")
    except metadata.PackageNotFoundError:
        return "unknown"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
