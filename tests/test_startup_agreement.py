"""Ranks started with different inputs end the job at start-up, before any exchange, naming what
differs between which ranks (``hpcgnn.train.agreement``); the same shard set at another path
(a node-local copy) and per-rank settings that change nothing (logging) are accepted.

Each job launches real ranks through a small wrapper that adds arguments or environment on one
rank only, the way a per-node wrapper script or a stale node-local copy does on a cluster.
Without the agreement these cases hang (``train.epochs``, ``HPCGNN_EXCHANGE``), crash
(``MPI_ERR_TRUNCATE`` on another shard set) or train a silently mixed model (``train.lr``).
"""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from _mpi import REPO, run_mpi

pytestmark = pytest.mark.mpi

WRAPPER = '''
import json, os, runpy, sys
rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or "0"
mine = json.loads(os.environ["TEST_PER_RANK"]).get(rank, {})
os.environ.update(mine.get("env", {}))
if "host" in mine:                    # a rank on another node, as far as hpcgnn can tell
    import socket
    socket.gethostname = lambda: mine["host"]
os.chdir(mine.get("cwd", "."))
sys.path[:0] = mine.get("path", [])
args = [a.replace(*mine["swap"]) if "swap" in mine else a for a in json.loads(os.environ["TEST_ARGS"])]
sys.argv = ["hpcgnn"] + args + mine.get("args", [])
runpy.run_module("hpcgnn", run_name="__main__")
'''
LIMIT_S = 90          # a hang fails the test (TimeoutExpired); a clean refusal takes seconds


def launch(tmp_path, ranks: int, args: list[str], per_rank: dict) -> subprocess.CompletedProcess:
    wrapper = tmp_path / "per_rank.py"
    wrapper.write_text(WRAPPER)
    env = {"TEST_ARGS": json.dumps([str(a) for a in args]), "TEST_PER_RANK": json.dumps(per_rank)}
    try:
        return run_mpi(ranks, [wrapper], timeout=LIMIT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job hung (> {LIMIT_S} s) with per-rank inputs {per_rank}")


def train_args(shard_dir, out, *sets):
    args = ["train", "--shards", shard_dir, "--out", out, "--config", "configs/cora.toml"]
    for s in ("train.epochs=2",) + sets:
        args += ["--set", s]
    return args


@pytest.mark.parametrize("case", ["lr", "epochs", "exchange", "shards", "code"])
def test_ranks_with_different_inputs_are_refused_before_any_exchange(shards, tmp_path, case):
    run, ranks = tmp_path / "run", 2 if case in ("shards", "code") else 3
    mine, other = shards("cora", ranks), shards("cora", ranks, "random")
    if case == "code":                  # rank 1 imports another install of the same version
        shutil.copytree(REPO / "hpcgnn", tmp_path / "other" / "hpcgnn",
                        ignore=shutil.ignore_patterns("__pycache__"))
        with open(tmp_path / "other" / "hpcgnn" / "log.py", "a") as f:
            f.write("# a node's older or patched copy\n")
    per_rank = {"lr": {"1": {"args": ["--set", "train.lr=0.1"]}},
                "epochs": {"2": {"args": ["--set", "train.epochs=3"]}},
                "exchange": {"1": {"env": {"HPCGNN_EXCHANGE": "neighbor"}}},
                "shards": {"1": {"swap": [str(mine), str(other)]}},
                "code": {"1": {"path": [str(tmp_path / "other")]}}}[case]
    expect = {"lr": "config train.lr: ranks 0, 2 0.01; rank 1 0.1",
              "epochs": "config train.epochs: ranks 0-1 2; rank 2 3",
              "exchange": "environment HPCGNN_EXCHANGE: ranks 0, 2 (unset); rank 1 neighbor",
              "shards": "rank 1 sha256 ",
              "code": "hpcgnn version: rank 0 "}[case]
    proc = launch(tmp_path, ranks, train_args(mine, run), per_rank)
    assert proc.returncode == 2, proc.stderr
    assert "the ranks were started with different inputs; nothing was exchanged" in proc.stderr
    assert expect in proc.stderr, proc.stderr
    if case == "shards":
        assert "shard set meta.json: rank 0 sha256 " in proc.stderr and str(other) in proc.stderr
    if case == "code":                  # one line, the source digests apart
        assert proc.stderr.count("(source sha256 ") == 2 and "(1 difference)" in proc.stderr
    assert "fix: start every rank with the same" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run / "checkpoint.pt").exists() and not (run / "run.json").exists()


def test_a_copy_of_the_shard_set_elsewhere_and_local_settings_are_accepted(shards, tmp_path):
    """Rank 1 reads a node-local copy of the same shard set and logs on every rank: both are
    the same inputs, so the job trains. Rank 0 runs on a node whose hpcgnn install lacks the
    built C kernels and has no C compiler (``CC=false``, an empty cache): it trains on the torch
    path and says so once, naming its host, why and the fix (before: nothing was said, and the
    node's ranks paced the job unnoticed)."""
    import socket
    src = shards("cora", 2)
    copy = tmp_path / "node-local"
    shutil.copytree(src, copy)
    shutil.copytree(REPO / "hpcgnn", tmp_path / "bare" / "hpcgnn",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    per_rank = {"0": {"path": [str(tmp_path / "bare")],
                      "env": {"CC": "false", "XDG_CACHE_HOME": str(tmp_path / "cache")}},
                "1": {"swap": [str(src), str(copy)], "env": {"HPCGNN_LOG_ALL_RANKS": "1"}}}
    proc = launch(tmp_path, 2, train_args(src, tmp_path / "run"), per_rank)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "summary.json").is_file()
    said = [ln for ln in proc.stderr.splitlines() if "no C kernels" in ln]
    assert len(said) == 1 and said[0].startswith(f"[rank 0/2] WARNING no C kernels on host "
                                                 f"{socket.gethostname()} ("), proc.stderr
    assert "cannot build it" in said[0] and "a C compiler on this node" in said[0]


def test_a_device_failure_on_some_ranks_is_said_on_every_rank(shards, tmp_path):
    """Ranks 1 and 2 alone ask for a GPU they cannot get (nodes whose GPUs are hidden or
    missing): every rank, not only those, logs which ranks on which host failed and why, once,
    with the fix, and the job ends with the user-error exit code, before any exchange and
    without a hang. (Before: the failing ranks alone said it and the launcher killed the others
    with nothing logged.)"""
    import socket
    run = tmp_path / "run"
    cuda = {"args": ["--device", "cuda"]}
    proc = launch(tmp_path, 3, train_args(shards("cora", 3), run), {"1": cuda, "2": cuda})
    assert proc.returncode == 2, proc.stderr
    host = socket.gethostname()
    for rank in range(3):
        line = next((ln for ln in proc.stderr.splitlines()
                     if ln.startswith(f"[rank {rank}/3] ERROR ")), None)
        assert line is not None, f"rank {rank} said nothing:\n{proc.stderr}"
        assert f"ranks 1-2 (host {host}): device 'cuda' asked for, but " in line, line
        assert line.count("device 'cuda' asked for") == 1, line         # one message, once
        assert "or use --device cpu" in line, line                      # the fix
        assert "no device on 2 of 3 ranks; nothing was exchanged" in line, line
    assert "Traceback" not in proc.stderr
    assert not (run / "checkpoint.pt").exists() and not (run / "run.json").exists()


def test_a_run_directory_one_rank_cannot_write_ends_the_job_at_start_up(shards, tmp_path):
    """A relative --out that rank 1 cannot create (its node's working directory is elsewhere,
    here on sysfs, where even root makes no directory): refused at start-up, before any
    exchange, naming the directory, the rank's host and the fix, with exit code 2. (Before: the
    ranks agreed to start, rank 1's ``mkdir`` raised in ``Trainer.start`` after the first
    collectives, and the job aborted with a traceback on that rank alone.)"""
    import os
    try:
        os.mkdir("/sys/hpcgnn-test")
        os.rmdir("/sys/hpcgnn-test")
        pytest.skip("/sys accepts a new directory here")
    except OSError:
        pass
    args = train_args(shards("cora", 2), "run")
    args[args.index("configs/cora.toml")] = str(REPO / "configs" / "cora.toml")
    proc = launch(tmp_path, 2, args, {"0": {"cwd": str(tmp_path)},
                                      "1": {"cwd": "/sys", "host": "node-b"}})
    assert proc.returncode == 2, proc.stderr
    head = "[rank 0/2] ERROR rank 1 (host node-b): --out run: cannot make or write it on this rank "
    assert head in proc.stderr, proc.stderr
    assert "; host node-b, working directory /sys). Fix: give --out " in proc.stderr
    assert "[rank 0/2] ERROR rank 0: no error; stopping with the others" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "run.json").exists()


def test_a_part_file_one_node_cannot_read_names_the_rank_and_its_host(shards, tmp_path):
    """Rank 1, on another host (faked: its ``socket.gethostname``), reads a node-local copy of
    the shard set whose part is truncated, after torch is imported: the job ends at start-up,
    before any exchange, with exit code 2, and rank 0's line names the rank, its host, the file
    and the fix (before: ``rank 1: ...``, no host, so a user of a multi-node job had to find the
    node). Where every rank fails alike, or all run on one host, no host is named."""
    src = shards("cora", 2)
    copy = tmp_path / "node-b-copy"
    shutil.copytree(src, copy)
    part = copy / "part-00001.h5"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    proc = launch(tmp_path, 2, train_args(src, tmp_path / "run"),
                  {"1": {"swap": [str(src), str(copy)], "host": "node-b"}})
    assert proc.returncode == 2, proc.stderr
    line = next((ln for ln in proc.stderr.splitlines()
                 if ln.startswith("[rank 0/2] ERROR rank 1 (host node-b): ")), "")
    assert str(part) in line and "preprocess" in line, proc.stderr          # the file, the fix
    assert "[rank 0/2] ERROR rank 0: no error; stopping with the others" in proc.stderr
    assert "Traceback" not in proc.stderr
    # every rank fails alike (a bad key, on both hosts): the ranks, no host
    proc = launch(tmp_path, 2, train_args(src, tmp_path / "run", "model.hiden=8"),
                  {"1": {"host": "node-b"}})
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and errors[0].startswith("[rank 0/2] ERROR ranks 0-1: ") and \
        "did you mean 'model.hidden'?" in errors[0] and "host" not in errors[0], proc.stderr


MIXED = '''
import socket, sys, torch
from hpcgnn.comm import gpu
from hpcgnn.comm.context import CommContext
from hpcgnn.log import get_logger, setup_logging
from hpcgnn.train.early import device_mix
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
on_gpu = rank < 2                     # ranks 0-1 on a GPU node, rank 2 on a node without GPUs
socket.gethostname = lambda: "gpu01" if on_gpu else "cpu07"
real = gpu.pick_device
gpu.pick_device = lambda local, want="auto": (torch.device("cuda", local) if on_gpu and want == "auto"
                                              else real(local, want))
ctx = CommContext.from_world("auto")
setup_logging(ctx.rank, ctx.size)
same = MPI.COMM_WORLD.allgather(ctx.mixed_devices)
assert all(m == same[0] for m in same), same
print(f"rank {rank} {ctx.device.type} mixed={list(ctx.mixed_devices)}", flush=True)
line = device_mix(ctx.mixed_devices)
if line and ctx.is_root:
    get_logger().warning("%s", line)
alike = CommContext.from_world("cpu")             # every rank on the CPU: nothing to say
assert alike.mixed_devices == () and device_mix(alike.mixed_devices) is None
'''


def test_device_auto_with_gpu_and_cpu_ranks_is_agreed_and_said_once(tmp_path):
    """``--device auto`` on an allocation where one node has no GPU: ranks 0-1 take a GPU
    (faked: ``pick_device``, no GPU here; the rest of ``CommContext.from_world``, its
    Allreduce and gather, is real), rank 2 the CPU. Every rank gets the same (host, device)
    list from the start-up agreement, and rank 0 alone warns once, naming the counts, the CPU
    rank and its host, and the fix; ranks all on the CPU say nothing. (Before: nothing said,
    and the CPU rank paced the job unnoticed.) Whether a mixed job trains to the same result
    needs a GPU: not checked here."""
    script = tmp_path / "mixed.py"
    script.write_text(MIXED)
    proc = run_mpi(3, [script], timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stderr
    want = "[('gpu01', 'cuda'), ('gpu01', 'cuda'), ('cpu07', 'cpu')]"
    for rank, kind in ((0, "cuda"), (1, "cuda"), (2, "cpu")):
        assert f"rank {rank} {kind} mixed={want}" in proc.stdout, proc.stdout
    warnings = [ln for ln in proc.stderr.splitlines() if " WARNING " in ln]
    assert len(warnings) == 1 and warnings[0].startswith("[rank 0/3] WARNING --device auto put "
                                                         "2 of 3 ranks on a GPU and 1 on the CPU "
                                                         "(rank 2 (host cpu07): "), proc.stderr
    assert "--gpus-per-task=1" in warnings[0] and "--device cpu" in warnings[0]
