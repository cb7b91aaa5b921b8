"""Test helpers for preprocessing: small hand-made graphs and a shard-set reconstructor."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from hpcgnn.data.clean import edge_rows
from hpcgnn.data.graph import Graph
from hpcgnn.data.shard import read_meta, read_shard


def graph_from_edges(n: int, edges: list[tuple[int, int]], features: int = 3,
                     name: str = "toy") -> Graph:
    """A symmetric Graph over ``n`` nodes from undirected ``edges`` (already simple)."""
    e = np.array(edges, dtype=np.int64).reshape(-1, 2)
    dst = np.concatenate([e[:, 0], e[:, 1]])
    src = np.concatenate([e[:, 1], e[:, 0]])
    order = np.lexsort((src, dst))
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    rng = np.random.default_rng(n)
    labels = np.arange(n, dtype=np.int64) % 3
    return Graph(name=name, num_nodes=n, indptr=indptr, indices=src[order],
                 features=rng.standard_normal((n, features)).astype(np.float32), labels=labels,
                 train_idx=np.arange(0, n, 3, dtype=np.int64),
                 val_idx=np.arange(1, n, 3, dtype=np.int64),
                 test_idx=np.arange(2, n, 3, dtype=np.int64))


def two_components() -> Graph:
    """A triangle (nodes 0-2) and a path 3-4-5-6-7: a part can own a whole component."""
    return graph_from_edges(8, [(0, 1), (1, 2), (0, 2), (3, 4), (4, 5), (5, 6), (6, 7)])


METIS_EXAMPLES = "usr/share/doc/libmetis-dev/examples/graphs"   # Debian's libmetis-doc


@functools.cache
def metis_examples() -> tuple[Path | None, str]:
    """The folder of METIS's example graphs (4elt.graph, ...) from Debian's ``libmetis-doc``, or
    (None, why not). When missing it is installed with apt-get as root or in CI (as
    ``libptscotch-dev`` in test_preprocess_dist.py); where dpkg is told to leave out
    /usr/share/doc (minimal Ubuntu images) the package is unpacked into a temporary folder."""
    installed = Path("/") / METIS_EXAMPLES
    if (installed / "4elt.graph").is_file():
        return installed, ""
    if not (os.geteuid() == 0 or os.environ.get("CI") == "true") or not shutil.which("apt-get"):
        return None, ("METIS's example graphs not installed (apt-get install libmetis-doc); "
                      "installed automatically only as root or with CI=true")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    unpacked = Path(tempfile.mkdtemp(prefix="libmetis-doc-"))
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "libmetis-doc"],
                ["apt-get", "download", "-q", "libmetis-doc"]):
        if (installed / "4elt.graph").is_file():
            return installed, ""
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                             stdin=subprocess.DEVNULL, cwd=unpacked)
        if res.returncode != 0:
            return None, f"{' '.join(cmd)} failed: {(res.stdout + res.stderr)[-500:]}"
    for deb in unpacked.glob("libmetis-doc_*.deb"):
        subprocess.run(["dpkg", "-x", str(deb), str(unpacked)], check=True, timeout=60)
    found = unpacked / METIS_EXAMPLES
    return (found, "") if (found / "4elt.graph").is_file() else \
        (None, f"libmetis-doc installed, but no {installed / '4elt.graph'}")


def edge_keys(indptr: np.ndarray, indices: np.ndarray, n: int) -> np.ndarray:
    return np.sort(edge_rows(indptr) * n + indices)


def reconstruct(directory: str | Path) -> dict[str, np.ndarray]:
    """The whole graph back from a shard set: sorted edge keys ``dst * N + src``, features,
    labels, masks and degrees, indexed by global id."""
    directory = Path(directory)
    meta = read_meta(directory)
    n, k = meta["num_nodes"], meta["num_parts"]
    out = {"features": np.full((n, meta["feature_dim"]), np.nan, dtype=np.float32),
           "label": np.full(n, -2, dtype=np.int64), "degree": np.full(n, -1, dtype=np.int64)}
    for m in ("train_mask", "val_mask", "test_mask"):
        out[m] = np.zeros(n, dtype=bool)
    keys = []
    for p in range(k):
        s = read_shard(directory / meta["parts"][p]["file"], part_id=p, num_parts=k)
        to_global = np.concatenate([s.global_id, s.halo_global_id])
        rows = np.repeat(s.global_id, np.diff(s.indptr))
        keys.append(rows * n + to_global[s.indices])
        for name in ("features", "label", "degree", "train_mask", "val_mask", "test_mask"):
            out[name][s.global_id] = getattr(s, name)
    out["edges"] = np.sort(np.concatenate(keys))
    return out


def assert_reconstructs(directory: str | Path, graph: Graph) -> None:
    """The shard set holds exactly ``graph``: edges, features, labels, split, degrees."""
    got = reconstruct(directory)
    n = graph.num_nodes
    np.testing.assert_array_equal(got["edges"], edge_keys(graph.indptr, graph.indices, n))
    np.testing.assert_array_equal(got["features"], graph.dense_features())
    np.testing.assert_array_equal(got["label"], graph.labels)
    np.testing.assert_array_equal(got["degree"], graph.in_degree())
    for name in ("train", "val", "test"):
        np.testing.assert_array_equal(np.nonzero(got[f"{name}_mask"])[0],
                                      np.sort(getattr(graph, f"{name}_idx")))


def graph_arrays(n=5, **override) -> dict:
    """The arrays of a valid input graph (a 5-cycle), with keys replaced or removed (None)."""
    src = np.arange(n)
    dst = (src + 1) % n
    rows, cols = np.r_[dst, src], np.r_[src, dst]
    order = np.lexsort((cols, rows))
    arrays = {"num_nodes": np.int64(n),
              "adj_indptr": np.r_[0, np.cumsum(np.bincount(rows, minlength=n))].astype(np.int64),
              "adj_indices": cols[order].astype(np.int64),
              "features": np.arange(n * 2, dtype=np.float32).reshape(n, 2),
              "labels": np.arange(n, dtype=np.int64) % 2,
              "train_idx": np.array([0, 1]), "val_idx": np.array([2]),
              "test_idx": np.array([3, 4])}
    arrays.update(override)
    return {k: v for k, v in arrays.items() if v is not None}


def save_npz(path, n=5, **override):
    """A valid npz graph (a 5-cycle), with keys replaced or removed (value None)."""
    np.savez(path, **graph_arrays(n, **override))
    return path


def save_h5(path, n=5, **override):
    """The same graph as an ``h5:`` input file."""
    import h5py
    with h5py.File(path, "w") as f:
        for k, v in graph_arrays(n, **override).items():
            f[k] = v
    return path


def partly_labelled_npz(path, n: int = 80, classes: int = 3, seed: int = 5) -> dict:
    """An undirected random graph whose val/test splits include unlabelled nodes (-1), with
    features that carry the class (so a trained model gets some right). Returns the arrays."""
    rng = np.random.default_rng(seed)
    cls = rng.integers(0, classes, n)
    a = np.triu((rng.random((n, n)) < 0.06) | (cls[:, None] == cls[None, :]) & (rng.random((n, n)) < 0.1), 1)
    a = a | a.T
    labels = cls.astype(np.int64)
    order = rng.permutation(n)
    train, val, test = order[:30], order[30:55], order[55:]
    labels[val[::3]] = -1                                    # unlabelled nodes inside val/test
    labels[test[::4]] = -1
    feats = (np.eye(classes)[cls] + 0.8 * rng.standard_normal((n, classes))).astype(np.float32)
    indptr = np.r_[0, np.cumsum(a.sum(axis=1))].astype(np.int64)
    arrays = {"num_nodes": np.int64(n), "adj_indptr": indptr,
              "adj_indices": np.nonzero(a)[1].astype(np.int64), "features": feats, "labels": labels,
              "train_idx": np.sort(train), "val_idx": np.sort(val), "test_idx": np.sort(test)}
    np.savez(path, **arrays)
    return arrays


def dense_gcn(arrays: dict, state: dict) -> tuple[np.ndarray, np.ndarray]:
    """(last hidden layer's output after ReLU, logits) of a GCN with ``state``'s weights on the
    whole graph, float64: ``D^-1/2 (A + I) D^-1/2 H W + b`` per layer (Kipf & Welling)."""
    n = int(arrays["num_nodes"])
    a = np.zeros((n, n))
    rows = np.repeat(np.arange(n), np.diff(arrays["adj_indptr"]))
    a[rows, arrays["adj_indices"]] = 1.0
    a += np.eye(n)
    d = 1.0 / np.sqrt(a.sum(axis=1))
    a_hat = d[:, None] * a * d[None, :]
    h, hidden, layers = arrays["features"].astype(np.float64), None, 0
    while f"layers.{layers}.weight" in state:
        layers += 1
    for i in range(layers):
        w, b = (state[f"layers.{i}.{k}"].double().numpy() for k in ("weight", "bias"))
        h = a_hat @ h @ w + b
        if i < layers - 1:
            h = np.maximum(h, 0.0)
            hidden = h
    return hidden, h


def tamper(directory, part, h5path, change, **entry):
    """Rewrite one dataset of one part in place and re-sign it in meta.json, so only the
    independent checks (not the checksum) can notice; ``entry``: fields of the part's meta.json
    entry to set (None: remove)."""
    import h5py
    from hpcgnn.data.shard import sha256_file, write_meta
    path = Path(directory) / f"part-{part:05d}.h5"
    with h5py.File(path, "r+") as f:
        data = f[h5path][...]
        del f[h5path]
        f.create_dataset(h5path, data=change(data))
    meta = read_meta(directory)
    meta["parts"][part]["sha256"] = sha256_file(path)
    for key, value in entry.items():
        meta["parts"][part].pop(key) if value is None else meta["parts"][part].update({key: value})
    write_meta(directory, meta)


def can_mount_tmpfs() -> bool:
    """A private mount namespace with a tmpfs in it (root, util-linux unshare)."""
    import shutil
    import subprocess
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def unwritable_dir(tmp_path: Path) -> Path:
    """A folder below which nothing can be made: read-only to this user, or (as root, whom
    permissions do not stop) in sysfs; skips the test where there is none."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        return ro / "s"
    if not os.path.isdir("/sys/kernel"):
        pytest.skip("running as root without /sys: no folder that root cannot write to")
    return Path("/sys/kernel/hpcgnn-test") / "s"
