"""User errors end the job with a message naming the file/key and the fix, printed once by
rank 0 with the ranks that hit it (no rank left waiting); a rank killed mid-training takes the
job down quickly."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import numpy as np

from _graphs import can_mount_tmpfs, tamper
from _mpi import REPO, mpi_command, mpi_env, run_injected, start_until
from conftest import refused_before_torch, train
from hpcgnn.data.shard import sha256_file

pytestmark = pytest.mark.mpi


def test_shard_count_differs_from_ranks(shards, tmp_path):
    proc = train(2, shards("cora", 3, "metis"), tmp_path, "train.epochs=2", timeout=90)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and errors[0].startswith("[rank 0/2] ERROR ranks 0-1: "), proc.stderr
    assert "meta.json" in errors[0]
    assert "has 3 parts but the job has 2 ranks" in proc.stderr and "mpirun -n R" in proc.stderr
    assert "R dividing 3 (1, 3)" in proc.stderr


def test_corrupt_shard_on_one_rank(shards, tmp_path):
    """A part file changed after meta.json was written, still a readable HDF5 shard (one
    feature value; a truncated file is test_startup_failure's): only its sha256 tells."""
    import h5py
    good = shards("cora", 2, "metis")
    bad = tmp_path / "shards"
    shutil.copytree(good, bad)
    part = bad / "part-00001.h5"
    with h5py.File(part, "r+") as f:
        f["nodes/features"][0, 0] += 1.0
    proc = train(2, bad, tmp_path / "run", "train.epochs=2", timeout=90)
    assert proc.returncode != 0
    assert "[rank 0/2] ERROR rank 1: " in proc.stderr and "part-00001.h5" in proc.stderr
    assert "sha256 differs from meta.json" in proc.stderr
    assert "preprocess" in proc.stderr                                  # the fix
    assert "[rank 0/2] ERROR rank 0: no error; stopping with the others" in proc.stderr
    assert "[rank 1/2]" not in proc.stderr



def test_a_shard_whose_lock_is_refused_names_the_lock_not_a_rewrite(shards, tmp_path):
    """A part file locked by another program (HDF5 takes flock locks; a writer holds an
    exclusive one), or on a file system that refuses locks, fails HDF5's open: the error names
    HDF5_USE_FILE_LOCKING, not a rewrite of the set (which would not help); with locking off
    the same job trains."""
    import fcntl
    directory = tmp_path / "shards"
    shutil.copytree(shards("cora", 2, "metis"), directory)
    with open(directory / "part-00001.h5", "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        proc = train(2, directory, tmp_path / "run", "train.epochs=1", timeout=90)
        assert proc.returncode != 0
        assert "[rank 0/2] ERROR rank 1: " in proc.stderr and "part-00001.h5" in proc.stderr, proc.stderr
        assert "unable to lock file" in proc.stderr and "HDF5_USE_FILE_LOCKING=FALSE" in proc.stderr
        assert "to rewrite the shard set" not in proc.stderr
        proc = train(2, directory, tmp_path / "run2", "train.epochs=1", timeout=90,
                     env={"HDF5_USE_FILE_LOCKING": "FALSE"})
        assert proc.returncode == 0, proc.stderr



# Rank 1 first waits 2 s, so that rank 0's line for epoch 1 is out before the abort: MPICH's
# Hydra kills rank 0 within milliseconds of rank 1's MPI_Abort, and rank 0, still between
# epoch 1's last collective and its log line, lost that line in about 1 run in 4.
RANK_1_FAILS_AT_EPOCH_2 = """\
import time
from mpi4py import MPI
import hpcgnn.train.trainer as trainer
real = trainer.Trainer.run_epoch
def run_epoch(self, epoch):
    if MPI.COMM_WORLD.Get_rank() == 1 and epoch == 2:
        time.sleep(2)
        raise ZeroDivisionError("a bug injected on rank 1")
    return real(self, epoch)
trainer.Trainer.run_epoch = run_epoch
"""


def test_an_exception_on_one_rank_ends_the_job_without_the_mpi4py_runner(shards, tmp_path):
    """``mpiexec python -m hpcgnn`` (no ``-m mpi4py``): an exception escaping on rank 1 at
    epoch 2 (a bug, injected) aborts the job with its traceback; rank 0 waited in the epoch's
    collective until the job's time limit."""
    t0 = time.monotonic()
    proc = run_injected(2, "hpcgnn", RANK_1_FAILS_AT_EPOCH_2, [
        "train", "--shards", shards("cora", 2, "metis"), "--config", "configs/cora.toml",
        "--out", tmp_path / "run", "--set", "train.epochs=50"], timeout=120)
    assert proc.returncode != 0 and time.monotonic() - t0 < 60, proc.stderr
    assert "ZeroDivisionError: a bug injected on rank 1" in proc.stderr
    assert "epoch 1 (2/50)" in proc.stderr and "epoch 2 (3/50)" not in proc.stderr


def test_the_console_scripts_end_the_job_on_an_exception_too(shards, tmp_path):
    """``pip install`` makes ``hpcgnn`` and ``hpcgnn-preprocess`` commands from pyproject's
    ``[project.scripts]``; ``mpiexec -n 2 hpcgnn train ...`` must abort on rank 1's exception as
    ``python -m hpcgnn`` does (the entry pointed at ``main`` itself, past the abort, and hung)."""
    import tomllib
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"hpcgnn", "hpcgnn-preprocess"}
    t0 = time.monotonic()
    proc = run_injected(2, scripts["hpcgnn"], RANK_1_FAILS_AT_EPOCH_2, [
        "train", "--shards", shards("cora", 2, "metis"), "--config", "configs/cora.toml",
        "--out", tmp_path / "run", "--set", "train.epochs=50"], timeout=120)
    assert proc.returncode != 0 and time.monotonic() - t0 < 60, proc.stderr
    assert "ZeroDivisionError: a bug injected on rank 1" in proc.stderr
    fault = ("from mpi4py import MPI\nimport preprocess.__main__ as pm\n"
             "if MPI.COMM_WORLD.Get_rank() == 1:\n"
             "    pm._run_distributed = lambda *a: 1 / 0\n")
    proc = run_injected(2, scripts["hpcgnn-preprocess"], fault, [
        "--dataset", "cora", "--parts", "2", "--partitioner", "random", "--out",
        tmp_path / "set"], timeout=120)
    assert proc.returncode != 0 and "ZeroDivisionError" in proc.stderr, proc.stderr

@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root and unshare -m to mount a small tmpfs")
def test_a_full_disk_at_a_checkpoint_ends_the_job_and_keeps_the_last_one(shards, tmp_path):
    """The run directory on a 400 KiB file system (its own mount namespace): epoch 4's
    checkpoint fits, epoch 9's temporary beside it does not. Every rank stops with exit code
    4 and one error naming checkpoint.pt, the full disk and what is kept (it raised on rank 0
    alone, whose peer then waited in the next collective: a hang without -m mpi4py); no
    temporary is left; with room again, --resume continues from epoch 4 to the end. Then
    predict on a full disk likewise: exit 4, the part named, no part or meta.json in --out."""
    import shlex
    disk = tmp_path / "disk"
    disk.mkdir()
    def command(*extra):
        return shlex.join(mpi_command(2, ["-m", "hpcgnn", "train", "--shards", shards("cora", 2, "metis"),
                                          "--config", "configs/cora.toml", "--out", disk / "run",
                                          "--set", "train.epochs=12", "--set", "run.checkpoint_every=5",
                                          *extra]))
    predict = shlex.join(mpi_command(2, ["-m", "hpcgnn", "predict", "--run", disk / "run", "--shards",
                                         shards("cora", 2, "metis"), "--out", disk / "preds"]))
    script = (f"mount -t tmpfs -o size=400k tmpfs {shlex.quote(str(disk))} || exit 99\n"
              f"{command()} > {tmp_path}/full.log 2>&1; echo $? > {tmp_path}/full.rc\n"
              f"ls -a {disk}/run > {tmp_path}/full.ls\n"
              f"mount -o remount,size=4m {shlex.quote(str(disk))}\n"
              f"{command('--resume')} > {tmp_path}/resume.log 2>&1; echo $? > {tmp_path}/resume.rc\n"
              f"cat {disk}/run/summary.json > {tmp_path}/summary.json\n"
              f"mkdir {disk}/preds && mount -t tmpfs -o size=8k tmpfs {disk}/preds\n"
              f"{predict} > {tmp_path}/predict.log 2>&1; echo $? > {tmp_path}/predict.rc\n"
              f"ls -a {disk}/preds > {tmp_path}/predict.ls\n")
    subprocess.run(["unshare", "-m", "sh", "-c", script], env=mpi_env(), timeout=240, cwd=Path(__file__).parent.parent)
    log = (tmp_path / "full.log").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "4", log
    errors = [ln for ln in log.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and errors[0].startswith("[rank 0/2] ERROR "), log
    assert "checkpoint.pt: cannot write it (No space left on device)" in errors[0]
    assert "free space" in errors[0] and "holds epoch 4" in errors[0] and "--resume" in errors[0]
    assert "Traceback" not in log
    listed = (tmp_path / "full.ls").read_text().split()
    assert "checkpoint.pt" in listed and not [f for f in listed if ".tmp-" in f], listed
    resumed = (tmp_path / "resume.log").read_text()
    assert (tmp_path / "resume.rc").read_text().strip() == "0", resumed
    assert "resumed from" in resumed and "after epoch 4" in resumed
    assert json.loads((tmp_path / "summary.json").read_text())["epochs"] == 12
    log = (tmp_path / "predict.log").read_text()               # predict's parts on a full disk
    assert (tmp_path / "predict.rc").read_text().strip() == "4", log
    assert "part-0000" in log and "(No space left on device)" in log and "run predict again" in log
    assert not [f for f in (tmp_path / "predict.ls").read_text().split() if not f.startswith(".")]

def _edit_meta(directory: Path, change) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    change(meta)
    (directory / "meta.json").write_text(json.dumps(meta))


def _no_training(directory: Path, counted: bool) -> None:
    """Every part's training mask cleared and re-signed; ``counted``: meta.json says num_train
    = 0, else it has no num_train (a set written before it counted them)."""
    for part in (0, 1):
        tamper(directory, part, "nodes/train_mask", np.zeros_like, num_train=0 if counted else None)


def _swap_part_1(directory: Path, other: Path) -> None:
    """Another set's part 1 put in, its sha256 recomputed in meta.json (the counts are not)."""
    shutil.copy(other / "part-00001.h5", directory / "part-00001.h5")
    _edit_meta(directory, lambda m: m["parts"][1].update(sha256=sha256_file(directory / "part-00001.h5")))


# meta.json and part problems: (how, the ERROR line's text (a regex where not refused before
# torch), refused before torch is imported)
SHARD_CASES = {
    "num_parts-string": (lambda d, o: _edit_meta(d, lambda m: m.update(num_parts="2")),
                         "meta.json: field 'num_parts' is '2' (str), expected an integer >= 1; "
                         "meta.json is written by `python -m preprocess`", True),
    "file-null": (lambda d, o: _edit_meta(d, lambda m: m["parts"][1].update(file=None)),
                  "meta.json: field 'parts[1].file' is None (NoneType), expected 'part-00001.h5'",
                  True),
    "no-training": (lambda d, o: _no_training(d, True),
                    "meta.json: the shard set has no labelled training node (its parts' "
                    "num_train sum to 0)", True),
    "no-training-older-meta": (lambda d, o: _no_training(d, False),
                               r"the shard set has no labelled training node \(no part's "
                               r"nodes/train_mask selects a labelled node\)", False),
    "num_classes-too-small": (lambda d, o: _edit_meta(d, lambda m: m.update(num_classes=3)),
                              "nodes/label holds 6, but meta.json says num_classes = 3", False),
    "swapped-part": (_swap_part_1, r"part-00001.h5: holds \d+ for num_(owned|halo|edges), "
                     r"meta.json says \d+ \(a part of another shard set\?\)", False),
}


@pytest.mark.parametrize("case", SHARD_CASES)
def test_bad_meta_or_part_ends_the_job_on_every_rank(shards, tmp_path, case):
    """Refused at start-up with the file, the field and the fix, exit code 2, before any
    exchange: meta.json's fields by type and range (before torch), the training split's size,
    and each loaded part against what meta.json records of it (num_classes too)."""
    import re
    make, want, early = SHARD_CASES[case]
    bad = tmp_path / "shards"
    shutil.copytree(shards("cora", 2, "metis"), bad)
    make(bad, shards("cora", 2, "random"))
    proc = train(2, bad, tmp_path / "run", "train.epochs=2", timeout=90,
                 env={"PYTHONPROFILEIMPORTTIME": "1"} if early else None)
    if early:
        refused_before_torch(proc, 2, want)
        return
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln]
    assert errors and all(re.search(want, ln) for ln in errors if "no error" not in ln), errors
    assert "re-run `python -m preprocess`" in proc.stderr                 # the fix
    if case != "swapped-part":                                            # every rank hits it
        assert "no error; stopping" not in proc.stderr, errors
    assert "finished" not in proc.stderr and not (tmp_path / "run" / "checkpoint.pt").exists()


def test_unknown_config_key_and_bad_value(shards, tmp_path):
    """One rank, no mpiexec (MPI singleton): the same start-up path, cheaper."""
    base = [sys.executable, "-m", "hpcgnn", "train", "--shards", str(shards("cora", 1)),
            "--out", str(tmp_path), "--config", "configs/cora.toml"]
    for sets, words in ((["train.epocs=3"], ["unknown key train.epocs",
                                              "did you mean 'train.epochs'?", "valid keys"]),
                        (["model.dropout=1.5"], ["model.dropout = 1.5", "[0, 1)"]),
                        (["parallel.algorithm=2d", "--schedule",   # refused with the schedule
                          "configs/schedules/quant2-all.toml"],
                         ["configs/cora.toml (with --set overrides): --schedule = ",
                          "parallel.algorithm = '2d' runs uncompressed"])):
        proc = subprocess.run(base + ["--set", *sets], capture_output=True, text=True,
                              timeout=60, stdin=subprocess.DEVNULL, env=mpi_env())
        assert proc.returncode == 2, proc.stderr
        assert all(w in proc.stderr for w in words) and "configs/cora.toml" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_key_its_method_does_not_read_is_refused(shards, tmp_path):
    """``train.smoothing`` corrects stale rows and ``train.rounds_per_layer`` paces RETEXO's
    stages: set for a run without them they changed nothing (the run trained as without
    them). Refused on every rank before torch is imported, naming the config and the fix."""
    from hpcgnn.config import ConfigError, load_config
    proc = train(2, shards("cora", 2), tmp_path / "run", "train.smoothing=0.95",
                 "train.epochs=2", config="configs/cora.toml",
                 env={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=90)
    refused_before_torch(proc, 2, "configs/cora.toml (with --set overrides): train.smoothing = "
                                  "0.95 is not allowed")
    assert "applies with train.staleness >= 1 only; remove it" in proc.stderr
    with pytest.raises(ConfigError, match=r"train.rounds_per_layer = 100 .*'retexo' only"):
        load_config("configs/cora.toml", ["train.rounds_per_layer=100"])
    for sets in (["train.staleness=1", "train.smoothing=0.95"],
                 ["train.method='retexo'", "train.rounds_per_layer=100", "train.epochs=200"]):
        load_config("configs/cora.toml", sets)                       # where they apply


def test_killed_rank_takes_the_job_down(shards, tmp_path):
    args = ["-m", "hpcgnn", "train", "--shards", str(shards("cora", 2, "metis")), "--out",
            str(tmp_path), "--config", "configs/cora.toml", "--set", "train.epochs=100000"]
    metrics = tmp_path / "metrics.jsonl"
    proc = start_until(lambda: subprocess.Popen(
        mpi_command(2, args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=mpi_env()),
        lambda: metrics.is_file() and metrics.read_text().count("\n") >= 2)
    try:
        victim = _rank_pids(proc.pid)[-1]
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 30
    finally:
        proc.kill()
    assert proc.returncode != 0


def _rank_pids(root: int) -> list[int]:
    """PIDs of the python rank processes below ``root`` (walks /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            todo.append(child)
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"hpcgnn" in cmd and b"python" in cmd and b"prterun" not in cmd:
                found.append(child)
    assert found, "no rank processes found"
    return sorted(found)


@pytest.mark.mpi
def test_a_diverged_run_stops_with_its_own_exit_code(shards, tmp_path):
    """A training loss that is not finite ends the run on every rank at that epoch with exit 3
    and one error naming the fix; the checkpoint before it is kept and no summary is written
    (it trained on to the end with NaN weights and 'done', exit 0). metrics.jsonl stays
    standard JSON: the diverged loss (and a validation loss that is not finite) is null (it was
    written as NaN, which is not JSON: jq and JavaScript refuse the file)."""
    import torch
    out = tmp_path / "run"
    proc = train(2, shards("cora", 2), out, "train.lr=1e30", "train.epochs=20",
                 "run.checkpoint_every=1", config="configs/cora.toml")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    log = proc.stdout + proc.stderr
    assert log.count("training diverged") == 1 and "a lower train.lr (now 1e+30)" in log
    assert "continue from the checkpoint with --resume --force" in log
    never = train(1, shards("cora", 2), tmp_path / "none", "train.lr=1e30", "train.epochs=20",
                  config="configs/cora.toml")          # no checkpoint: --resume is no fix
    assert never.returncode == 3 and "no checkpoint was saved before it" in never.stderr
    assert "start again with --force" in never.stderr and "--resume" not in never.stderr

    def not_json(constant):
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    records = [json.loads(line, parse_constant=not_json)
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(len(records))) and len(records) < 20
    assert records[-1]["loss"] is None and all(np.isfinite(r["loss"]) for r in records[:-1])
    assert not (out / "summary.json").exists()
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["progress"]["epochs_done"] == len(records) - 1       # the last finite epoch's
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_an_empty_schedule_or_swapped_files_end_the_job_on_every_rank(shards, tmp_path):
    """An empty --schedule trained VARCO's 128 -> 1 truncation as if the file said so; a run
    config given as --schedule, or a schedule as --config, was refused with a 'did you mean'
    that pointed at a wrong key. Each ends the job on both ranks, one error naming the file
    and the fix, before any exchange, and no checkpoint."""
    empty = tmp_path / "empty.toml"
    empty.write_text("# to be written\n")
    cases = (("configs/cora.toml", empty, f"schedule {empty}: the file sets no key"),
             ("configs/cora.toml", "configs/cora.toml",
              "schedule configs/cora.toml: key 'model': [model] is a run config's section"),
             ("configs/schedules/varco.toml", None, "configs/schedules/varco.toml (with --set "
              "overrides): 'codec' is a key outside any [section]"))
    fixes = ("leave out --schedule", "pass it with --config", "pass it with --schedule")
    for (config, schedule, want), fix in zip(cases, fixes):
        out = tmp_path / f"run-{fix.split()[-1]}"
        extra = ("--schedule", str(schedule)) if schedule else ()
        proc = train(2, shards("cora", 2), out, "train.epochs=2", config=config, extra=extra,
                     timeout=90)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        errors = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln]
        assert len(errors) == 1 and errors[0].startswith("[rank 0/2] ERROR ranks 0-1: "), errors
        assert want in errors[0] and fix in errors[0], errors
        assert not (out / "checkpoint.pt").exists() and not (out / "metrics.jsonl").exists()


def test_varco_on_a_one_layer_model_ends_the_job_on_every_rank(shards, tmp_path):
    """varco.toml keeps the last layer fp32; on a 1-layer model that is every exchange, and the
    run trained with full communication under the VARCO schedule (ratio 1.0 in every record).
    Both ranks end, one error naming the file, the key and the fix, before any exchange."""
    out = tmp_path / "run"
    proc = train(2, shards("cora", 2), out, "train.epochs=2", "model.layers=1",
                 config="configs/cora.toml",
                 extra=("--schedule", "configs/schedules/varco.toml"), timeout=90)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and errors[0].startswith("[rank 0/2] ERROR ranks 0-1: "), errors
    assert ("schedule configs/schedules/varco.toml: key 'compress_last_layer': has no effect on "
            "a 1-layer model") in errors[0] and "fix: set compress_last_layer = true" in errors[0]
    assert not (out / "checkpoint.pt").exists() and not (out / "metrics.jsonl").exists()
