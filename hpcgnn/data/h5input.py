"""The ``h5:PATH`` input: an HDF5 file with the npz input keys (docs/formats.md, 'Input graph'), so a
rank can read a row slice without loading the rest.

Datasets at the file's root: ``num_nodes`` (int64 scalar), ``adj_indptr``, ``adj_indices``,
``features`` (float32 ``N x F``, chunked by rows) or the sparse ``feat_indptr``,
``feat_indices``, ``feat_data``, ``feat_shape``, ``labels``, ``train_idx``, ``val_idx``,
``test_idx`` (int64). ``python -m preprocess convert --dataset SPEC --out FILE.h5`` writes one.

A slice of rows ``lo:hi`` reads ``adj_indptr[lo:hi+1]``, the matching run of ``adj_indices``,
feature rows ``lo:hi`` and ``labels[lo:hi]``; the split arrays are read in chunks and filtered,
so a rank holds O(N/P + E/P + chunk) of the input.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import scipy.sparse as sp

from hpcgnn.data.errors import DatasetError
from hpcgnn.data.graph import Graph
from hpcgnn.data.npz import REQUIRED, SPARSE_FEATURES
from hpcgnn.data.validate import FORMAT_HINT

SPLITS = ("train_idx", "val_idx", "test_idx")
READ_CHUNK = 1 << 22          # split-array entries read at once
H5_HINT = "write it with `python -m preprocess convert --dataset SPEC --out FILE.h5`"


@dataclass
class GraphSlice:
    """Rows ``lo:hi`` of a graph: their in-neighbour lists (global ids), features, labels and
    split masks. What one rank of the distributed preprocessing holds of the input."""

    name: str
    num_nodes: int
    lo: int
    hi: int
    indptr: np.ndarray          # int64 [hi - lo + 1], starts at 0
    indices: np.ndarray         # int64 [nnz], global ids
    features: np.ndarray        # float32 [hi - lo, F]
    labels: np.ndarray          # int64 [hi - lo]
    masks: dict                 # name -> bool [hi - lo] (train_mask, val_mask, test_mask)

    @classmethod
    def of_graph(cls, graph: Graph, lo: int, hi: int) -> "GraphSlice":
        """Rows ``lo:hi`` of an in-memory graph."""
        indptr = graph.indptr[lo:hi + 1] - graph.indptr[lo]
        masks = {}
        for split in SPLITS:
            idx = getattr(graph, split)
            m = np.zeros(hi - lo, dtype=bool)
            m[idx[(idx >= lo) & (idx < hi)] - lo] = True
            masks[split.replace("_idx", "_mask")] = m
        return cls(graph.name, graph.num_nodes, lo, hi, indptr,
                   graph.indices[graph.indptr[lo]:graph.indptr[hi]],
                   graph.dense_features(np.arange(lo, hi)), graph.labels[lo:hi], masks)


def _open(path: Path) -> h5py.File:
    if not path.is_file():
        raise DatasetError(f"{path}: no such file; pass --dataset h5:PATH with an existing HDF5 "
                           f"input file ({H5_HINT})")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise DatasetError(f"{path}: not a readable HDF5 file ({exc}); {H5_HINT}") from exc


def _dataset(f: h5py.File, path: Path, key: str, kinds: str = "iu") -> h5py.Dataset:
    if key not in f or not isinstance(f[key], h5py.Dataset):
        raise DatasetError(f"{path}: missing dataset '{key}' (it has {sorted(f.keys())}); "
                           f"{H5_HINT} ({FORMAT_HINT})")
    d = f[key]
    if d.dtype.kind not in kinds:
        raise DatasetError(f"{path}: dataset '{key}' has dtype {d.dtype}, expected "
                           f"{'int64' if kinds == 'iu' else 'float32'}; {H5_HINT}")
    return d


def _int(f, path, key, sel=slice(None)) -> np.ndarray:
    return np.asarray(_dataset(f, path, key)[sel], dtype=np.int64)


def h5_num_nodes(path: str | os.PathLike) -> int:
    """``num_nodes`` of an h5 input file (checks that every required key is there)."""
    path = Path(path)
    with _open(path) as f:
        for key in REQUIRED:
            _dataset(f, path, key)
        if "features" not in f and not all(k in f for k in SPARSE_FEATURES):
            raise DatasetError(f"{path}: no features: add 'features' (float32 N x F) or "
                               f"{list(SPARSE_FEATURES)}; {H5_HINT}")
        return int(np.asarray(f["num_nodes"][()]).reshape(-1)[0])


def _slice_features(f, path: Path, lo: int, hi: int) -> np.ndarray:
    if "features" in f:
        return np.asarray(_dataset(f, path, "features", "fiub")[lo:hi], dtype=np.float32)
    shape = tuple(int(s) for s in _int(f, path, "feat_shape"))
    ptr = _int(f, path, "feat_indptr", slice(lo, hi + 1))
    cols = _int(f, path, "feat_indices", slice(ptr[0], ptr[-1]))
    data = np.asarray(f["feat_data"][ptr[0]:ptr[-1]], dtype=np.float32)
    return sp.csr_matrix((data, cols, ptr - ptr[0]), shape=(hi - lo, shape[1])).toarray()


def _slice_masks(f, path: Path, lo: int, hi: int) -> dict:
    masks = {}
    for split in SPLITS:
        d, m = _dataset(f, path, split), np.zeros(hi - lo, dtype=bool)
        for start in range(0, d.shape[0], READ_CHUNK):
            idx = np.asarray(d[start:start + READ_CHUNK], dtype=np.int64)
            m[idx[(idx >= lo) & (idx < hi)] - lo] = True
        masks[split.replace("_idx", "_mask")] = m
    return masks


def read_h5_slice(path: str | os.PathLike, lo: int, hi: int, name: str | None = None) -> GraphSlice:
    """Rows ``lo:hi`` of an h5 input file, checked (CSR offsets, ids in range, shapes)."""
    path = Path(path)
    n = h5_num_nodes(path)
    with _open(path) as f:
        if _dataset(f, path, "adj_indptr").shape != (n + 1,):
            raise DatasetError(f"{path}: adj_indptr has shape {f['adj_indptr'].shape}, expected "
                               f"({n + 1},) = num_nodes + 1; {H5_HINT}")
        ptr = _int(f, path, "adj_indptr", slice(lo, hi + 1))
        indices = _int(f, path, "adj_indices", slice(int(ptr[0]), int(ptr[-1])))
        local = ptr - ptr[0]
        if bool(np.any(np.diff(ptr) < 0)) or (hi == n and ptr[-1] != f["adj_indices"].shape[0]):
            raise DatasetError(f"{path}: adj_indptr is not a CSR row pointer (rows {lo}:{hi} "
                               f"decrease, or it does not end at len(adj_indices)); {H5_HINT}")
        if indices.size and (indices.min() < 0 or indices.max() >= n):
            bad = int(indices.min()) if indices.min() < 0 else int(indices.max())
            raise DatasetError(f"{path}: adj_indices holds node id {bad}, outside 0..{n - 1}; "
                               f"fix the file or num_nodes")
        feats = _slice_features(f, path, lo, hi)
        labels = _int(f, path, "labels", slice(lo, hi))
        if feats.shape[0] != hi - lo or labels.shape[0] != hi - lo:
            raise DatasetError(f"{path}: features/labels have fewer than num_nodes = {n} rows; "
                               f"{H5_HINT}")
        masks = _slice_masks(f, path, lo, hi)
    return GraphSlice(name or f"h5:{path}", n, lo, hi, local, indices, feats, labels, masks)


def read_h5(path: str | os.PathLike, name: str | None = None) -> Graph:
    """The whole graph of an h5 input file (the one-process path)."""
    s = read_h5_slice(path, 0, h5_num_nodes(path), name)
    splits = {k: np.flatnonzero(s.masks[k.replace("_idx", "_mask")]).astype(np.int64)
              for k in SPLITS}
    return Graph(name=s.name, num_nodes=s.num_nodes, indptr=s.indptr, indices=s.indices,
                 features=s.features, labels=s.labels, **splits)


def write_h5(graph: Graph, path: str | os.PathLike) -> None:
    """Write ``graph`` as an h5 input file, atomically (temporary name, then rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    rows = max(1, min(graph.num_nodes, (1 << 20) // max(1, 4 * graph.feature_dim)))
    try:
        with h5py.File(tmp, "w") as f:
            f["num_nodes"] = np.int64(graph.num_nodes)
            f.create_dataset("adj_indptr", data=graph.indptr.astype(np.int64), chunks=True)
            f.create_dataset("adj_indices", data=graph.indices.astype(np.int64), chunks=True)
            if sp.issparse(graph.features):
                x = sp.csr_matrix(graph.features)
                for key, arr in (("feat_indptr", x.indptr), ("feat_indices", x.indices)):
                    f.create_dataset(key, data=arr.astype(np.int64), chunks=True)
                f.create_dataset("feat_data", data=x.data.astype(np.float32), chunks=True)
                f["feat_shape"] = np.asarray(x.shape, dtype=np.int64)
            else:
                f.create_dataset("features", data=graph.dense_features(),
                                 chunks=(rows, max(1, graph.feature_dim)))
            f.create_dataset("labels", data=graph.labels.astype(np.int64), chunks=True)
            for split in SPLITS:
                f.create_dataset(split, data=getattr(graph, split).astype(np.int64),
                                 chunks=True if len(getattr(graph, split)) else None)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
