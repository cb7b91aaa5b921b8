"""User errors end the job with a message naming the file/key and the fix, printed once by
rank 0 with the ranks that hit it (no rank left waiting); a rank killed mid-training takes the
job down quickly."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _mpi import mpi_command, mpi_env
from conftest import train

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
    good = shards("cora", 2, "metis")
    bad = tmp_path / "shards"
    shutil.copytree(good, bad)
    part = bad / "part-00001.h5"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    proc = train(2, bad, tmp_path / "run", "train.epochs=2", timeout=90)
    assert proc.returncode != 0
    assert "[rank 0/2] ERROR rank 1: " in proc.stderr and "part-00001.h5" in proc.stderr
    assert "preprocess" in proc.stderr                                  # the fix
    assert "[rank 0/2] ERROR rank 0: no error; stopping with the others" in proc.stderr
    assert "[rank 1/2]" not in proc.stderr


def test_unknown_config_key_and_bad_value(shards, tmp_path):
    """One rank, no mpiexec (MPI singleton): the same start-up path, cheaper."""
    base = [sys.executable, "-m", "hpcgnn", "train", "--shards", str(shards("cora", 1)),
            "--out", str(tmp_path), "--config", "configs/cora.toml"]
    for sets, words in ((["train.epocs=3"], ["unknown key train.epocs",
                                              "did you mean 'train.epochs'?", "valid keys"]),
                        (["model.dropout=1.5"], ["model.dropout = 1.5", "[0, 1)"])):
        proc = subprocess.run(base + ["--set", sets[0]], capture_output=True, text=True,
                              timeout=60, stdin=subprocess.DEVNULL, env=mpi_env())
        assert proc.returncode == 2, proc.stderr
        assert all(w in proc.stderr for w in words) and "configs/cora.toml" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_killed_rank_takes_the_job_down(shards, tmp_path):
    args = ["-m", "hpcgnn", "train", "--shards", str(shards("cora", 2, "metis")), "--out",
            str(tmp_path), "--config", "configs/cora.toml", "--set", "train.epochs=100000"]
    proc = subprocess.Popen(mpi_command(2, args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=mpi_env())
    try:
        metrics = tmp_path / "metrics.jsonl"
        end = time.monotonic() + 90
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < end and proc.poll() is None, "training did not start"
            time.sleep(0.1)
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
