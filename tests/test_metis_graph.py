"""``metis-graph:PATH,...``: METIS's graph format read against the edge lists the test writes
(every fmt variant, comments, empty lines, weights ignored), every bad file refused naming the
file, the line and the fix, stand-in labels that follow the topology, the preprocess CLI, and
METIS's own example meshes (Debian's libmetis-doc) read with their header's counts."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from _graphs import assert_reconstructs, edge_keys, reconstruct
from hpcgnn.data.datasets import load_dataset, parse_spec
from hpcgnn.data import metisgraph
from hpcgnn.data.errors import DatasetError
from hpcgnn.data.metisgraph import read_metis_graph
from preprocess.__main__ import main

# METIS 5 manual, figure 2(b): 7 vertices, 11 edges, each vertex's neighbours as printed there
MANUAL = "7 11\n5 3 2\n1 3 4\n5 4 2 1\n2 3 6 7\n1 3 6\n5 4 7\n6 4\n"
MANUAL_LISTS = [[5, 3, 2], [1, 3, 4], [5, 4, 2, 1], [2, 3, 6, 7], [1, 3, 6], [5, 4, 7], [6, 4]]


def expected_csr(n: int, lists: list[list[int]]) -> tuple[list[int], list[int]]:
    """0-based CSR of 1-based neighbour lists, rows sorted: what the reader must return."""
    indptr, indices = [0], []
    for nbrs in lists:
        indices += sorted(v - 1 for v in nbrs)
        indptr.append(len(indices))
    assert len(indptr) == n + 1
    return indptr, indices


def random_lists(n: int, m: int, seed: int) -> list[list[int]]:
    """1-based neighbour lists of ``m`` distinct random edges (vertex ``n`` left isolated)."""
    rng = np.random.default_rng(seed)
    edges: set = set()
    while len(edges) < m:
        u, v = sorted(int(x) for x in rng.integers(1, n, size=2))
        if u != v:
            edges.add((u, v))
    lists: list[list[int]] = [[] for _ in range(n)]
    for u, v in edges:
        lists[u - 1].append(v)
        lists[v - 1].append(u)
    for nbrs in lists:
        rng.shuffle(nbrs)
    return lists


def write_graph(path, lists, m, fmt="", ncon=None, seed=0, newline="\n") -> str:
    """The file METIS's manual describes, sizes and weights random, comments sprinkled in."""
    rng = np.random.default_rng(seed)
    digits = fmt.rjust(3, "0") if fmt else "000"
    header = " ".join(str(x) for x in [len(lists), m] + ([fmt] if fmt else [])
                      + ([ncon] if ncon is not None else []))
    out = ["% written by tests/test_metis_graph.py", header]
    for i, nbrs in enumerate(lists):
        words = []
        if digits[0] == "1":
            words.append(int(rng.integers(1, 9)))
        if digits[1] == "1":
            words += [int(w) for w in rng.integers(0, 9, size=ncon or 1)]
        for v in nbrs:
            words.append(v)
            if digits[2] == "1":
                words.append(int(rng.integers(1, 99)))
        out.append(" ".join(map(str, words)))
        if i == 2:
            out.append("%   a comment between vertex lines")
    path.write_text(newline.join(out) + newline)
    return str(path)


def test_the_manuals_example(tmp_path):
    path = tmp_path / "manual.graph"
    path.write_text(MANUAL)
    indptr, indices = read_metis_graph(path)
    assert (indptr.tolist(), indices.tolist()) == expected_csr(7, MANUAL_LISTS)
    assert indptr.dtype == indices.dtype == np.int64


@pytest.mark.parametrize("fmt, ncon", [("", None), ("0", None), ("000", None), ("1", None),
                                       ("001", None), ("10", None), ("010", None), ("010", 3),
                                       ("11", 2), ("011", None), ("100", None), ("101", None),
                                       ("110", 2), ("111", None), ("111", 3)])
def test_every_fmt_reads_the_edges_and_ignores_weights(tmp_path, monkeypatch, fmt, ncon):
    monkeypatch.setattr(metisgraph, "LINES", 7)        # read 7 vertex lines at a time
    lists = random_lists(40, 90, seed=len(fmt) + (ncon or 0))
    path = write_graph(tmp_path / "g.graph", lists, 90, fmt, ncon,
                       newline="\r\n" if fmt == "111" else "\n")
    indptr, indices = read_metis_graph(path)
    assert (indptr.tolist(), indices.tolist()) == expected_csr(40, lists)
    assert indptr[-1] - indptr[-2] == 0                        # the isolated vertex's empty line


def _case(tmp_path, text: str) -> str:
    path = tmp_path / "bad.graph"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, message", [
    ("", r"no header line 'n m \[fmt \[ncon\]\]'; the file is empty or only comments"),
    ("% only\n% comments\n", "the file is empty or only comments"),
    ("7 eleven\n", r"line 1: the header '7 eleven' is not 'n m \[fmt \[ncon\]\]'"),
    ("7 11 0 1 5\n", r"line 1: the header .* is not 'n m \[fmt \[ncon\]\]' \(2 to 4"),
    ("%c\n3 2 2\n", r"line 2: fmt 2 is not up to three digits 0 or 1 .*fix the header"),
    ("3 2 1011\n", "line 1: fmt 1011 is not up to three digits"),
    ("3 2 001 2\n2\n1 3\n2\n", r"line 1: ncon 2 is given but fmt 001 has no vertex weights"),
    ("0 0\n", "n is 0; a graph needs at least one vertex; fix the header"),
    ("3 2 10 0\n", r"line 1: ncon is 0; give ncon >= 1 vertex weights or drop it"),
    ("4 2\n2\n1 3\n2\n", r"line 1\) says 4 vertices but the file has 3 vertex line\(s\) after "
                         r"the header; a vertex without neighbours is an empty line"),
    ("3 2\n2\n1 3\n2\n1\n", "has a line 5 past the 3 vertex lines"),
    ("3 2 1\n2 1\n1 1 3\n2 1\n", r"line 3 \(vertex 2\): 3 value\(s\) do not fit fmt 001, ncon 1: "
                                 r"a line is 0 leading value\(s\) .* then neighbour, edge weight "
                                 r"pairs; fix the line or the header's fmt"),
    ("3 2 1\n2 1\n1 1 3 1\n2\n", r"line 4 \(vertex 3\): 1 value\(s\) do not fit fmt 001"),
    ("3 2\n2\n1 3\n%\n2.0\n", r"line 5 \(vertex 3\): '2.0' holds a value that is not an"),
    ("3 2 11 2\n1\n1 1 1 3\n1 1 2\n", r"line 2 \(vertex 1\): 1 value\(s\) do not fit fmt 011, "
                                      r"ncon 2: a line is 2 leading"),
    ("3 2\n2\n1 3.5\n2\n", r"line 3 \(vertex 2\): '1 3.5' holds a value that is not an integer"),
    ("3 2\n2\n1 x\n2\n", r"is not an integer \(or not below 2\^63\); METIS's format has "
                         "integers only"),
    ("3 2 1\n2 1\n1 99999999999999999999 3 1\n2 1\n", r"line 3 \(vertex 2\): .* holds a value "
                                                     r"that is not an integer \(or not below"),
    ("3 2\n2\n1 4\n2\n", r"line 3 \(vertex 2\): neighbour 4 is out of range 1..3 \(ids are "
                         r"1-based"),
    ("3 2\n2\n0 3\n2\n", r"line 3 \(vertex 2\): neighbour 0 is out of range 1..3"),
    ("3 2\n2\n1 3\n%\n2 3\n", r"line 5 \(vertex 3\): lists itself as a neighbour; .*remove it"),
    ("3 2\n2\n1 3 1\n2\n", r"line 3 \(vertex 2\): lists neighbour 1 twice"),
    ("3 2\n2 3\n1 3\n2\n", r"line 2 \(vertex 1\): lists neighbour 3, but vertex 3's line 4 does "
                           r"not list 1; an undirected graph lists each edge at both ends"),
    ("3 3\n2\n1 3\n2\n", r"the header says m = 3 edges but the lines list 2 \(each edge at both "
                         r"ends, 4 entries\); fix the header's m to 2"),
    ("%\n% c\n3 1\n2\n1 3\n2\n", "the header says m = 1 edges but the lines list 2"),
])
def test_bad_files_name_the_file_the_line_and_the_fix(tmp_path, monkeypatch, text, message):
    monkeypatch.setattr(metisgraph, "LINES", 2)        # lines past the first chunk named right
    path = _case(tmp_path, text)
    with pytest.raises(DatasetError, match=message) as err:
        read_metis_graph(path)
    assert str(err.value).startswith(path), err.value
    # through the spec too: the same message, before any label or feature is made
    with pytest.raises(DatasetError, match=re.escape(str(err.value))):
        load_dataset(f"metis-graph:{path},classes=3")


def test_a_missing_file_and_bad_specs(tmp_path):
    with pytest.raises(DatasetError, match=r"nope.graph: no such file; pass --dataset "
                                           r"metis-graph:PATH with an existing file"):
        load_dataset(f"metis-graph:{tmp_path / 'nope.graph'}")
    assert parse_spec("metis-graph:/d/4elt.graph,features=8,classes=3") == \
        ("metis-graph", {"path": "/d/4elt.graph", "features": 8, "classes": 3})
    for spec in ("metis-graph:", "metis-graph:classes=3"):
        with pytest.raises(DatasetError, match="no path first; write metis-graph:PATH,"):
            load_dataset(spec)
    path = _case(tmp_path, MANUAL)
    with pytest.raises(DatasetError, match=r"unknown option\(s\) \['nodes'\]"):
        load_dataset(f"metis-graph:{path},nodes=5")
    with pytest.raises(DatasetError, match=r"classes must be an integer >= 2, e\.g\. "
                                           r"metis-graph:PATH,classes=4"):
        load_dataset(f"metis-graph:{path},classes=1")
    with pytest.raises(DatasetError, match=r"train=0.05 of 7 nodes is no training node"):
        load_dataset(f"metis-graph:{path},train=0.05")


def grid_lists(side: int) -> list[list[int]]:
    """A side x side grid mesh, 1-based neighbour lists."""
    lists = []
    for r in range(side):
        for c in range(side):
            nbrs = [(r + dr) * side + c + dc + 1 for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1))
                    if 0 <= r + dr < side and 0 <= c + dc < side]
            lists.append(nbrs)
    return lists


def test_labels_follow_the_mesh_and_features_the_labels(tmp_path):
    side = 60
    path = write_graph(tmp_path / "grid.graph", grid_lists(side), 2 * side * (side - 1))
    spec = f"metis-graph:{path},features=16,classes=4,seed=5"
    g = load_dataset(spec)
    n = side * side
    assert (g.num_nodes, g.num_edges) == (n, 4 * side * (side - 1))
    rows = np.repeat(np.arange(n), np.diff(g.indptr))
    same = float(np.mean(g.labels[rows] == g.labels[g.indices]))
    assert same > 0.75, same                          # random labels: 0.25
    counts = np.bincount(g.labels, minlength=4)
    assert counts.min() > n / 10, counts
    # class-dependent features: each class's mean lies nearest its own class's mean direction
    x = g.dense_features()
    means = np.stack([x[g.labels == c].mean(axis=0) for c in range(4)])
    assert (np.argmax(means @ means.T, axis=1) == np.arange(4)).all()
    # a neighbour average classifies better than a node's own features (nearest class mean)
    avg = np.zeros_like(x)
    np.add.at(avg, rows, x[g.indices])
    own = np.mean(np.argmax(x @ means.T, axis=1) == g.labels)
    mixed = np.mean(np.argmax((x + avg) @ means.T, axis=1) == g.labels)
    assert mixed > own + 0.1, (own, mixed)
    # seeded: the same spec gives the same graph, another seed other labels
    again = load_dataset(spec)
    np.testing.assert_array_equal(again.labels, g.labels)
    np.testing.assert_array_equal(again.features, g.features)
    np.testing.assert_array_equal(again.train_idx, g.train_idx)
    assert not np.array_equal(load_dataset(spec.replace("seed=5", "seed=6")).labels, g.labels)
    assert len(g.train_idx) == round(0.1 * n) and len(g.val_idx) == round(0.2 * n)


@pytest.mark.parametrize("partitioner", ["metis", "random"])
def test_preprocess_cli_writes_a_set_that_verifies(tmp_path, partitioner):
    """METIS in a real ``python -m preprocess`` process, random through the same ``main``."""
    lists = random_lists(300, 900, seed=1)
    path = write_graph(tmp_path / "g.graph", lists, 900, "011", 2)
    spec = f"metis-graph:{path},features=8,classes=3"
    out = tmp_path / "set"
    argv = ["--dataset", spec, "--parts", "3", "--partitioner", partitioner, "--out", str(out)]
    if partitioner == "metis":
        proc = subprocess.run([sys.executable, "-m", "preprocess", *argv], capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.splitlines()[0].endswith(f"{spec}: reading 0.0 MiB"), proc.stderr
        assert "300 vertices, 900 undirected edges (weights, if any, ignored)" in proc.stderr
    else:
        assert main(argv + ["-q"]) == 0
    assert main(["verify", "-q", str(out)]) == 0
    assert_reconstructs(out, load_dataset(spec))
    indptr, indices = expected_csr(300, lists)
    np.testing.assert_array_equal(reconstruct(out)["edges"],
                                  edge_keys(np.array(indptr), np.array(indices), 300))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["input"]["size"] == (tmp_path / "g.graph").stat().st_size     # sbatch's reuse


@pytest.mark.parametrize("name", ["4elt.graph", "test.mgraph", "copter2.graph", "mdual.graph"])
def test_metis_example_graphs_have_their_headers_counts(metis_graphs, name):
    """4elt (a 2D mesh), test.mgraph (two vertex weights), copter2 and mdual (258k vertices,
    read in about a second: no per-edge Python loop)."""
    path = metis_graphs / name
    header = next(ln for ln in path.read_text().splitlines() if not ln.startswith("%")).split()
    indptr, indices = read_metis_graph(path)
    n, m = int(header[0]), int(header[1])
    assert len(indptr) == n + 1 and len(indices) == 2 * m
    keys = edge_keys(indptr, indices, n)
    np.testing.assert_array_equal(keys, np.sort((keys % n) * n + keys // n))    # symmetric
