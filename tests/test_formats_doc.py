"""``docs/formats.md`` against the files a real job writes: the keys of ``metrics.jsonl``,
``summary.json``, ``checkpoint.pt``, ``run.json``, the shard set's ``meta.json`` and part files,
and the predictions, as the page lists them (its tables' first column, its ``run.json`` example,
its sentences that name attributes and keys), must be the keys the files hold: none written but
undocumented, none documented but never written (and ``slurm.jsonl``, from ``jobs/lib/train.sh``'s
own function, against the page's example). The runs: 2 ranks of Cora, a VARCO schedule
with evaluation every other epoch, RETEXO, ``kind = "auto"``, then ``predict``, in one MPI job.
A test on a doctored copy of the page shows that a missing and an invented key are each caught.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from conftest import check_ok, read_metrics, run_together

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "formats.md"
TICKS = re.compile(r"`([^`]+)`")


def sections(text: str) -> dict[str, list[str]]:
    """``{heading text: its lines}`` for every ``##``/``###`` heading of the page."""
    out: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            current = out.setdefault(line.lstrip("#").strip(), [])
        else:
            current.append(line)
    return out


def table(lines: list[str]) -> dict[str, str]:
    """``{name: meaning}`` of a section's table: every backticked name of a row's first column
    (``parts[i]`` -> ``parts``), with the row's last column."""
    out = {}
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 2 or set(cells[0]) <= set("-: "):
            continue
        for name in TICKS.findall(cells[0]):
            out[re.sub(r"\[\w+\]$", "", name)] = cells[-1]
    return out


def named_after(lines: list[str], lead: str, stop: str = ".") -> list[str]:
    """The backticked names of the paragraph text from ``lead`` to the next ``stop``."""
    text = " ".join(lines)
    start = text.index(lead) + len(lead)
    return [n.split()[0] for n in TICKS.findall(text[start:text.index(stop, start)])]


def json_example(lines: list[str]) -> dict:
    text = "\n".join(lines)
    return json.loads(text[text.index("```json") + 7:text.index("```", text.index("```json") + 7)])


def part_example(lines: list[str]) -> dict:
    """The first ``parts`` entry of the shard ``meta.json`` example (the example as a whole
    ends its list with ``...``, not JSON)."""
    text = " ".join(lines)
    start = text.index('{"file"')
    return json.loads(text[start:text.index("}", start) + 1])


def key_tree(value, path: str = "") -> set[str]:
    """Every key path of a JSON value (lists: their first element's, as ``path[]``)."""
    if isinstance(value, dict):
        return {k for key, v in value.items() for k in {path + key} | key_tree(v, f"{path}{key}.")}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return key_tree(value[0], path[:-1] + "[].")
    return set()


def page_keys(text: str) -> dict[str, object]:
    """What the page documents, per file."""
    s = sections(text)
    metrics = table(s["`metrics.jsonl`"])
    return {
        "metrics": set(metrics),
        "metrics_eval_only": {k for k, v in metrics.items() if "evaluated epochs only" in v},
        "metrics_only": {k for k, v in metrics.items() if re.search(r"`[\w.]+ = [^`]+` only", v)},
        "summary": set(table(s["`summary.json`"])),
        "summary_retexo": set(named_after(s["`summary.json`"], "A RETEXO run adds", ":")),
        "summary_stage": set(named_after(s["`summary.json`"], "per stage,", ".")),
        "checkpoint": set(table(s["`checkpoint.pt`"])),
        "run_json": key_tree(json_example(s["`run.json`"])),
        "shard_meta": set(table(s["`meta.json`"])),
        "shard_part": set(part_example(s["`meta.json`"])),
        "part_h5": set(table(s["`part-NNNNN.h5`"])),
        "part_attrs": set(named_after(s["`part-NNNNN.h5`"], "Attributes:", ". ")),
        "pred_h5": set(table(s["Predictions"])),
        "pred_attrs": set(named_after(s["Predictions"], "`PRED_DIR/part-NNNNN.h5` (attributes", ":")),
        "pred_meta": set(named_after(s["Predictions"], "`PRED_DIR/meta.json`:", ". ")),
        "slurm": set(json_example(s["The run directory"])),
    }


def test_the_page_parses_into_every_list():
    """The parser finds every list (a renamed heading or table must not pass silently)."""
    keys = page_keys(PAGE.read_text())
    for name, found in keys.items():
        assert found, f"{name}: nothing found on {PAGE}"
    assert {"loss", "bytes_sent", "test_acc", "epoch_s"} <= keys["metrics"]
    assert {"val_loss", "eval_bytes"} <= keys["metrics_eval_only"]
    assert "stage" in keys["metrics_only"] and "nodes/train_mask" in keys["part_h5"]


def problems(doc: dict, real: dict) -> list[str]:
    """Every difference between the page's lists and the files' keys."""
    found = []

    def compare(what: str, documented: set, written: set) -> None:
        found.extend(f"{what}: {k} written, not on the page" for k in sorted(written - documented))
        found.extend(f"{what}: {k} on the page, never written" for k in sorted(documented - written))

    conditional = doc["metrics_only"]
    compare("metrics.jsonl (plain run)", doc["metrics"] - conditional, real["metrics_plain"])
    compare("metrics.jsonl (not evaluated)", doc["metrics"] - conditional - doc["metrics_eval_only"],
            real["metrics_not_evaluated"])
    compare("metrics.jsonl (all runs)", doc["metrics"], real["metrics_all"])
    compare("summary.json", doc["summary"] - {"peak_device_bytes"}, real["summary_plain"])  # GPU only
    compare("summary.json (RETEXO)", doc["summary"] - {"peak_device_bytes"} | doc["summary_retexo"],
            real["summary_retexo"])
    compare("summary.json stages[]", doc["summary_stage"], real["summary_stage"])
    compare("checkpoint.pt", doc["checkpoint"] - {"retexo"}, real["checkpoint_plain"])
    compare("checkpoint.pt (RETEXO)", doc["checkpoint"], real["checkpoint_retexo"])
    compare("run.json", doc["run_json"], real["run_json"])
    compare("shard meta.json", doc["shard_meta"], real["shard_meta"])
    compare("shard meta.json parts[]", doc["shard_part"], real["shard_part"])
    compare("part file datasets", doc["part_h5"], real["part_h5"])
    compare("part file attributes", doc["part_attrs"], real["part_attrs"])
    compare("prediction datasets", doc["pred_h5"], real["pred_h5"])
    compare("prediction attributes", doc["pred_attrs"], real["pred_attrs"])
    compare("prediction meta.json", doc["pred_meta"], real["pred_meta"])
    compare("slurm.jsonl", doc["slurm"], real["slurm"])
    return found


@pytest.fixture(scope="module")
def written(shards, tmp_path_factory) -> dict:
    """The keys of every file a 2-rank job of Cora writes."""
    import torch
    shard_dir = shards("cora", 2)
    work = tmp_path_factory.mktemp("formats")
    runs = {"plain": ("configs/cora.toml", ["--schedule", "configs/schedules/varco.toml",
                                            "--set", "train.epochs=4", "--set", "train.eval_every=2"]),
            "retexo": ("configs/retexo.toml", ["--set", "train.epochs=4",
                                               "--set", "train.rounds_per_layer=2"]),
            "auto": ("configs/cora.toml", ["--schedule", "configs/schedules/auto.toml",
                                           "--set", "train.epochs=2"])}
    commands = [(["train", "--shards", shard_dir, "--config", cfg, "--out", work / name, *extra], {})
                for name, (cfg, extra) in runs.items()]
    commands.append((["predict", "--run", work / "plain", "--shards", shard_dir,
                      "--out", work / "pred"], {}))
    for proc in run_together(2, commands, work / "jobs", timeout=300):
        check_ok(proc)
    metrics = {name: read_metrics(work / name) for name in runs}
    summary = {name: json.loads((work / name / "summary.json").read_text()) for name in runs}
    ckpt = {name: torch.load(work / name / "checkpoint.pt", weights_only=True) for name in runs}
    with h5py.File(shard_dir / "part-00000.h5") as f:
        part_h5, part_attrs = set(_datasets(f)), set(f.attrs)
    with h5py.File(work / "pred" / "part-00000.h5") as f:
        pred_h5, pred_attrs = set(_datasets(f)), set(f.attrs)
    shard_meta = json.loads((shard_dir / "meta.json").read_text())
    plain = metrics["plain"]
    return {
        "metrics_plain": set().union(*plain),
        "metrics_not_evaluated": set().union(*(r for r in plain if r["epoch"] % 2 == 0)),
        "metrics_all": set().union(*(r for m in metrics.values() for r in m)),
        "summary_plain": set(summary["plain"]),
        "summary_retexo": set(summary["retexo"]),
        "summary_stage": set().union(*summary["retexo"]["stages"]),
        "checkpoint_plain": set(ckpt["plain"]),
        "checkpoint_retexo": set(ckpt["retexo"]),
        "run_json": key_tree(json.loads((work / "retexo" / "run.json").read_text())),  # no schedule
        "shard_meta": set(shard_meta),
        "shard_part": set(shard_meta["parts"][0]),
        "part_h5": part_h5, "part_attrs": part_attrs,
        "pred_h5": pred_h5, "pred_attrs": pred_attrs,
        "pred_meta": set(json.loads((work / "pred" / "meta.json").read_text())),
        "slurm": set(json.loads(slurm_segment(work / "slurm").splitlines()[0])),
    }


def slurm_segment(run_dir: Path) -> str:
    """``RUN_DIR/slurm.jsonl`` as ``jobs/train.sbatch`` appends it (its own shell function,
    with this venv's python first on PATH, outside a job: SLURM's variables unset)."""
    run_dir.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", f"source jobs/lib/train.sh && LAUNCH=(srun) && "
                    f"hpcgnn_record_segment {run_dir} 0"], cwd=REPO, env=env, check=True, timeout=60)
    return (run_dir / "slurm.jsonl").read_text()


def _datasets(f: h5py.File) -> list[str]:
    names: list[str] = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


@pytest.mark.mpi
def test_the_page_lists_every_key_the_files_hold(written):
    assert problems(page_keys(PAGE.read_text()), written) == []


@pytest.mark.mpi
def test_a_doctored_page_is_caught(written):
    """A key dropped from a table and a key the files never hold are both reported."""
    text = PAGE.read_text()
    doctored = text.replace("| `codec_s` |", "| `codec_seconds` |", 1)
    assert doctored != text
    found = problems(page_keys(doctored), written)
    assert "metrics.jsonl (plain run): codec_s written, not on the page" in found
    assert "metrics.jsonl (plain run): codec_seconds on the page, never written" in found


def test_the_shard_set_examples_are_cora_in_4_parts(shards):
    """The page's ``meta.json`` example and ``run.json``'s ``meta_sha256`` are those of
    ``make demo``'s shard set (Cora, 4 METIS parts, seed 0), as preprocessing writes it today:
    its values, its first part's entry, and the sha256 prefixes."""
    import hashlib
    s = sections(PAGE.read_text())
    meta_path = shards("cora", 4) / "meta.json"
    meta = json.loads(meta_path.read_text())
    text = "\n".join(s["`meta.json`"])
    head = text[text.index("```json") + 7:text.index('"parts"')].rstrip().rstrip(",") + "}"
    assert json.loads(head) == {k: v for k, v in meta.items() if k != "parts"}
    part = part_example(s["`meta.json`"])
    assert meta["parts"][0]["sha256"].startswith(part.pop("sha256").rstrip("."))
    assert part == {k: v for k, v in meta["parts"][0].items() if k != "sha256"}
    shown = json_example(s["`run.json`"])["shards"]["meta_sha256"].rstrip(".")
    assert hashlib.sha256(meta_path.read_bytes()).hexdigest().startswith(shown)
