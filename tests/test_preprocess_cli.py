"""The preprocess CLI as users run it: shard sets that verify, and every bad input refused with
one clear message naming the file and the fix, a non-zero exit, and no complete-looking set."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from _graphs import assert_reconstructs, save_npz, unwritable_dir
from hpcgnn.data.datasets import load_dataset
from preprocess.__main__ import main

# Runs preprocess with a file-size limit: "ignore" turns an oversized write into EFBIG (as a
# full disk would fail it); "kill" lets the kernel kill the process mid-write (an interruption).
FSIZE_WRAPPER = """
import resource, runpy, signal, sys
limit, mode = int(sys.argv[1]), sys.argv[2]
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
if mode == "kill":
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
sys.argv = ["preprocess"] + sys.argv[3:]
runpy.run_module("preprocess", run_name="__main__", alter_sys=True)
"""


def run(*args, prefix=("-m", "preprocess")):
    """The CLI in a real process: exit status, stdout, stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *prefix, *map(str, args)], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, env=env)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys):
    """The same CLI entry point, in this process (fast): ``main(argv)`` and what it printed."""
    def call(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return Result(code, out, err)
    return call


def error_line(proc) -> str:
    """The one error message: last stderr line, no traceback."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def assert_no_complete_set(cli, out):
    assert not (out / "meta.json").exists()
    assert cli("verify", out).returncode != 0


@pytest.mark.parametrize("partitioner", ["metis", "random"])
def test_cora_cli_then_verify_in_real_processes(tmp_path, partitioner):
    out = tmp_path / "s"
    proc = run("--dataset", "cora", "--parts", 4, "--partitioner", partitioner, "--out", out,
               "--seed", 3)
    assert proc.returncode == 0, proc.stderr
    assert "part 4/4" in proc.stderr                       # progress on the long steps
    ok = run("verify", out)
    assert ok.returncode == 0 and "4 parts, 2,708 nodes, 10,556 edges" in ok.stdout
    # progress in a batch log: one line per part read, then the checks across parts
    steps = [line.split(" preprocess: ")[1].split(" (")[0] for line in ok.stderr.splitlines()]
    assert [s.split(":")[0] for s in steps] == [f"part {p}/4" for p in range(1, 5)] + \
        ["across parts"], ok.stderr
    assert "checked" in steps[0] and "halo invariant hold" in steps[-1]
    assert run("verify", "-q", out).stderr == ""
    assert_reconstructs(out, load_dataset("cora"))
    bad = run("--dataset", "cora", "--parts", 4, "--out", out)       # exists: refused
    assert bad.returncode == 1 and "--force" in error_line(bad)


def test_help_names_the_subcommands():
    """``--help`` is where a user looks: it names ``verify`` and ``convert``, and says that the
    part count is not the rank count (any R dividing K trains)."""
    proc = run("--help")
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and "preprocess verify DIR" in text and "preprocess convert" in text
    assert "= MPI ranks" not in text and "any R dividing K" in text


def test_synthetic_and_npz_cli(cli, tmp_path):
    spec = "csbm:nodes=500,classes=3,features=4,seed=2"
    assert cli("--dataset", spec, "--parts", 3, "--out", tmp_path / "c", "-q").returncode == 0
    assert cli("verify", tmp_path / "c").returncode == 0
    assert_reconstructs(tmp_path / "c", load_dataset(spec))
    assert cli("--dataset", "rmat:scale=9,edge_factor=4", "--parts", 2, "--out",
               tmp_path / "r", "-q").returncode == 0
    assert cli("verify", tmp_path / "r").returncode == 0
    path = save_npz(tmp_path / "g.npz")
    assert cli("--dataset", f"npz:{path}", "--parts", 2, "--partitioner", "random", "--out",
               tmp_path / "n", "-q").returncode == 0
    assert_reconstructs(tmp_path / "n", load_dataset(f"npz:{path}"))


def test_file_input_log_starts_with_reading(tmp_path):
    """A batch log shows the read of a large input as it starts, not only once it is over."""
    path = save_npz(tmp_path / "g.npz")
    proc = run("--dataset", f"npz:{path}", "--parts", 2, "--out", tmp_path / "s")
    assert proc.returncode == 0, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.endswith(f"preprocess: npz:{path}: reading 0.0 MiB"), proc.stderr


def test_existing_shard_set_needs_force(cli, tmp_path):
    out = tmp_path / "s"
    assert cli("--dataset", "cora", "--parts", 2, "--out", out, "-q").returncode == 0
    before = (out / "meta.json").read_text()
    line = error_line(cli("--dataset", "cora", "--parts", 3, "--out", out, "-q"))
    assert str(out) in line and "already holds shard files" in line and "--force" in line
    assert (out / "meta.json").read_text() == before             # untouched
    assert cli("--dataset", "cora", "--parts", 3, "--out", out, "--force", "-q").returncode == 0
    assert cli("verify", out).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "part-00000.h5",
                                                     "part-00001.h5", "part-00002.h5"]
    assert cli("--dataset", "cora", "--parts", 2, "--out", out, "-q", "--force").returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "part-00000.h5",
                                                     "part-00001.h5"]


@pytest.mark.parametrize("args, expect", [
    (("--dataset", "cora", "--parts", 5000), "more than the 2,708 nodes of cora; choose --parts"),
    (("--dataset", "cora", "--parts", 0), "need at least 1 part"),
    (("--dataset", "npz:/nonexistent/g.npz", "--parts", 2), "/nonexistent/g.npz: no such file"),
    (("--dataset", "csbm:nodes=10,bogus=1", "--parts", 2), "unknown option(s) ['bogus']"),
    (("--dataset", "csbm:nodes=abc", "--parts", 2), "nodes must be an integer >= 1, e.g."),
    (("--dataset", "csbm:classes=0", "--parts", 2), "classes must be an integer >= 2, e.g."),
    (("--dataset", "cora", "--parts", 2, "--partitioner", "spectral"), "invalid choice"),
])
def test_bad_requests(cli, tmp_path, args, expect):
    out = tmp_path / "s"
    try:
        line = error_line(cli(*args, "--out", out))
    except SystemExit as exc:                                     # argparse: usage error
        assert exc.code == 2
        line = expect
    assert expect in line
    assert not out.exists() or not any(out.iterdir())


def test_parts_below_one_is_refused_before_the_input_is_read(tmp_path):
    """``--parts 0`` was refused only after the whole graph was read (its 'reading' line)."""
    path = save_npz(tmp_path / "g.npz")
    proc = run("--dataset", f"npz:{path}", "--parts", 0, "--out", tmp_path / "s")
    assert error_line(proc) == "preprocess: error: --parts 0: need at least 1 part"
    assert "reading" not in proc.stderr, proc.stderr
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("partitioner", ["random", "metis"])
def test_negative_seed_is_a_usage_error_not_a_traceback(tmp_path, partitioner):
    """``--seed -1`` crashed the random partitioner with numpy's ValueError traceback (and
    under mpirun, MPI_ABORT); it is refused by the parser, naming the option and the range."""
    out = tmp_path / "s"
    proc = run("--dataset", "cora", "--parts", 2, "--partitioner", partitioner, "--seed", -1,
               "--out", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--seed: -1 is not an integer >= 0" in proc.stderr.splitlines()[-1]
    assert not out.exists()


def test_bad_npz_through_the_cli(cli, tmp_path):
    path = save_npz(tmp_path / "nan.npz", features=np.full((5, 2), np.nan, np.float32))
    line = error_line(cli("--dataset", f"npz:{path}", "--parts", 2, "--out", tmp_path / "s"))
    assert str(path) in line and "NaN or inf" in line and "replace them" in line
    assert_no_complete_set(cli, tmp_path / "s")


@pytest.mark.parametrize("key", ["features", "adj_indices"])
def test_damaged_npz_member_through_the_cli(tmp_path, key):
    """A byte flipped inside one array of an npz (a bad copy): one error naming the file and
    the key, no traceback (the features' key was read unguarded: BadZipFile traceback)."""
    import zipfile
    path = save_npz(tmp_path / "g.npz", n=400, features=np.ones((400, 50), np.float32))
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(f"{key}.npy")
    data = bytearray(path.read_bytes())
    data[info.header_offset + 30 + len(info.filename) + info.compress_size - 8] ^= 0xFF
    path.write_bytes(data)
    line = error_line(run("--dataset", f"npz:{path}", "--parts", 2, "--out", tmp_path / "s"))
    assert f"{path}: cannot read key '{key}' (Bad CRC-32" in line and "rewrite the file" in line
    assert not (tmp_path / "s").exists()


def test_empty_training_split_through_the_cli(cli, tmp_path, caplog):
    """A graph to predict on: written, with a warning that train will refuse it."""
    path = save_npz(tmp_path / "no-train.npz", train_idx=np.zeros(0, np.int64))
    with caplog.at_level("WARNING", logger="hpcgnn.preprocess"):
        res = cli("--dataset", f"npz:{path}", "--parts", 2, "--out", tmp_path / "s")
    assert res.returncode == 0, res.stderr
    assert "no labelled training node (train_idx is empty): the shard set is one to predict " \
        "on" in caplog.text
    assert cli("verify", tmp_path / "s").returncode == 0


def test_convert_makes_missing_folders_and_refuses_bad_outs(cli, tmp_path):
    out = tmp_path / "new" / "deeper" / "cora.h5"
    res = cli("convert", "--dataset", "cora", "--out", out, "-q")
    assert res.returncode == 0 and f"use --dataset h5:{out}" in res.stdout
    assert load_dataset(f"h5:{out}").num_nodes == 2708
    assert [p.name for p in out.parent.iterdir()] == ["cora.h5"]          # no temporary left
    (tmp_path / "file").write_text("x")
    line = error_line(cli("convert", "--dataset", "cora", "--out", tmp_path / "file" / "a" / "g.h5"))
    assert f"{tmp_path / 'file'}: exists and is not a directory" in line and "choose another --out" in line
    line = error_line(cli("convert", "--dataset", "cora", "--out", tmp_path / "new"))
    assert "is a directory; --out names the .h5 file to write, e.g. --out" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "new"]
    # an existing file (an earlier input, perhaps the one read) is replaced only with --force
    before = out.stat().st_mtime_ns
    line = error_line(cli("convert", "--dataset", "citeseer", "--out", out))
    assert f"{out}: exists; pass --force to replace it" in line
    assert out.stat().st_mtime_ns == before and load_dataset(f"h5:{out}").num_nodes == 2708
    assert cli("convert", "--dataset", "citeseer", "--out", out, "--force", "-q").returncode == 0
    assert load_dataset(f"h5:{out}").num_nodes == 3327


def test_convert_failed_write_leaves_no_file(tmp_path):
    out = tmp_path / "sub" / "cora.h5"
    proc = run(200_000, "ignore", "convert", "--dataset", "cora", "--out", out,
               prefix=("-c", FSIZE_WRAPPER))
    line = error_line(proc)
    assert line.startswith(f"preprocess: error: {out}: write failed") and "no file was left" in line
    assert list(out.parent.iterdir()) == []                      # no file, no temporary


@pytest.fixture
def unwritable(tmp_path):
    return unwritable_dir(tmp_path)


@pytest.mark.parametrize("sub", ["preprocess", "convert"])
def test_unwritable_out_is_refused_before_loading(unwritable, tmp_path, sub):
    """Not after the load and the partitioning (hours on a large graph): the first thing."""
    args = ("convert", "--dataset", "cora", "--out", unwritable / "g.h5") if sub == "convert" \
        else ("--dataset", "cora", "--parts", 2, "--out", unwritable)
    proc = run(*args)
    line = error_line(proc)
    assert "cannot write there" in line and "choose another --out" in line
    assert str(unwritable.parent) in line
    assert "edges in" not in proc.stderr and "METIS" not in proc.stderr       # nothing loaded
    made = tmp_path / "a" / "b" / "s"                          # a writable out: probed, unmade
    proc = run("--dataset", "npz:/nonexistent.npz", "--parts", 2, "--out", made)
    assert "no such file" in error_line(proc) and not (tmp_path / "a").exists()


def test_out_is_a_file(cli, tmp_path):
    (tmp_path / "f").write_text("x")
    assert "is not a directory" in error_line(cli("--dataset", "cora", "--parts", 2, "--out",
                                                  tmp_path / "f"))


def test_failed_write_leaves_no_shard_set(cli, tmp_path):
    out = tmp_path / "s"
    proc = run(2_000_000, "ignore", "--dataset", "cora", "--parts", 2, "--out", out,
               prefix=("-c", FSIZE_WRAPPER))
    line = error_line(proc)
    assert "part-00000.h5: write failed (File too large)" in line and "free disk space" in line
    assert list(out.iterdir()) == []                            # no parts, no temporaries
    assert_no_complete_set(cli, out)


def test_killed_mid_write_leaves_no_complete_set_and_a_rerun_works(cli, tmp_path):
    out = tmp_path / "s"
    proc = run(2_000_000, "kill", "--dataset", "cora", "--parts", 2, "--out", out,
               prefix=("-c", FSIZE_WRAPPER))
    assert proc.returncode != 0
    assert [p.name for p in out.iterdir() if not p.name.startswith(".")] == []
    assert_no_complete_set(cli, out)
    assert cli("--dataset", "cora", "--parts", 2, "--out", out, "-q").returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "part-00000.h5",
                                                     "part-00001.h5"]


@pytest.fixture(scope="module")
def good_set(tmp_path_factory):
    from preprocess import partition_graph, write_shards
    out = tmp_path_factory.mktemp("good") / "s"
    cora = load_dataset("cora")
    write_shards(cora, partition_graph(cora, 3, "metis", 0), out, partitioner="metis", seed=0)
    return out


def damage(good, dst, how):
    import shutil
    shutil.copytree(good, dst)
    part = dst / "part-00001.h5"
    data = bytearray(part.read_bytes())
    if how == "truncate":
        part.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        data[len(data) // 2] ^= 0xFF
        part.write_bytes(data)
    elif how == "delete":
        part.unlink()
    elif how == "meta":
        (dst / "meta.json").unlink()
    elif how == "swap":
        part.rename(dst / "tmp.h5")
        (dst / "part-00002.h5").rename(part)
        (dst / "tmp.h5").rename(dst / "part-00002.h5")
    return dst


@pytest.mark.parametrize("how, expect", [
    ("truncate", "part-00001.h5: sha256 differs from meta.json"),
    ("flip", "part-00001.h5: sha256 differs from meta.json"),
    ("delete", "part-00001.h5: missing"),
    ("meta", "meta.json: missing"),
    ("swap", "part-00001.h5: holds the bytes meta.json gives for part-00002.h5: part files were "
             "swapped or renamed"),
])
def test_verify_rejects_damaged_sets(cli, good_set, tmp_path, how, expect):
    assert cli("verify", good_set).returncode == 0
    line = error_line(cli("verify", damage(good_set, tmp_path / "bad", how)))
    assert expect in line and line.startswith("preprocess verify: error:")


def test_verify_names_every_damaged_part(cli, good_set, tmp_path):
    """Two damaged parts of three: one error line names both (it stopped at the first)."""
    bad = damage(good_set, tmp_path / "bad", "flip")
    (bad / "part-00002.h5").write_bytes((bad / "part-00002.h5").read_bytes()[:1000])
    line = error_line(cli("verify", bad))
    assert "part-00001.h5: sha256 differs" in line and "part-00002.h5: sha256 differs" in line
    assert "part-00000.h5" not in line and "(2 of 3 parts failed the check)" in line
    assert line.count("re-run") <= 1                    # the fix once


def test_verify_exit_status_in_a_real_process(good_set, tmp_path):
    proc = run("verify", damage(good_set, tmp_path / "bad", "truncate"))
    assert proc.returncode == 1 and "sha256 differs" in error_line(proc)
