"""Distributed preprocessing (``mpirun -n P python -m mpi4py -m preprocess --partitioner
{ptscotch,random}``) on real ranks, P = 1..4, K != P included:

* the set verifies and holds exactly the input: the edge set, rebuilt in this file with scipy
  from the raw (directed, self-looped, duplicated) input, features, labels and masks;
* a sliced generator (``rmat-sliced:``) made by the ranks gives the one-process graph, any P;
* a graph of fewer nodes than ranks (a rank whose slice holds no row), 2 and 3 parts, both
  partitioners;
* PT-Scotch's edge cut is within 1.3x of one-process METIS on the same graph;
* training on a 2-part PT-Scotch set (made on 3 ranks) on 2 ranks gives the 1-rank losses of the one-process set;
* every bad request ends on every rank with the file and the fix, and leaves no meta.json.

PT-Scotch comes from Debian's libptscotch-dev: the session fixture installs it with apt when it
is missing and the tests run as root or in CI; elsewhere the PT-Scotch tests skip and say why.
One launch per rank count runs several preprocessings (this file is also the MPI worker).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import scipy.sparse as sp

from conftest import CSBM, check_ok, read_metrics, run_mpi, train, train_here
from _graphs import assert_reconstructs, can_mount_tmpfs, reconstruct
from _mpi import LIBMPI, mpi_family, other_mpi_of
from hpcgnn.data.datasets import load_dataset

N_MESSY = 500
GEN = "rmat-sliced:scale=9,edge_factor=8,seed=5"
DEB_LIB = "/usr/lib/x86_64-linux-gnu/libptscotch.so"


def _have_ptscotch() -> bool:
    from preprocess.ptscotch import PtScotchError, _find_library
    try:
        _find_library()
        return True
    except PtScotchError:
        return False


@pytest.fixture(scope="session")
def ptscotch():
    """PT-Scotch installed (apt-get as root or in CI when missing), else skip with the reason."""
    if _have_ptscotch():
        return
    if not (os.geteuid() == 0 or os.environ.get("CI") == "true") or not shutil.which("apt-get"):
        pytest.skip("PT-Scotch not installed (apt-get install libptscotch-dev, or set "
                    "HPCGNN_PTSCOTCH_LIB); installed automatically only as root or with CI=true")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "libptscotch-dev"]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                             stdin=subprocess.DEVNULL)
        if res.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    assert _have_ptscotch()


@pytest.fixture(scope="session")
def ptscotch_same_mpi(ptscotch):
    """PT-Scotch linked against the venv's MPI, else skip: preprocessing refuses a PT-Scotch of
    another MPI (``test_bad_requests_fail_on_every_rank`` checks that), e.g. Debian's (Open
    MPI's libmpi.so.40) in a venv made with HPCGNN_MPI=mpich."""
    from preprocess.ptscotch import _find_library
    path = os.path.realpath(_find_library())
    other = other_mpi_of(path)
    if other is not None:
        pytest.skip(f"{path} is linked against {other}, not the venv's MPI "
                    f"({LIBMPI[mpi_family()]}); set HPCGNN_PTSCOTCH_LIB to a PT-Scotch built "
                    f"with the venv's MPI")


def messy_h5(path: Path) -> dict:
    """An h5 input with a directed edge list holding self-loops and duplicates; returns the
    raw arrays."""
    rng = np.random.default_rng(7)
    m = 4 * N_MESSY
    dst = rng.integers(0, N_MESSY, m)
    src = np.where(rng.random(m) < 0.8, (dst + rng.integers(-6, 7, m)) % N_MESSY,
                   rng.integers(0, N_MESSY, m))
    dst, src = np.concatenate([dst, dst[:40], np.arange(30)]), np.concatenate([src, src[:40], np.arange(30)])
    order = np.argsort(dst, kind="stable")
    raw = {"num_nodes": np.int64(N_MESSY), "adj_indices": src[order].astype(np.int64),
           "adj_indptr": np.concatenate([[0], np.cumsum(np.bincount(dst, minlength=N_MESSY))]),
           "features": rng.standard_normal((N_MESSY, 5)).astype(np.float32),
           "labels": rng.integers(-1, 3, N_MESSY), "train_idx": np.arange(0, N_MESSY, 4),
           "val_idx": np.arange(1, N_MESSY, 4), "test_idx": np.arange(2, N_MESSY, 4)}
    raw["labels"][raw["train_idx"]] %= 3            # training nodes labelled (the reader checks)
    with h5py.File(path, "w") as f:
        for k, v in raw.items():
            f[k] = v
    return raw


def tiny_h5(path: Path, pair: bool = False) -> dict:
    """An h5 input of 3 nodes, fewer than the 4 ranks of the widest launch (rank 0's slice
    ``0*3/4 .. 1*3/4`` holds no row): a duplicated edge, a self-loop, a one-way edge; with
    ``pair``, one edge 0 <- 1 and node 2 isolated (PT-Scotch 7.0.3 leaves one of 3 parts empty
    on 2 and 4 ranks)."""
    edges = ([1], [0, 1, 1, 1]) if pair else ([1, 1, 1, 0], [0, 2, 3, 4])
    raw = {"num_nodes": np.int64(3), "adj_indices": np.array(edges[0], dtype=np.int64),
           "adj_indptr": np.array(edges[1], dtype=np.int64),
           "features": np.arange(15, dtype=np.float32).reshape(3, 5) - 7,
           "labels": np.array([0, 1, 0]), "train_idx": np.array([0]), "val_idx": np.array([1]),
           "test_idx": np.array([2])}
    with h5py.File(path, "w") as f:
        for k, v in raw.items():
            f[k] = v
    return raw


def expected_edges(raw: dict, symmetrize: bool) -> np.ndarray:
    """Sorted keys dst * N + src of the cleaned input, by scipy (independent of the code)."""
    n = int(raw["num_nodes"])
    a = sp.csr_matrix((np.ones(len(raw["adj_indices"])), raw["adj_indices"], raw["adj_indptr"]),
                      shape=(n, n))
    a = (a + a.T) if symmetrize else a
    a = a.tolil()
    a.setdiag(0)
    a = a.tocoo()
    keep = a.data != 0
    return np.sort(a.row[keep].astype(np.int64) * n + a.col[keep])


def check_set(directory: Path, raw: dict, symmetrize: bool) -> dict:
    """``verify`` accepts the set, and it holds exactly the raw input (cleaned)."""
    res = subprocess.run([sys.executable, "-m", "preprocess", "verify", str(directory)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    got = reconstruct(directory)
    np.testing.assert_array_equal(got["edges"], expected_edges(raw, symmetrize))
    np.testing.assert_array_equal(got["features"], raw["features"])
    np.testing.assert_array_equal(got["label"], raw["labels"])
    for name in ("train", "val", "test"):
        np.testing.assert_array_equal(np.flatnonzero(got[f"{name}_mask"]), raw[f"{name}_idx"])
    n = int(raw["num_nodes"])
    deg = np.bincount(got["edges"] // n, minlength=n)
    np.testing.assert_array_equal(got["degree"], deg)
    return json.loads((directory / "meta.json").read_text())


# (P, K of the PT-Scotch run, K of the random run)
LAUNCHES = [(1, 3, 2), (2, 2, 3), (3, 5, 4), (4, 3, 4)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist-in")
    raw = messy_h5(root / "messy.h5")
    tiny_h5(root / "tiny.h5")
    tiny_h5(root / "pair.h5", pair=True)
    res = subprocess.run([sys.executable, "-m", "preprocess", "convert", "--dataset", CSBM,
                          "--out", str(root / "csbm.h5")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return root, raw


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,k_scotch,k_random", LAUNCHES,
                         ids=[f"P{p}-K{k}" for p, k, _ in LAUNCHES])
def test_distributed_sets_verify_and_reconstruct(ranks, k_scotch, k_random, ptscotch_same_mpi, inputs,
                                                 shards, tmp_path):
    root, raw = inputs
    env = {"HPCGNN_A2A_ROUND_BYTES": "4096"} if ranks == 3 else None   # many Alltoallv rounds
    proc = run_mpi(ranks, [__file__, "run", str(root), str(tmp_path), k_scotch, k_random],
                   timeout=120, env=env)
    check_ok(proc)
    meta = check_set(tmp_path / "scotch", raw, symmetrize=True)
    assert meta["partitioner"] == "ptscotch" and meta["num_parts"] == k_scotch
    assert all(p["num_owned"] > 0 for p in meta["parts"])
    meta = check_set(tmp_path / "random", raw, symmetrize=False)
    sizes = [p["num_owned"] for p in meta["parts"]]
    assert meta["num_parts"] == k_random and max(sizes) - min(sizes) <= 1
    # same graph, PT-Scotch across the ranks vs one-process METIS
    cut = json.loads((tmp_path / "csbm" / "meta.json").read_text())["edge_cut"]
    metis = json.loads((shards(CSBM, 4) / "meta.json").read_text())["edge_cut"]
    assert 0 < cut <= 1.3 * metis, (cut, metis)
    # a sliced generator: each rank made its rows; the set is the one-process graph, for any P
    assert_reconstructs(tmp_path / "gen", load_dataset(GEN))
    # 3 nodes: on 4 ranks rank 0 reads no row
    tiny = tiny_h5(tmp_path / "tiny-raw.h5")
    pair = tiny_h5(tmp_path / "pair-raw.h5", pair=True)
    empty_sets = 0
    for name, symmetrize, k in (("tiny-scotch", True, 2), ("tiny-random", False, 2),
                                ("tiny-scotch3", False, 3), ("tiny-random3", False, 3),
                                ("pair-scotch3", False, 3)):
        meta = check_set(tmp_path / name, pair if name.startswith("pair") else tiny, symmetrize)
        sizes = sorted(p["num_owned"] for p in meta["parts"])
        assert meta["num_parts"] == k and sum(sizes) == 3, (name, sizes)
        if name.startswith("tiny-random"):                # balanced; PT-Scotch may leave a part empty
            assert sizes == ([1, 2] if k == 2 else [1, 1, 1]), (name, sizes)
        empty_sets += 0 in sizes
    # an empty part is warned of, as METIS's are (PT-Scotch's were written without a word)
    assert proc.stderr.count("PT-Scotch left part(s) [") == empty_sets, proc.stderr


@pytest.mark.mpi
def test_training_on_ptscotch_set_gives_single_rank_losses(ptscotch_same_mpi, inputs, shards, tmp_path):
    root, _ = inputs
    proc = run_mpi(3, ["-m", "preprocess", "--dataset", f"h5:{root / 'csbm.h5'}", "--parts", 2,
                       "--partitioner", "ptscotch", "--out", tmp_path / "set", "-q"], timeout=60)
    check_ok(proc)
    sets = ("train.epochs=4", "model.arch=gcn")
    check_ok(train(2, tmp_path / "set", tmp_path / "run2", *sets))
    want = train_here(shards(CSBM, 1), tmp_path / "run1", *sets, config=None)
    got = read_metrics(tmp_path / "run2")
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), g["epoch"]
    assert all(r["bytes_sent"] > 0 for r in got)


@pytest.mark.mpi
def test_bad_requests_fail_on_every_rank(ptscotch, inputs, tmp_path):
    root, _ = inputs
    # a PT-Scotch of the other MPI family: Debian's under MPICH, one that wants MPICH's
    # libmpi.so.12 under Open MPI (the sonames have the same length)
    ours = LIBMPI[mpi_family()]
    other = next(s for s in LIBMPI.values() if s != ours)
    fake = tmp_path / "libptscotch-other-mpi.so"
    lib = Path(os.path.realpath(DEB_LIB)) if Path(DEB_LIB).exists() else None
    if lib is not None:
        fake.write_bytes(lib.read_bytes().replace(ours.encode() + b"\0", other.encode() + b"\0"))
    (tmp_path / "junk.h5").write_text("not hdf5")
    (tmp_path / "g.graph").write_text("3 2\n2\n1 3\n2\n")
    proc = run_mpi(2, [__file__, "errors", str(root), str(tmp_path), str(fake if lib else "")],
                   timeout=90)
    check_ok(proc)
    lines = proc.stdout.splitlines()
    want = {"missing": "no such file; pass --dataset h5:PATH",
            "junk": "not a readable HDF5 file",
            "parts0": "--parts 0: need at least 1 part",
            "toomany": "is more than the 3,000 nodes",
            "nolib": "HPCGNN_PTSCOTCH_LIB=/nonexistent/libptscotch.so: no such file",
            "othermpi": f"is linked against {other}, but mpi4py runs on",
            # a traceback (int('1GiB')), and a round past MPI's C int counts
            "round1g": "HPCGNN_A2A_ROUND_BYTES='1GiB': expected the bytes per rank of one "
                       "Alltoallv round, an integer in [1, 2147483647]",
            "round3g": "HPCGNN_A2A_ROUND_BYTES='3000000000': expected the bytes per rank",
            # read whole, labelled over the whole graph: refused, with the way through h5:
            "metisgraph": f"g.graph,classes=3: a METIS graph file is not read by row slices "
                          f"(its text is read whole, and its stand-in labels follow the whole "
                          f"graph), so the distributed path does not take it: convert it once "
                          f"in one process (python -m preprocess convert --dataset "
                          f"metis-graph:{tmp_path / 'g.graph'},classes=3 --out "
                          f"{tmp_path / 'g.h5'}) and pass --dataset h5:{tmp_path / 'g.h5'}"}
    if lib is None:
        del want["othermpi"]
    for case, text in want.items():
        got = [ln for ln in lines if ln.startswith(f"{case} ")]
        assert len(got) == 2, (case, proc.stdout)            # both ranks
        assert all("rc=1" in ln and text in ln for ln in got), got
        assert not (tmp_path / case / "meta.json").exists()


@pytest.mark.mpi
def test_unwritable_out_is_refused_on_every_rank_before_reading(tmp_path):
    """Not after the read, the partitioning and the halo maps (hours on a large graph)."""
    from _graphs import unwritable_dir
    out = unwritable_dir(tmp_path)
    proc = run_mpi(2, ["-m", "preprocess", "--dataset", "cora", "--parts", "4",
                       "--partitioner", "random", "--out", str(out)], timeout=90)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("preprocess: error")]
    assert len(lines) == 2, proc.stderr                                           # both ranks
    assert all(f"{out.parent}: cannot write there" in ln and "choose another --out" in ln
               for ln in lines), lines
    assert "rank 0: rows" not in proc.stderr and "edges in" not in proc.stderr    # nothing read


@pytest.mark.mpi
@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root and unshare -m to mount a tmpfs")
def test_an_out_one_rank_cannot_see_is_refused_on_every_rank_before_reading(tmp_path):
    """A multi-node job with a node-local --out, imitated: rank 1 runs in its own mount
    namespace with an empty tmpfs over the folder of --out. Each rank writes its own parts, so
    rank 1's write failed after the partitioning ('write failed (No such file or directory);
    check that the directory is writable'); now every rank stops first, naming the rank that
    cannot see the folder and the fix, and nothing is left on rank 0's side."""
    import shlex
    from _mpi import FAMILY_FLAGS, MPIEXEC, mpi_env, mpi_family
    local = tmp_path / "local"
    local.mkdir()
    out = local / "out"
    run = shlex.join([sys.executable, "-m", "mpi4py", "-m", "preprocess", "--dataset", "cora",
                      "--parts", "4", "--partitioner", "random", "--out", str(out)])
    hidden = f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(str(local))} && exec {run}"
    script = (f'if [ "${{OMPI_COMM_WORLD_RANK:-$PMI_RANK}}" = 1 ]; then '
              f'exec unshare -m sh -c {shlex.quote(hidden)}; fi; exec {run}')
    launch = [str(MPIEXEC), "-n", "2", *FAMILY_FLAGS[mpi_family()], "sh", "-c", script]
    proc = subprocess.run(launch, capture_output=True, text=True, timeout=120, env=mpi_env(),
                          stdin=subprocess.DEVNULL, cwd=str(Path(__file__).parent.parent))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("preprocess: error")]
    assert len(lines) == 2, proc.stderr                                           # both ranks
    assert all(f"{out}: rank(s) 1 of 2 do not see the folder rank 0 writes to ({local})" in ln
               and "a file system all the job's nodes share" in ln for ln in lines), lines
    assert "rank 0: rows" not in proc.stderr                                      # nothing read
    assert list(local.iterdir()) == []                                            # probe removed


@pytest.mark.mpi
def test_an_exception_on_one_rank_ends_the_job_without_the_mpi4py_runner(tmp_path):
    """``mpiexec python -m preprocess`` (no ``-m mpi4py``): a bug on rank 1 as it writes its
    parts (injected) aborts the job with its traceback instead of leaving rank 0 waiting."""
    from _mpi import run_injected
    fault = ("from mpi4py import MPI\nimport preprocess.dist_run as d\nreal = d._write_own\n"
             "def write_own(*a):\n"
             "    if MPI.COMM_WORLD.Get_rank() == 1: raise ZeroDivisionError('a bug on rank 1')\n"
             "    return real(*a)\n"
             "d._write_own = write_own\n")
    proc = run_injected(2, "preprocess", fault, ["--dataset", "cora", "--parts", "4", "--partitioner",
                                                 "random", "--out", tmp_path / "out"], timeout=120)
    assert proc.returncode != 0 and "ZeroDivisionError: a bug on rank 1" in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "meta.json").exists()


@pytest.mark.mpi
@pytest.mark.parametrize("spec, parts, want", [
    ("rmat-sliced:scale=10", "2000", "--parts 2000 is more than the 1,024 nodes; choose --parts"),
    ("h5:{h5}", "6", "--parts 6 is more than the 5 nodes; choose --parts <= 5"),
    ("rmat-sliced:scale=10", "0", "--parts 0: need at least 1 part")])
def test_parts_are_checked_before_the_input_is_read(tmp_path, spec, parts, want):
    """A --parts the graph cannot take is refused as soon as the node count is known (an h5
    file's num_nodes, a generator's options), before any rank reads or generates its slice and
    exchanges edges: reading is made to fail here, and the refusal comes first."""
    from _graphs import save_h5
    from _mpi import run_injected
    spec = spec.format(h5=save_h5(tmp_path / "g.h5"))
    fault = ("import preprocess.dist_run as d\n"
             "def read_slice(*a):\n"
             "    raise ZeroDivisionError('the input was read')\n"
             "d.read_slice = read_slice\n")
    proc = run_injected(2, "preprocess", fault, ["--dataset", spec, "--parts", parts,
                                                 "--partitioner", "ptscotch", "--out",
                                                 tmp_path / "out"], timeout=120)
    assert proc.returncode != 0 and "the input was read" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("preprocess: error")]
    # --parts 0 is refused before MPI starts, by each rank on its own: the launcher may end the
    # other rank, once the first has exited with 1, before it prints (seen once in 4 CI runs)
    assert len(lines) == 2 or (parts == "0" and len(lines) == 1), proc.stderr    # both ranks
    assert all(want in ln for ln in lines), proc.stderr


@pytest.mark.mpi
def test_bad_h5_input_is_refused_on_every_rank_naming_the_input(tmp_path):
    """The npz reader's checks run on each rank's slice of an h5 input: a NaN feature is
    reported with the input file and its dataset (not the part file it would have gone to),
    an unlabelled training node and a 2-D (multi-label) label array likewise, on both ranks,
    with the rank whose rows hold a bad row (rank 0 printed the same words without it, as if its
    own rows were at fault), and nothing is written."""
    from _graphs import save_h5
    feats = np.arange(10, dtype=np.float32).reshape(5, 2)
    feats[3, 1] = np.nan
    cases = {"nan": (save_h5(tmp_path / "nan.h5", features=feats),
                     "nan.h5 (dataset 'features'): features hold NaN or inf (in 1 rows, first row 3)"),
             "unlabelled": (save_h5(tmp_path / "unl.h5", labels=np.array([0, 1, 0, 1, -1]),
                                    train_idx=np.array([0, 4])),
                            "unl.h5: train_idx holds an unlabelled node (4) (label -1)"),
             # multi-label targets (one row of 0/1 per node): not one class per node
             "multilabel": (save_h5(tmp_path / "ml.h5", labels=np.array([[0, 1]] * 5)),
                            "ml.h5: labels have shape (5, 2), expected (5,)")}
    for case, (path, want) in cases.items():
        out = tmp_path / case
        proc = run_mpi(2, ["-m", "preprocess", "--dataset", f"h5:{path}", "--parts", "2",
                           "--partitioner", "random", "--out", str(out), "-q"], timeout=90)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("preprocess: error")]
        assert len(lines) == 2 and all(want in ln for ln in lines), proc.stderr   # both ranks
        if case != "multilabel":               # the labels' shape is wrong on every rank
            assert all(f"on rank 1 only: {path}" in ln for ln in lines), lines   # node 3, 4
        assert "part-" not in proc.stderr
        assert not (out / "meta.json").exists() and not list(out.glob("part-*.h5"))
    # a step only rank 0 runs (the --out check) is not said to have failed "on rank 0 only"
    held = tmp_path / "held"
    held.mkdir()
    (held / "meta.json").write_text("{}")
    proc = run_mpi(2, ["-m", "preprocess", "--dataset", f"h5:{path}", "--parts", "2",
                       "--partitioner", "random", "--out", str(held)], timeout=90)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("preprocess: error")]
    assert len(lines) == 2 and all(f"): {held}: already holds shard files" in ln
                                   for ln in lines), proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_ptscotch_partition_is_repeatable_for_a_seed(ptscotch_same_mpi, tmp_path, ranks):
    """The same input, rank count and --seed give the same shard set, byte for byte; another
    seed another one. (Scotch 7's default context seeds its generator from the clock unless
    built with a fixed seed: the edge cut of one input varied by 14 % from run to run.)"""
    spec = "rmat-sliced:scale=12,edge_factor=8,seed=2"

    def sums(name: str, seed: int) -> list[str]:
        proc = run_mpi(ranks, ["-m", "preprocess", "--dataset", spec, "--parts", "4",
                               "--partitioner", "ptscotch", "--seed", str(seed), "--out",
                               str(tmp_path / name), "-q"], timeout=120)
        check_ok(proc)
        return [e["sha256"] for e in json.loads((tmp_path / name / "meta.json").read_text())["parts"]]

    first = sums("a", 1)
    assert sums("b", 1) == first and sums("c", 1) == first
    assert sums("d", 5) != first


@pytest.mark.mpi
def test_sliced_generator_without_training_nodes_writes_a_set_to_predict_on(tmp_path):
    """A per-node training probability can select no node: counted across the ranks (one
    Allreduce, the same sum everywhere), warned of once, and the set's meta.json counts 0
    training nodes, which train refuses."""
    from hpcgnn.data.shard import ShardFormatError
    from hpcgnn.data.shardset import ShardSet
    spec = "csbm-sliced:nodes=20,train=0.001,seed=1"
    proc = run_mpi(2, ["-m", "preprocess", "--dataset", spec, "--parts", "2", "--partitioner",
                       "random", "--out", str(tmp_path / "s")], timeout=90)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{spec}: no labelled training node" in proc.stderr
    with pytest.raises(ShardFormatError, match="no labelled training node"):
        ShardSet.open(tmp_path / "s").check_trainable()


@pytest.mark.mpi
def test_an_unlabelled_h5_input_takes_its_num_classes(tmp_path):
    """Distributed preprocessing's class count is the input's ``num_classes`` key where it has
    one (was: the largest label + 1 over the ranks, 0 for a graph to predict on that labels no
    node: a meta.json no reader takes); without the key such a graph is refused on every rank,
    before anything is written."""
    from _graphs import save_h5
    none = {"labels": np.full(5, -1, np.int64), "train_idx": np.zeros(0, np.int64),
            "val_idx": np.zeros(0, np.int64), "test_idx": np.zeros(0, np.int64)}
    for key, out in ((np.int64(3), tmp_path / "keyed"), (None, tmp_path / "bare")):
        path = save_h5(tmp_path / f"{out.name}.h5", num_classes=key, **none)
        proc = run_mpi(2, ["-m", "preprocess", "--dataset", f"h5:{path}", "--parts", "2",
                           "--partitioner", "random", "--out", str(out), "-q"], timeout=90)
        if key is not None:
            check_ok(proc)
            assert json.loads((out / "meta.json").read_text())["num_classes"] == 3
            continue
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("preprocess: error")]
        assert len(lines) == 2 and all("no labelled node and no num_classes" in ln
                                       for ln in lines), proc.stderr
        assert not (out / "meta.json").exists() and not list(out.glob("part-*.h5"))


# --- the MPI worker ----------------------------------------------------------------------------

def _worker_run(root: str, out: str, k_scotch: str, k_random: str) -> None:
    from preprocess.__main__ import main
    root, out = Path(root), Path(out)
    jobs = [("scotch", "messy.h5", k_scotch, "ptscotch", ["--symmetrize"]),
            ("random", "messy.h5", k_random, "random", []),
            ("csbm", "csbm.h5", "4", "ptscotch", []),
            ("gen", None, k_scotch, "ptscotch", []),
            ("tiny-scotch", "tiny.h5", "2", "ptscotch", ["--symmetrize"]),
            ("tiny-random", "tiny.h5", "2", "random", []),
            ("tiny-random3", "tiny.h5", "3", "random", []),
            ("tiny-scotch3", "tiny.h5", "3", "ptscotch", []),
            ("pair-scotch3", "pair.h5", "3", "ptscotch", [])]
    for name, src, k, partitioner, extra in jobs:
        argv = ["--dataset", f"h5:{root / src}" if src else GEN, "--parts", k, "--partitioner", partitioner,
                "--out", str(out / name), "--seed", "1", "-q", *extra]
        assert main(argv) == 0, name


def _worker_errors(root: str, out: str, fake: str) -> None:
    import contextlib
    import io

    from mpi4py import MPI

    from preprocess.__main__ import main
    root, out = Path(root), Path(out)
    base = ["--partitioner", "ptscotch", "-q"]
    cases = {"missing": ([f"h5:{root / 'nope.h5'}", "2"], {}),
             "junk": ([f"h5:{out / 'junk.h5'}", "2"], {}),
             "parts0": ([f"h5:{root / 'csbm.h5'}", "0"], {}),
             "toomany": ([f"h5:{root / 'csbm.h5'}", "5000"], {}),
             "nolib": ([f"h5:{root / 'csbm.h5'}", "2"],
                       {"HPCGNN_PTSCOTCH_LIB": "/nonexistent/libptscotch.so"}),
             "round1g": ([f"h5:{root / 'csbm.h5'}", "2"], {"HPCGNN_A2A_ROUND_BYTES": "1GiB"}),
             "round3g": ([f"h5:{root / 'csbm.h5'}", "2"],
                         {"HPCGNN_A2A_ROUND_BYTES": "3000000000"}),
             "metisgraph": ([f"metis-graph:{out / 'g.graph'},classes=3", "2"], {})}
    if fake:
        cases["othermpi"] = ([f"h5:{root / 'csbm.h5'}", "2"], {"HPCGNN_PTSCOTCH_LIB": fake})
    for case, ((spec, k), env) in cases.items():
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = main(["--dataset", spec, "--parts", k, "--out", str(out / case), *base])
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        msg = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else ""
        # one write per line: with PYTHONUNBUFFERED, print() writes the text and its newline
        # apart, and Open MPI 4's output forwarding interleaves the ranks' pieces
        sys.stdout.write(f"{case} rank={MPI.COMM_WORLD.rank} rc={rc} {msg}\n")
        sys.stdout.flush()
        MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    {"run": _worker_run, "errors": _worker_errors}[sys.argv[1]](*sys.argv[2:])


@pytest.mark.mpi
def test_training_nodes_in_the_evaluation_splits_are_warned_of_on_both_paths(tmp_path):
    """A node in train_idx and in val_idx or test_idx makes that accuracy count nodes the model
    trained on: preprocess writes the set (a split is the input's to choose) but says so, once,
    with the counts, on the one-process path (npz) and the distributed one (h5, 2 ranks)."""
    from _graphs import save_h5, save_npz
    splits = {"train_idx": np.array([0, 1, 2]), "val_idx": np.array([2]),
              "test_idx": np.array([1, 3, 4])}
    runs = {"one": (1, f"npz:{save_npz(tmp_path / 'g.npz', **splits)}"),
            "dist": (2, f"h5:{save_h5(tmp_path / 'g.h5', **splits)}")}
    for name, (ranks, spec) in runs.items():
        proc = run_mpi(ranks, ["-m", "preprocess", "--dataset", spec, "--parts", "2",
                               "--partitioner", "random", "--out", str(tmp_path / name)],
                       timeout=90)
        check_ok(proc)
        warned = [ln for ln in proc.stderr.splitlines() if "in train_idx too" in ln]
        assert len(warned) == 1, (name, proc.stderr)
        assert "1 node(s) of val_idx" in warned[0] and "1 node(s) of test_idx" in warned[0]
        assert (tmp_path / name / "meta.json").is_file()
    proc = run_mpi(1, ["-m", "preprocess", "--dataset", f"npz:{save_npz(tmp_path / 'ok.npz')}",
                       "--parts", "2", "--partitioner", "random", "--out", str(tmp_path / "ok")],
                   timeout=90)
    check_ok(proc)
    assert "train_idx too" not in proc.stderr
