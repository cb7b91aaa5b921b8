"""``bench/network.py``'s accounting: what ``auto`` spends outside the training step (its start
before epoch 0, each check's reductions and decision) counts in its time to accuracy, and the
median step stays the step alone. On a hand-written run directory; the sweep itself needs an
idle machine and is not a test."""
import importlib.util
import json
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_network", Path(__file__).resolve().parents[1] / "bench" / "network.py")
network = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(network)


def _run_dir(tmp_path: Path, rows: list[dict]) -> Path:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps(
        {"bytes_sent": 10, "bytes_full": 40, "test_acc": 0.8, "best_val_acc": 0.7}))
    return tmp_path


def _row(epoch: int, step: float, val: float | None = None, **extra) -> dict:
    row = {"epoch": epoch, "epoch_s": step, "wall_s": step + 0.5, "eval_s": 0.5, "comm_s": 0.0,
           "codec_s": 0.0, "bytes_sent": 10, **extra}
    return row if val is None else {**row, "val_acc": val, "test_acc": val}


def test_auto_start_and_check_seconds_count_in_time_to_accuracy(tmp_path):
    rows = [_row(0, 1.0, auto={"seconds": 0.25, "start": {"seconds": 2.0}}),
            _row(1, 1.0), _row(2, 3.0, 0.6), _row(3, 1.0, 0.7, auto={"seconds": 0.5})]
    res = network.summarise(_run_dir(tmp_path, rows))
    assert res["epoch_s"] == 1.0                                # the median of steps 1-3 alone
    assert res["train_s"] == pytest.approx(6.0 + 2.0 + 0.25 + 0.5)
    assert res["train_wall_s"] == pytest.approx(8.0 + 2.0 + 0.25 + 0.5)
    # validation first reaches 0.7 at epoch 3: every second up to and including that check
    assert network.time_to(res["curve"], 0.7) == pytest.approx(8.75)
    assert network.time_to(res["curve"], 0.7, wall=True) == pytest.approx(10.75)


def test_a_schedule_without_auto_is_its_steps_alone(tmp_path):
    res = network.summarise(_run_dir(tmp_path, [_row(0, 1.0), _row(1, 2.0, 0.7)]))
    assert res["train_s"] == pytest.approx(3.0) and network.time_to(res["curve"], 0.7) == 3.0


def test_a_stale_runs_wire_is_its_steps_bytes_not_epoch_0s(tmp_path):
    """A stale run's epoch 0 also sends the first layer's input rows, once (fp32); the median
    step is of epochs 1 on, so the wire time set against it is of their bytes: a step's bytes
    x 8 / rate, not the mean over every epoch."""
    steady = 1_541_736                                     # a Sylvie step, 4 ranks, cSBM 20k
    rows = [_row(0, 0.14, bytes_sent=steady + 28_962_612)] + \
           [_row(e, 0.05, bytes_sent=steady) for e in range(1, 40)]
    res = network.summarise(_run_dir(tmp_path, rows))
    assert res["bytes_per_step"] == steady
    assert res["bytes_per_epoch"] == pytest.approx(steady + 28_962_612 / 40)
    assert network.wire_s(res, "1") == pytest.approx(steady * 8 / 1e9)
    assert network.wire_s(res, "shm") is None
    # results from before bytes_per_step: the mean, as then
    old = {k: v for k, v in res.items() if k != "bytes_per_step"}
    assert network.wire_s(old, "0.5") == pytest.approx(res["bytes_per_epoch"] * 8 / 0.5e9)
    two = network.summarise(_run_dir(tmp_path, rows[:2]))         # epoch 0 is not a step's
    assert two["bytes_per_step"] == steady and two["epoch_s"] == 0.05


@pytest.mark.parametrize("variant, rate, want", [
    ("unlimited", "5", ("", "none")),
    ("eager+unlimited", "2", ("eager", "none")),
    ("eager", "2", ("eager", "2")),
    ("", "shm", ("", "shm")),
])
def test_an_unlimited_run_is_the_same_tcp_loopback_without_the_rate(variant, rate, want):
    """``SCHEDULE~unlimited``: no token bucket (``behind_link`` with ``none``), the other parts
    of the variant kept; it needs the TCP loopback, so on shared memory it is refused."""
    assert network.unlimited_variant(variant, rate) == want
    assert network.unlimited_of("full@s1") == "full@s1~unlimited"
    assert network.unlimited_of("full@s1~eager") == "full@s1~eager+unlimited"
    assert network.is_unlimited("full@s1~eager+unlimited") and not network.is_unlimited("full@s1")
    with pytest.raises(SystemExit, match="unlimited needs a TCP link"):
        network.unlimited_variant("unlimited", "shm")


@pytest.mark.parametrize("variant, burst, want", [
    ("", "1mb", ("", "1mb")),
    ("burst128kb", "1mb", ("", "128kb")),
    ("fine+burst64kb+sysmalloc", "1mb", ("fine+sysmalloc", "64kb")),
    ("ompi", "2mb", ("ompi", "2mb")),
])
def test_a_run_variant_may_name_the_token_bucket(variant, burst, want):
    """``SCHEDULE~burstSIZE`` sets the link's bucket for that run alone; the other parts of the
    variant are left for the progress and allocation settings."""
    assert network.link_variant(variant, burst) == want
    assert network.progress_variant(want[0])[0] == (
        ["--set", "comm.progress=fine"] if "fine" in variant else [])


@pytest.mark.mpi
@pytest.mark.slow
def test_a_failed_run_is_named_and_the_rest_of_the_sweep_runs(tmp_path):
    """A run that fails (here: a schedule with no file; on a GPU machine, a link emulation its
    kernel lacks) is reported and skipped. The runs after it still run and are summarised, the
    exit status names the failure, and no partial file is left behind. It stopped the whole
    sweep with a traceback and wrote no results at all."""
    import os
    import subprocess
    import sys
    out = tmp_path / "net"
    env = {**os.environ, **network.MPI_ENV}
    proc = subprocess.run(
        [sys.executable, str(Path(network.__file__)), "--dataset",
         "csbm:nodes=300,classes=3,degree=4,features=8,seed=1", "--ranks", "2", "--rates", "shm",
         "--schedules", "no-such-schedule", "full", "--epochs", "2", "--eval-every", "1",
         "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "1 run(s) failed" in proc.stderr and "2|shm|no-such-schedule" in proc.stderr
    assert "ranks 2 link shm no-such-schedule: FAILED, skipped" in proc.stdout
    saved = json.loads(out.with_name("net.json").read_text())
    assert list(saved["results"]) == ["2|shm|full"] and saved["failed"] == ["2|shm|no-such-schedule"]
    assert saved["results"]["2|shm|full"]["bytes_ratio"] == 1.0
    assert (out.with_name("net.md")).is_file() and not out.with_name("net.partial.json").exists()
