"""Dataset readers, generators and cleaning: shipped Planetoid files, the npz format, OGB from a
local directory, cSBM and R-MAT; every bad input gives a DatasetError naming file and fix."""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from _graphs import edge_keys, save_h5, save_npz
from hpcgnn.data.clean import clean_graph, edges_to_csr
from hpcgnn.data.datasets import load_dataset, parse_spec
from hpcgnn.data.errors import DatasetError


@pytest.mark.parametrize("name, nodes, edges, feats, classes", [
    ("cora", 2708, 10556, 1433, 7), ("citeseer", 3327, 9104, 3703, 6)])
def test_shipped_datasets_match_their_provenance_note(name, nodes, edges, feats, classes):
    g = load_dataset(name)
    assert (g.num_nodes, g.num_edges) == (nodes, edges)
    assert (g.feature_dim, g.num_classes) == (feats, classes)
    assert g.indptr.dtype == g.indices.dtype == np.int64
    # symmetric: the reverse of every edge is there
    n = g.num_nodes
    keys = edge_keys(g.indptr, g.indices, n)
    np.testing.assert_array_equal(keys, np.sort((keys % n) * n + keys // n))


def test_npz_round_trip_and_cleaning_counts(tmp_path):
    # 0 <- 0 (self-loop), 1 <- 0 twice (duplicate), 2 <- 1: a directed graph
    indptr = np.array([0, 1, 3, 4, 4], dtype=np.int64)
    indices = np.array([0, 0, 0, 1], dtype=np.int64)
    path = save_npz(tmp_path / "g.npz", n=4, adj_indptr=indptr, adj_indices=indices,
                    features=np.ones((4, 3), np.float32), labels=np.array([0, 1, 2, -1]),
                    train_idx=np.array([0]), val_idx=np.array([1]), test_idx=np.array([2, 3]))
    g = load_dataset(f"npz:{path}")
    assert g.num_edges == 2 and g.indices.tolist() == [0, 1]
    _, report = clean_graph(g.__class__(**{**g.__dict__, "indptr": indptr, "indices": indices}))
    assert (report.self_loops, report.duplicates, report.reverse_added) == (1, 1, 0)
    sym = load_dataset(f"npz:{path}", symmetrize=True)
    assert sym.num_edges == 4
    assert edge_keys(sym.indptr, sym.indices, 4).tolist() == [0 * 4 + 1, 1 * 4 + 0, 1 * 4 + 2,
                                                              2 * 4 + 1]
    assert g.dense_features().shape == (4, 3) and g.num_classes == 3


def test_edges_to_csr_counts():
    dst = np.array([1, 1, 2, 3, 3, 0])
    src = np.array([0, 0, 2, 1, 1, 3])
    indptr, indices, r = edges_to_csr(dst, src, 4, symmetrize=True)
    assert (r.edges_in, r.self_loops, r.duplicates, r.reverse_added, r.edges_out) == (6, 1, 2, 3, 6)
    assert indptr.tolist() == [0, 2, 4, 4, 6] and indices.tolist() == [1, 3, 0, 3, 0, 1]


@pytest.mark.parametrize("symmetrize, bound", [(False, 2.5), (True, 4.5)])
def test_cleaning_peak_is_bounded_by_the_edge_array(symmetrize, bound):
    """Cleaning a file's edges (every reader's load) allocates beyond the input at most ~2.25x
    the int64 edge array (the keys, their distinct copy, the rows), ~4.25x with --symmetrize
    (keys and reverses, their distinct copy); numpy reports its allocations to tracemalloc.
    The rows of every edge were held through the sort (3.25x), and the reverses were built
    beside the keys and then concatenated (6.25x): on ogbn-papers100M's 1.6 billion edges, 12.5
    and 25 GiB more."""
    import tracemalloc
    from hpcgnn.data.graph import Graph
    n, deg = 50_000, 20
    indices = np.random.default_rng(0).integers(0, n, n * deg)
    g = Graph("g", n, np.arange(n + 1, dtype=np.int64) * deg, indices,
              np.zeros((n, 1), np.float32), np.zeros(n, np.int64), np.arange(3),
              np.arange(3, 6), np.arange(6, 9))
    tracemalloc.start()
    try:
        cleaned, report = clean_graph(g, symmetrize=symmetrize)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cleaned.num_edges > (1.99 if symmetrize else 0.99) * indices.size, report
    assert peak <= bound * indices.nbytes, f"peak {peak / indices.nbytes:.2f}x the edge array"


def test_csbm_is_deterministic_symmetric_and_class_structured():
    spec = "csbm:nodes=3000,classes=3,degree=10,homophily=0.9,features=16,seed=4"
    a, b = load_dataset(spec), load_dataset(spec)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.features, b.features)
    assert a.num_nodes == 3000 and a.feature_dim == 16 and a.num_classes == 3
    assert abs(a.num_edges / 3000 - 10) < 1.0                       # mean degree ~ 10
    rows = np.repeat(np.arange(3000), np.diff(a.indptr))
    same = np.mean(a.labels[rows] == a.labels[a.indices])
    assert 0.85 < same < 0.95                                       # homophily ~ 0.9
    assert len(a.train_idx) == 300 and len(np.intersect1d(a.train_idx, a.test_idx)) == 0
    c = load_dataset(spec.replace("seed=4", "seed=5"))
    assert not np.array_equal(a.labels, c.labels)


def test_rmat_graph500_is_skewed_simple_and_symmetric():
    g = load_dataset("rmat:scale=11,edge_factor=8,seed=1")
    n = 2048
    assert g.num_nodes == n and g.indices.dtype == np.int64
    keys = edge_keys(g.indptr, g.indices, n)
    assert np.all(np.diff(keys) > 0) and not np.any(keys // n == keys % n)
    np.testing.assert_array_equal(keys, np.sort((keys % n) * n + keys // n))
    deg = g.in_degree()
    assert deg.max() > 20 * deg.mean()                             # power-law-like hubs
    assert 0.5 * 8 * n < g.num_edges <= 2 * 8 * n


@pytest.mark.parametrize("gen", ["rmat", "rmat-sliced"])
def test_symmetrize_wins_over_a_directed_generator(gen):
    """``--symmetrize`` on ``rmat:...,symmetric=false`` adds the reverse of every edge, as it
    does for a file (and as the distributed path always did): it was silently ignored."""
    spec = f"{gen}:scale=7,edge_factor=4,symmetric=false,seed=3"
    directed, sym = load_dataset(spec), load_dataset(spec, symmetrize=True)
    n = directed.num_nodes
    one_way = edge_keys(directed.indptr, directed.indices, n)
    assert not np.array_equal(one_way, np.sort((one_way % n) * n + one_way // n))
    both = np.union1d(one_way, (one_way % n) * n + one_way // n)
    np.testing.assert_array_equal(edge_keys(sym.indptr, sym.indices, n), both)


def test_spec_parsing():
    assert parse_spec("csbm:nodes=10,homophily=0.5,name=x") == \
        ("csbm", {"nodes": 10, "homophily": 0.5, "name": "x"})
    assert parse_spec("npz:/a/b:c,d.npz") == ("npz", {"path": "/a/b:c,d.npz"})
    assert parse_spec("rmat:symmetric=false")[1] == {"symmetric": False}


def write_ogb_arxiv(root, n=6):
    """A tiny ogbn-arxiv in OGB's on-disk layout."""
    d = root / "ogbn_arxiv"
    (d / "raw").mkdir(parents=True)
    (d / "split" / "time").mkdir(parents=True)
    (d / "RELEASE_v1.txt").write_text("tiny\n")
    edges = [(0, 1), (1, 2), (2, 0), (3, 4), (4, 5), (5, 3), (0, 0)]   # src, dst; one self-loop

    def csv(path, rows):
        with gzip.open(path, "wt") as f:
            f.writelines(",".join(str(v) for v in r) + "\n" for r in rows)

    csv(d / "raw" / "edge.csv.gz", edges)
    csv(d / "raw" / "num-node-list.csv.gz", [[n]])
    csv(d / "raw" / "num-edge-list.csv.gz", [[len(edges)]])
    csv(d / "raw" / "node-feat.csv.gz", [[i, i + 0.5] for i in range(n)])
    csv(d / "raw" / "node-label.csv.gz", [[i % 4] for i in range(n)])
    csv(d / "raw" / "node_year.csv.gz", [[2000 + i] for i in range(n)])
    for part, ids in (("train", [0, 1, 2]), ("valid", [3]), ("test", [4, 5])):
        csv(d / "split" / "time" / f"{part}.csv.gz", [[i] for i in ids])
    return edges


def test_ogb_reader_from_a_local_directory(tmp_path):
    pytest.importorskip("ogb")
    edges = write_ogb_arxiv(tmp_path)
    g = load_dataset(f"ogbn-arxiv:root={tmp_path}")
    assert (g.num_nodes, g.feature_dim) == (6, 2)
    simple = sorted({(d, s) for s, d in edges if s != d})          # (dst, src), no self-loop
    assert edge_keys(g.indptr, g.indices, 6).tolist() == [d * 6 + s for d, s in simple]
    np.testing.assert_array_equal(g.features[:, 1], np.arange(6) + 0.5)
    assert g.labels.tolist() == [0, 1, 2, 3, 0, 1] and g.train_idx.tolist() == [0, 1, 2]
    assert (g.val_idx.tolist(), g.test_idx.tolist()) == ([3], [4, 5])
    assert load_dataset(f"ogbn-arxiv:root={tmp_path}", symmetrize=True).num_edges == 12


def test_ogb_copy_preprocesses_into_shards_that_train(tmp_path):
    """`python -m preprocess --dataset ogbn-arxiv:root=DIR` on OGB's on-disk layout, no
    network: the shards hold the labels and splits written, and a run trains on them."""
    pytest.importorskip("ogb")
    import json

    from conftest import train_here
    from hpcgnn.data.shard import read_shard
    from preprocess.__main__ import main
    write_ogb_arxiv(tmp_path)
    out = tmp_path / "shards"
    assert main(["--dataset", f"ogbn-arxiv:root={tmp_path}", "--parts", "2", "--out", str(out),
                 "-q"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["num_nodes"], meta["num_classes"], meta["feature_dim"]) == (6, 4, 2)
    got = {}
    for p in range(2):
        shard = read_shard(out / f"part-{p:05d}.h5")
        for i, gid in enumerate(shard.global_id.tolist()):
            got[gid] = (int(shard.label[i]), bool(shard.train_mask[i]), bool(shard.val_mask[i]),
                        bool(shard.test_mask[i]), float(shard.features[i, 1]))
    assert got == {i: (i % 4, i < 3, i == 3, i > 3, i + 0.5) for i in range(6)}
    rows = train_here(out, tmp_path / "run", "train.epochs=5", "model.hidden=4",
                      "model.dropout=0", "train.weight_decay=0")
    assert [r["epoch"] for r in rows] == list(range(5))
    assert rows[-1]["loss"] < rows[0]["loss"] and (tmp_path / "run" / "summary.json").is_file()


def test_ogb_is_imported_without_its_pypi_version_check(tmp_path):
    """``import ogb`` starts a thread asking PyPI for ogb's latest version (``outdated``,
    ``requests.get`` without a timeout) that the process waits for at exit: a compute node
    without network held preprocessing's exit for minutes. A stand-in ``outdated`` records
    whether the check ran; the read must not run it."""
    pytest.importorskip("ogb")
    import os
    import subprocess
    import sys
    write_ogb_arxiv(tmp_path)
    fake = tmp_path / "fake" / "outdated"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import os\n"
        "def check_outdated(package, version):\n"
        "    open(os.environ['CHECKED'], 'a').write(package + '\\n')\n"
        "    return False, version\n")
    env = {**os.environ, "CHECKED": str(tmp_path / "checked"),
           "PYTHONPATH": os.pathsep.join([str(fake.parent), *sys.path])}
    code = (f"from hpcgnn.data.datasets import load_dataset; "
            f"print(load_dataset('ogbn-arxiv:root={tmp_path}').num_nodes)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "6", proc.stderr
    assert not (tmp_path / "checked").exists()
    proc = subprocess.run([sys.executable, "-c", "import ogb.version"], env=env, timeout=120)
    assert proc.returncode == 0 and (tmp_path / "checked").read_text() == "ogb\n"   # the stand-in works


def test_ogb_not_installed_names_the_package_to_install(tmp_path, monkeypatch):
    import sys
    write_ogb_arxiv(tmp_path)
    monkeypatch.setitem(sys.modules, "ogb", None)
    monkeypatch.setitem(sys.modules, "ogb.nodeproppred", None)
    with pytest.raises(DatasetError, match=r"ogbn-arxiv: the 'ogb' package is not installed; "
                                           r"pip install ogb \(or pip install 'hpcgnn\[ogb\]'\)"):
        load_dataset(f"ogbn-arxiv:root={tmp_path}")


def test_ogb_missing_directory_names_it_and_the_fix(tmp_path):
    pytest.importorskip("ogb")
    with pytest.raises(DatasetError, match=r"ogbn_products: no such directory.*download") as err:
        load_dataset(f"ogbn-products:root={tmp_path}")
    assert (f"D('ogbn-products', root='{tmp_path}')\"), then copy the directory it makes, "
            f"{tmp_path}/ogbn_products (its raw/ and split/), to {tmp_path}/ogbn_products here; "
            f"hpcgnn reads it offline") in str(err.value)
    with pytest.raises(DatasetError, match="not an OGB node-property dataset"):
        load_dataset(f"ogbn-nothing:root={tmp_path}")


@pytest.mark.parametrize("damage, expect", [
    ("rm raw/node-label.csv.gz", r"raw/node-label.csv.gz: missing, so .* not a complete OGB"),
    ("rm raw/num-node-list.csv.gz", r"raw/num-node-list.csv.gz: missing, so .* not a complete"),
    ("rm raw/node_year.csv.gz", r"raw/node_year.csv.gz: missing, so .* not a complete OGB"),
    ("rm split/time/valid.csv.gz", r"split/time/valid.csv.gz: missing; the OGB split files"),
    ("cut raw/edge.csv.gz", r"ogbn_arxiv: cannot read its files \(EOFError: .*incomplete or "
                            r"damaged; download it"),
    ("cut raw/node-label.csv.gz", r"ogbn_arxiv: cannot read its files \(EOFError"),
])
def test_ogb_partial_or_damaged_copy_names_it_and_the_fix(tmp_path, damage, expect):
    """A copy of a download cut short: a missing raw file or a truncated .gz was a traceback
    (FileNotFoundError, ogb's RuntimeError 'No necessary file', EOFError)."""
    pytest.importorskip("ogb")
    write_ogb_arxiv(tmp_path, n=6)
    how, name = damage.split()
    path = tmp_path / "ogbn_arxiv" / name
    if how == "rm":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:-12])           # the gzip trailer and some data
    with pytest.raises(DatasetError, match=expect):
        load_dataset(f"ogbn-arxiv:root={tmp_path}")


def test_ogb_binary_copy_cut_short_names_it_and_the_fix(tmp_path):
    """ogbn-papers100M's layout (raw/data.npz): a truncated data.npz was a BadZipFile
    traceback, a missing node-label.npz is named."""
    pytest.importorskip("ogb")
    raw = tmp_path / "ogbn_papers100M" / "raw"
    raw.mkdir(parents=True)
    np.savez_compressed(raw / "data.npz", edge_index=np.zeros((2, 500), np.int64),
                        num_nodes_list=np.array([10]), num_edges_list=np.array([500]),
                        node_feat=np.ones((10, 4), np.float32))
    data = (raw / "data.npz").read_bytes()
    (raw / "data.npz").write_bytes(data[:len(data) // 2])
    with pytest.raises(DatasetError, match=r"node-label.npz: missing, so .* not a complete"):
        load_dataset(f"ogbn-papers100M:root={tmp_path}")
    np.savez(raw / "node-label.npz", node_label=np.zeros((10, 1)))
    with pytest.raises(DatasetError, match=r"ogbn_papers100M: cannot read its files "
                                           r"\(BadZipFile: .*incomplete or damaged; download"):
        load_dataset(f"ogbn-papers100M:root={tmp_path}")


SPARSE = {"features": None, "feat_indptr": np.array([0, 1, 2, 3, 4, 5]),
          "feat_indices": np.array([0, 1, 0, 1, 0]), "feat_shape": np.array([5, 2])}

# what the npz and the h5 reader both refuse (hpcgnn.data.validate), with the same words
CHECKED = [
    ({"adj_indices": np.array([1, 4, 0, 2, 1, 3, 2, 9, 3, 0])}, "node id 9, outside 0..4"),
    ({"features": np.array([[0, 1], [np.nan, 1], [0, 0], [0, 0], [np.inf, 0]], np.float32)},
     r"NaN or inf \(in 2 rows, first row 1\)"),
    ({"labels": np.array([0, 1, -3, 0, 1])}, "labels hold -3"),
    ({"labels": np.array([0, 1, 7, 0, 1]), "num_classes": np.int64(3)},
     r"class 7, outside 0..2 \(num_classes\)"),
    # without num_classes the bound is the node count, which the message did not say
    ({"labels": np.array([0, 1, 7, 0, 1])},
     r"class 7, outside 0..4 \(the node count, without a num_classes key\); .*add the "
     r"num_classes key if the graph has more classes than nodes"),
    ({"train_idx": np.array([0, 5])}, "train_idx holds node id 5"),
    ({"test_idx": np.array([-1, 3])}, "test_idx holds node id -1"),
    ({"val_idx": np.array([2, 4, 2])}, "val_idx lists a node (.*)?twice; list each node"),
    ({"labels": np.array([-1, 1, 0, 0, 1])}, "train_idx holds an unlabelled node"),
    # a per-node array of another length or rank: a slice reads only its own rows, so an h5
    # input's longer labels or features (a 2-D label column) were taken without a word
    ({"labels": np.array([0, 1, 0, 0, 1, 2])}, r"labels have shape \(6,\), expected \(5,\)"),
    ({"labels": np.array([[0], [1], [0], [0], [1]])},
     r"labels have shape \(5, 1\), expected \(5,\)"),
    ({"features": np.zeros((6, 2), np.float32)},
     r"features have shape \(6, 2\), expected \(5, F\)"),
    ({"features": np.zeros((5, 2, 1), np.float32)},
     r"features have shape \(5, 2, 1\), expected \(5, F\)"),
    ({**SPARSE, "feat_indptr": np.arange(7), "feat_indices": np.zeros(6, np.int64),
      "feat_data": np.ones(6, np.float32), "feat_shape": np.array([6, 2])},
     r"features have shape \(6, 2\), expected \(5, F\)"),
    # no feature column: the set was written, then refused by verify and training, whose fix
    # (re-run preprocess) wrote the same set again
    ({"features": np.zeros((5, 0), np.float32)},
     r"features have shape \(5, 0\), no feature column; give every node at least one"),
    ({**SPARSE, "feat_data": np.ones(0, np.float32), "feat_indices": np.zeros(0, np.int64),
      "feat_indptr": np.zeros(6, np.int64), "feat_shape": np.array([5, 0])},
     r"features have shape \(5, 0\), no feature column"),
    ({"num_nodes": np.array([5, 7])}, r"num_nodes has shape \(2,\), expected a scalar"),
    ({"num_nodes": np.zeros(0, np.int64)}, r"num_nodes has shape \(0,\), expected a scalar"),
    # num_classes of two values was a TypeError traceback; 0 or below was reported as
    # "no num_classes" or as a label outside 0..-4
    ({"num_classes": np.array([3, 4])}, r"num_classes has shape \(2,\), expected a scalar"),
    ({"num_classes": np.int64(0), "labels": np.full(5, -1), "train_idx": np.zeros(0, np.int64)},
     r"num_classes is 0; it must be the class count, >= 1"),
    ({"num_classes": np.int64(-3)}, r"num_classes is -3; it must be the class count, >= 1"),
    # a uint64 past int64's range wrapped: "holds node id -9223372036854775803"
    ({"adj_indices": np.array([1, 4, 0, 2, 1, 3, 2, 4, 3, 2**63 + 5], np.uint64)},
     r"adj_indices holds 9223372036854775813 \(uint64\), past int64's largest value; .*int64"),
    ({"test_idx": np.array([3, 2**64 - 1], np.uint64)},
     r"test_idx holds 18446744073709551615 \(uint64\), past int64's largest value"),
    # each bound's first value outside it (an id equal to the node count, a class equal to
    # num_classes) and int64's largest value, which fits (it is then out of the graph's range)
    ({"adj_indices": np.array([1, 4, 0, 2, 1, 3, 2, 5, 3, 0])}, "node id 5, outside 0..4"),
    ({"labels": np.array([0, 1, 3, 0, 1]), "num_classes": np.int64(3)},
     r"class 3, outside 0..2 \(num_classes\)"),
    ({"test_idx": np.array([3, 2**63 - 1], np.uint64)},
     "test_idx holds node id 9223372036854775807, outside 0..4"),
]


@pytest.mark.parametrize("override, message", CHECKED + [
    ({"adj_indices": None}, r"missing key\(s\) \['adj_indices'\]"),
    ({"labels": np.zeros(5)}, "key 'labels' has dtype float64, expected int64"),
    ({"adj_indptr": np.array([0, 2, 4, 6, 8])}, "adj_indptr has shape"),
    ({"features": None}, "no features"),
    ({**SPARSE, "feat_data": np.ones(3, np.float32)},
     r"feat_data has shape \(3,\).*one float32 value per entry of feat_indices \(shape \(5,\)\)"),
    # a decreasing feat_indptr (the h5 reader refused it) was read into garbled rows
    ({**SPARSE, "feat_indptr": np.array([0, 3, 2, 3, 4, 5]), "feat_data": np.ones(5, np.float32)},
     r"feat_indptr/feat_indices are not a CSR matrix of shape \(5, 2\) \(feat_indptr: 5 \+ 1 "
     r"offsets from 0, never decreasing"),
    ({**SPARSE, "feat_indices": np.array([[0], [1], [0], [1], [0]]),
      "feat_data": np.ones((5, 1), np.float32)}, "feat_indptr/feat_indices are not a CSR matrix"),
    # a column equal to F (the first outside 0..F-1)
    ({**SPARSE, "feat_indices": np.array([0, 1, 2, 1, 0]), "feat_data": np.ones(5, np.float32)},
     r"feat_indptr/feat_indices are not a CSR matrix of shape \(5, 2\)"),
    # a scalar where an array belongs was a TypeError traceback (a 2-D adj_indices was called a
    # bad adj_indptr)
    ({**SPARSE, "feat_data": np.ones(5, np.float32), "feat_shape": np.int64(5)},
     r"feat_shape is \(5,\), expected \(num_nodes, F\)"),
    ({"adj_indices": np.int64(1), "adj_indptr": np.array([0, 0, 0, 0, 0, 1])},
     r"adj_indices has shape \(\), expected 1-D; it lists every row's neighbour ids"),
    ({"adj_indices": np.array([[1, 4, 0, 2, 1, 3, 2, 4, 3, 0]])},
     r"adj_indices has shape \(1, 10\), expected 1-D"),
])
def test_bad_npz_inputs_name_the_file_and_the_fix(tmp_path, override, message):
    path = save_npz(tmp_path / "bad.npz", **override)
    with pytest.raises(DatasetError, match=message) as err:
        load_dataset(f"npz:{path}")
    assert str(path) in str(err.value) and ";" in str(err.value)


@pytest.mark.parametrize("override, message", CHECKED + [
    ({**SPARSE, "feat_data": np.array([1, np.nan, 1, 1, 1], np.float32)},
     r"\(dataset 'feat_data'\): features hold NaN or inf \(in 1 rows, first row 1\)"),
    ({**SPARSE, "feat_data": np.ones(3, np.float32)},
     "feat_indices holds 5 entries and feat_data 3"),
    ({**SPARSE, "feat_indices": np.array([0, 1, 2, 1, 0]), "feat_data": np.ones(5, np.float32)},
     r"feat_indices holds a column outside 0..1 \(feat_shape \(5, 2\)\)"),
    # a 2-D feat_data of the right length was scipy's ValueError traceback, a scalar where an
    # array belongs h5py's ValueError
    ({**SPARSE, "feat_data": np.ones((5, 1), np.float32)},
     r"dataset 'feat_data' has shape \(5, 1\), expected 1-D"),
    ({**SPARSE, "feat_data": np.ones(5, np.float32), "feat_shape": np.int64(5)},
     r"dataset 'feat_shape' has shape \(\), expected 1-D"),
    ({"adj_indices": np.int64(1), "adj_indptr": np.array([0, 0, 0, 0, 0, 1])},
     r"dataset 'adj_indices' has shape \(\), expected 1-D"),
])
def test_bad_h5_inputs_get_the_npz_checks(tmp_path, override, message):
    path = save_h5(tmp_path / "bad.h5", **override)
    with pytest.raises(DatasetError, match=message) as err:
        load_dataset(f"h5:{path}")
    assert str(path) in str(err.value) and ";" in str(err.value)
    if "NaN" in message:
        assert "(dataset 'feat" in str(err.value)         # the input file and its dataset


def test_damaged_h5_input_is_a_dataset_error(tmp_path):
    """Every 16th byte position of a real h5 input changed in turn (HDF5 keeps no checksum of
    its data, so many changes read on): each damaged file reads or is refused with one
    DatasetError naming it. Its headers' damage raised HDF5's KeyError, RuntimeError
    ('bad local heap signature') or OSError, and a damaged name a TypeError."""
    path = save_h5(tmp_path / "g.h5")
    good = path.read_bytes()
    refused = 0
    for at in range(0, len(good), 16):
        data = bytearray(good)
        data[at:at + 8] = bytes(b ^ 0xA5 for b in data[at:at + 8])
        path.write_bytes(data)
        try:
            load_dataset(f"h5:{path}")
        except DatasetError as exc:
            assert str(exc).startswith(f"{path}: "), exc
            refused += 1
    assert refused > 50


def test_h5_slices_check_what_they_read_in_chunks(tmp_path, monkeypatch):
    """A rank's slice checks the rows it reads; with one id per chunk a repeat across chunks
    is still caught, by the slice that holds the node, and every slice checks id ranges."""
    from hpcgnn.data import h5input
    monkeypatch.setattr(h5input, "READ_CHUNK", 1)
    path = save_h5(tmp_path / "g.h5", labels=np.array([0, 1, 0, -1, 1]),
                   val_idx=np.array([3, 2, 3]), test_idx=np.array([4]))
    assert h5input.read_h5_slice(path, 0, 2).masks["train_mask"].tolist() == [True, True]
    with pytest.raises(DatasetError, match=r"g.h5: val_idx lists a node \(3\) twice"):
        h5input.read_h5_slice(path, 2, 5)
    bad = save_h5(tmp_path / "bad.h5", labels=np.array([0, 1, 0, -1, 1]),
                  train_idx=np.array([0, 3]), test_idx=np.array([4, 7]))
    with pytest.raises(DatasetError, match=r"train_idx holds an unlabelled node \(3\)"):
        h5input.read_h5_slice(bad, 3, 5)
    for lo, hi in ((0, 2), (2, 3)):          # rows without node 3: the range check still fires
        with pytest.raises(DatasetError, match="test_idx holds node id 7, outside 0..4"):
            h5input.read_h5_slice(bad, lo, hi)
    # the first non-finite row is named in the file's numbering, whatever the slice and the
    # block of rows checked at once (one row a block here), dense and sparse alike
    monkeypatch.setattr(h5input, "CHECK_BYTES", 8)
    dense = np.zeros((5, 2), np.float32)
    dense[3, 1] = np.nan
    sparse = {"features": None, "feat_indptr": np.arange(6), "feat_indices": np.zeros(5, np.int64),
              "feat_data": np.array([1, 1, 1, np.inf, 1], np.float32), "feat_shape": np.array([5, 2])}
    for name, override in (("features", {"features": dense}), ("feat_data", sparse)):
        path = save_h5(tmp_path / f"nan-{name}.h5", **override)
        for lo, hi in ((0, 5), (2, 5), (3, 4)):
            with pytest.raises(DatasetError, match=rf"\(dataset '{name}'\): features hold NaN or "
                                                   r"inf \(in 1 rows, first row 3\)"):
                h5input.read_h5_slice(path, lo, hi)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(DatasetError, match=r"no such file; pass --dataset npz:PATH"):
        load_dataset(f"npz:{tmp_path / 'nope.npz'}")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DatasetError, match=r"junk.npz: not a readable .npz"):
        load_dataset(f"npz:{tmp_path / 'junk.npz'}")


def test_bad_specs():
    with pytest.raises(DatasetError, match="unknown dataset 'pubmedd'"):
        load_dataset("pubmedd")
    with pytest.raises(DatasetError, match=r"unknown option\(s\) \['nodez'\]"):
        load_dataset("csbm:nodez=5")
    with pytest.raises(DatasetError, match="not key=value"):
        load_dataset("csbm:5")


@pytest.mark.parametrize("spec, message", [
    ("csbm:classes=0", "option classes=0 is not allowed: classes must be an integer >= 2, "
                       "e.g. csbm:classes=4"),
    ("csbm:degree=-1", "degree must be a number >= 0, e.g. csbm:degree=10"),
    ("csbm:nodes=abc", "option nodes=abc is not allowed: nodes must be an integer >= 1, "
                       "e.g. csbm:nodes=2000"),
    ("csbm:nodes=2.5", "nodes must be an integer >= 1"),
    ("csbm:train=2.0", r"train must be a number in \(0, 1\], e.g. csbm:train=0.1"),
    ("csbm:train=0", r"train must be a number in \(0, 1\]"),
    ("csbm:homophily=1.5", r"homophily must be a number in \[0, 1\], e.g. csbm:homophily=0.8"),
    ("csbm:train=0.6,val=0.5", r"train=0.6 \+ val=0.5 is more than 1 .* e.g. csbm:train=0.1,val=0.2"),
    ("csbm:features=0", "features must be an integer >= 1, e.g. csbm:features=32"),
    ("csbm:signal=nan", "signal must be a finite number"),
    ("csbm:seed=-1", "seed must be an integer >= 0"),
    ("csbm:nodes=5,train=0.05", "train=0.05 of 5 nodes is no training node: raise train to at "
                                "least 0.2"),
    ("rmat:scale=0", r"scale must be an integer in \[1, 62\], e.g. rmat:scale=12"),
    ("rmat:a=0.6,b=0.3,c=0.3", r"a \+ b \+ c = 1.2 is more than 1"),
    ("rmat:symmetric=1", "symmetric must be true or false, e.g. rmat:symmetric=true"),
    ("csbm-sliced:classes=1", "classes must be an integer >= 2, e.g. csbm-sliced:classes=4"),
    ("rmat-sliced:edge_factor=0", "edge_factor must be an integer >= 1"),
])
def test_generator_options_are_checked(spec, message):
    with pytest.raises(DatasetError, match=message) as err:
        load_dataset(spec)
    assert str(err.value).startswith(f"dataset spec '{spec}': ")


def test_csbm_accuracy_needs_the_neighbours():
    """Nearest-centroid accuracy: weak from a node's own features, strong after averaging over
    neighbours -- the regime where dropping halo communication costs accuracy."""
    import scipy.sparse as sp
    g = load_dataset("csbm:nodes=2000,classes=4,seed=0")
    a = sp.csr_matrix((np.ones(g.num_edges), g.indices, g.indptr), shape=(2000, 2000))
    deg = np.diff(g.indptr)[:, None] + 1.0
    hop1 = (a @ g.features + g.features) / deg
    hop2 = (a @ hop1 + hop1) / deg

    def accuracy(z):
        tr, te, y = g.train_idx, g.test_idx, g.labels
        centroids = np.stack([z[tr][y[tr] == c].mean(0) for c in range(4)])
        pred = np.argmin(((z[te][:, None, :] - centroids[None]) ** 2).sum(-1), axis=1)
        return float(np.mean(pred == y[te]))

    own, one, two = accuracy(g.features), accuracy(hop1), accuracy(hop2)
    assert own < 0.6 and one > own + 0.25 and two > 0.9
