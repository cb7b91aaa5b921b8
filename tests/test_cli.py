"""The command line and the run config: ``info``, ``summary``, config validation."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _mpi import mpi_family
from hpcgnn.config import ConfigError, load_config


def _run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "hpcgnn", *args], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, **kw)


# what ``info``'s "mpi library" line starts with, for the family of the venv's mpiexec
LIBRARY_NAMES = {"openmpi": ("Open MPI",), "mpich": ("MPICH", "MVAPICH", "Intel(R) MPI")}


def test_info_reports_mpi_cuda_and_torch():
    """The library line names the MPI of the venv's ``mpiexec`` (asked independently, with
    ``mpiexec --version``): Open MPI in the usual venv, MPICH in one made with HPCGNN_MPI=mpich."""
    proc = _run("info")
    assert proc.returncode == 0, proc.stderr
    for word in ("mpi library", "cuda-aware mpi", "torch", "devices"):
        assert word in proc.stdout
    library = next(ln for ln in proc.stdout.splitlines() if "mpi library:" in ln)
    assert library.split(":", 1)[1].strip().startswith(LIBRARY_NAMES[mpi_family()]), library


@pytest.mark.mpi
def test_info_on_several_ranks_prints_the_report_once_and_where_each_rank_runs():
    """``hpcgnn info`` started as a job's ranks are, through jobs/lib/bind.sh with three GPUs
    named: one report (it printed one a rank), then one line per rank with its host, CPUs,
    threads and the GPU bind.sh left it, each a different one of the three."""
    from _mpi import FAMILY_FLAGS, MPIEXEC, REPO, mpi_env
    cmd = [str(MPIEXEC), "-n", "3", *FAMILY_FLAGS[mpi_family()], "bash",
           str(REPO / "jobs" / "lib" / "bind.sh"), sys.executable, "-m", "hpcgnn", "info"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env=mpi_env({"CUDA_VISIBLE_DEVICES": "4,5,6"}))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert sum("mpi library:" in ln for ln in out) == 1 and "      world size: 3" in out, proc.stdout
    ranks = [ln for ln in out if ln.startswith("rank ")]
    assert [ln.split(":")[0] for ln in ranks] == ["rank 0", "rank 1", "rank 2"], proc.stdout
    gpus = sorted(ln.split("CUDA_VISIBLE_DEVICES=")[1].split(",")[0] for ln in ranks)
    assert gpus == ["4", "5", "6"], proc.stdout            # bind.sh: one GPU each, all different
    assert all(" cpus, 1 threads, " in ln and "host " in ln for ln in ranks), proc.stdout
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env=mpi_env({"HPCGNN_CUDA_AWARE": "yes"}))   # a bad value: exit 2, said once
    assert proc.returncode == 2 and not proc.stdout, (proc.stdout, proc.stderr)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: ranks 0-2: HPCGNN_CUDA_AWARE='yes'"), proc.stderr


def test_info_names_each_kind_of_rank_once_past_64_ranks():
    """Past 64 ranks the per-rank lines are grouped by what the ranks run on, naming the hosts'
    count (a job of 16 nodes x 8 GPUs: 8 lines, not 128)."""
    from hpcgnn.__main__ import _rank_lines
    facts = [{"host": f"n{r // 8:02d}", "cpus": "8", "threads": "8", "CUDA_VISIBLE_DEVICES": str(r % 8),
              "devices": "NVIDIA H100"} for r in range(128)]
    lines = _rank_lines(facts)
    assert len(lines) == 8 and lines[0] == ("ranks 0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, "
                                            "104, 112, 120 (16 hosts): 8 cpus, 8 threads, "
                                            "CUDA_VISIBLE_DEVICES=0, devices NVIDIA H100"), lines[0]
    assert _rank_lines(facts[:3])[2] == ("rank 2: host n00, 8 cpus, 8 threads, CUDA_VISIBLE_DEVICES=2, "
                                         "devices NVIDIA H100")


def test_summary_prints_accuracy_and_bytes(tmp_path):
    s = {"test_acc": 0.8123, "final_test_acc": 0.8, "best_val_acc": 0.79, "epochs": 200,
         "bytes_sent": 1234567, "bytes_full": 2345678, "allreduce_bytes": 99, "train_time_s": 3.0,
         "epoch_time_s_median": 0.015, "ranks": 4, "device": "cpu"}
    (tmp_path / "summary.json").write_text(json.dumps(s))
    proc = _run("summary", str(tmp_path))
    assert proc.returncode == 0 and "0.8123" in proc.stdout and "1,234,567" in proc.stdout
    assert "halo bytes" not in proc.stdout                      # no config.toml: algorithm unknown
    (tmp_path / "config.toml").write_text('[parallel]\nalgorithm = "1.5d"\nreplication = 2\n')
    cagnet = _run("summary", str(tmp_path))
    # the label names the backward's collectives too (bytes_sent counts both directions)
    assert ("1.5D bytes exchanged (column broadcasts and reduces, row all-reduces) 1,234,567"
            in cagnet.stdout)
    assert "halo" not in cagnet.stdout
    for alg, rest in (("2d", "row all-gathers and reduce-scatters)"),
                      ("3d", "all-gathers and reduce-scatters along rows and layers)")):
        (tmp_path / "config.toml").write_text(f'[parallel]\nalgorithm = "{alg}"\n')
        out = _run("summary", str(tmp_path)).stdout             # docs/usage.md says what they print
        assert (f"{alg.upper()} bytes exchanged (SUMMA broadcasts, column reduces, {rest} 1,234,567"
                in out and "halo" not in out)
    (tmp_path / "config.toml").write_text('[parallel]\nalgorithm = "halo"\n')
    assert "halo bytes exchanged 1,234,567" in _run("summary", str(tmp_path)).stdout
    assert "peak memory" not in cagnet.stdout                  # a run from before it was recorded
    (tmp_path / "summary.json").write_text(json.dumps({**s, "peak_rss_bytes": 3 * 2**29}))
    assert "peak memory of the largest rank: resident 1,536 MiB" in _run("summary", str(tmp_path)).stdout
    assert "per rank" not in cagnet.stdout                     # a run from before it was recorded
    fig = {"min_rank": 2, "max_rank": 0}
    per_rank = {"from_epoch": 0, "epochs": 200, "compute_s": {**fig, "min": 2.5, "max": 2.75},
                "bytes_sent": {**fig, "min": 1000, "max": 250000, "mean": 9},
                "bytes_received": {**fig, "min": 2000, "max": 125000, "mean": 9}}
    (tmp_path / "summary.json").write_text(json.dumps({**s, "per_rank": per_rank}))
    assert ("per rank: sent 1,000 (rank 2) to 250,000 (rank 0); received 2,000 (rank 2) to "
            "125,000 (rank 0); compute 2.50 s (rank 2) to 2.75 s (rank 0)"
            in _run("summary", str(tmp_path)).stdout)
    missing = _run("summary", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "summary.json: not found" in missing.stderr
    assert "holds no run" in missing.stderr and "metrics.jsonl)" not in missing.stderr
    stopped = tmp_path / "stopped"                  # --stop-after: the fix is --resume, named
    stopped.mkdir()
    (stopped / "metrics.jsonl").write_text('{"epoch": 0}\n{"epoch": 1}\n')
    proc = _run("summary", str(stopped))
    assert proc.returncode == 2 and "a run stopped after 2 epochs without a checkpoint" in proc.stderr
    assert "--force" in proc.stderr and "--resume" not in proc.stderr
    (stopped / "checkpoint.pt").write_bytes(b"")
    proc = _run("summary", str(stopped))
    assert proc.returncode == 2 and f"hpcgnn train --resume --out {stopped}" in proc.stderr
    for torn, why in ((json.dumps(s)[:40], "is unreadable"), (json.dumps({"ranks": 4}), "lacks epochs")):
        (tmp_path / "summary.json").write_text(torn)
        proc = _run("summary", str(tmp_path))
        assert proc.returncode == 2 and why in proc.stderr and "Traceback" not in proc.stderr


def test_summary_into_a_pipe_its_reader_left_ends_without_a_traceback(tmp_path):
    """``hpcgnn summary RUN | head -1``: the reader goes before the lines are written. That was
    a BrokenPipeError traceback, which the docs call a bug; now exit 1, nothing on stderr."""
    (tmp_path / "summary.json").write_text(json.dumps(
        {"test_acc": 0.8, "final_test_acc": 0.8, "best_val_acc": 0.8, "epochs": 2,
         "bytes_sent": 1, "bytes_full": 1, "allreduce_bytes": 1, "train_time_s": 1.0,
         "epoch_time_s_median": 0.5, "ranks": 1, "device": "cpu"}))
    proc = subprocess.Popen([sys.executable, "-m", "hpcgnn", "summary", str(tmp_path)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()                           # long before the interpreter has started
    err = proc.communicate(timeout=60)[1]
    assert (proc.returncode, err) == (1, "")


def test_device_has_help():
    """``--device`` was the one option of train and predict that ``--help`` left unexplained."""
    for cmd in ("train", "predict"):
        text = " ".join(_run(cmd, "--help").stdout.split())
        assert "auto (default): cuda when torch sees a GPU, else cpu" in text, text


def test_stop_after_must_not_be_negative():
    proc = _run("train", "--shards", "x", "--stop-after", "-1")
    assert proc.returncode == 2 and "--stop-after: invalid epoch count (an integer >= 0)" in proc.stderr


def test_reading_a_config_needs_no_torch():
    """``hpcgnn summary`` and ``plot`` read run configs: a second, not a torch import (3-5 s on a
    login node or a 2-core runner)."""
    code = ("import sys; from hpcgnn.config import load_config; load_config('configs/cora.toml'); "
            "print(sorted(m for m in ('torch', 'triton', 'mpi4py') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_a_halo_rank_needs_no_scipy(shards):
    """Every rank of a halo run imports what training needs and builds its operators; scipy is
    not among them (0.2-0.4 s of each rank's start here); CAGNET's modules, which use it, load
    only for a CAGNET algorithm."""
    from conftest import CSBM
    part = shards(CSBM, 2, "random") / "part-00000.h5"
    code = ("import sys; import hpcgnn.train.launch, hpcgnn.train.build; "
            "from hpcgnn.data.shard import read_shard; from hpcgnn.nn.graph import LocalGraph; "
            f"s = read_shard({str(part)!r}); "
            "[LocalGraph.from_shard(s, a) for a in ('gcn', 'sage')]; "
            "print(sorted(m for m in ('scipy', 'hpcgnn.comm.cagnet') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_config_defaults_file_and_overrides(tmp_path):
    cfg = load_config(None)
    assert (cfg.model.arch, cfg.model.hidden, cfg.train.epochs, cfg.run.checkpoint_every) == \
        ("gcn", 16, 200, 0)
    cora = load_config("configs/cora.toml", ["train.epochs=7", "model.arch=sage", "train.lr=1"])
    assert cora.data.normalize_features and cora.train.epochs == 7 and cora.model.arch == "sage"
    assert cora.train.lr == 1.0 and isinstance(cora.train.lr, float)


@pytest.mark.parametrize("text,words", [
    ("[model]\nwidth = 4\n", ["unknown key model.width", "valid keys"]),
    ("[model]\nhiden = 4\n", ["unknown key model.hiden", "did you mean 'model.hidden'?"]),
    ("[model]\nepochs = 4\n", ["unknown key model.epochs", "did you mean 'train.epochs'?"]),
    ("[optim]\nlr = 1\n", ["unknown section [optim]"]),
    ("[trian]\nlr = 1\n", ["unknown section [trian]", "did you mean 'train'?"]),
    ("[model]\nhidden = 'big'\n", ["model.hidden", "must be an integer, e.g. model.hidden = 16"]),
    ("[model]\narch = 1\n", ["model.arch", 'must be a string, e.g. model.arch = "gcn"']),
    ("[train]\nepochs = 0\n", ["train.epochs = 0", ">= 1"]),
    ("[model\n", ["not valid TOML"]),
    ("[train]\nlr = inf\n", ["train.lr = inf", "must be finite"]),
    ("[train]\nweight_decay = inf\n", ["train.weight_decay = inf", "must be finite"]),
    ("[train]\nlr = nan\n", ["train.lr = nan", "must be finite"]),
    ("[train]\nbetas = [0.9, inf]\n", ["train.betas", "must be finite"]),
])
def test_config_errors_name_file_and_key(tmp_path, text, words):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value) and all(w in str(err.value) for w in words)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["epochs=3"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("no/such.toml")
