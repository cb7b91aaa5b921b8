"""The ``h5:PATH`` input: an HDF5 file with the npz input keys (docs/formats.md, 'Input graph'), so a
rank can read a row slice without loading the rest.

Datasets at the file's root: ``num_nodes`` (int64 scalar), ``adj_indptr``, ``adj_indices``,
``features`` (float32 ``N x F``, chunked by rows) or the sparse ``feat_indptr``,
``feat_indices``, ``feat_data``, ``feat_shape``, ``labels``, ``train_idx``, ``val_idx``,
``test_idx`` (int64). ``python -m preprocess convert --dataset SPEC --out FILE.h5`` writes one.

A slice of rows ``lo:hi`` reads ``adj_indptr[lo:hi+1]``, the matching run of ``adj_indices``,
feature rows ``lo:hi`` and ``labels[lo:hi]``; the split arrays are read in chunks and filtered,
so a rank holds O(N/P + E/P + chunk) of the input. The checks of the npz reader
(``hpcgnn.data.validate``) run on what the slice reads, chunk by chunk: every rank checks every
split id's range; repeats, unlabelled training nodes, labels and NaN features are checked by the
rank whose rows they fall in. An optional ``num_classes`` scalar bounds the labels, as in the
npz format.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np
import scipy.sparse as sp

from hpcgnn.data.errors import DatasetError, hdf5_fix
from hpcgnn.data.graph import Graph
from hpcgnn.data.npz import REQUIRED, SPARSE_FEATURES
from hpcgnn.data.shard import fsync_file
from hpcgnn.data.validate import (FORMAT_HINT, as_int64, check_features_shape, check_label_values,
                                   check_labels_shape, check_split_ids, fail_nonfinite,
                                   fail_repeat, fail_unlabelled_train, nonfinite_rows,
                                   num_classes_value, scalar_value, warn_unlabelled)

SPLITS = ("train_idx", "val_idx", "test_idx")
ONE_D = ("adj_indices", "feat_indices", "feat_data", "feat_shape")   # others' shapes: checked apart
READ_CHUNK = 1 << 22          # split-array entries read at once
CHECK_BYTES = 1 << 24         # feature bytes checked for NaN/inf at once
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
    classes: int | None = None  # the input's ``num_classes``, where it has one

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
                   graph.dense_features(np.arange(lo, hi)), graph.labels[lo:hi], masks,
                   graph.classes)


@contextmanager
def _open(path: Path) -> Iterator[h5py.File]:
    """The file, open for reading; HDF5's errors on a damaged file (OSError, KeyError,
    RuntimeError from a bad heap or object header) become a DatasetError naming it."""
    if not path.is_file():
        raise DatasetError(f"{path}: no such file; pass --dataset h5:PATH with an existing HDF5 "
                           f"input file ({H5_HINT})")
    try:
        with h5py.File(path, "r") as f:
            yield f
    except (OSError, KeyError, RuntimeError) as exc:
        fix = hdf5_fix(exc, f"the file is damaged or not an input file: {H5_HINT}")
        raise DatasetError(f"{path}: not a readable HDF5 file ({exc}); {fix}") from exc


def _dataset(f: h5py.File, path: Path, key: str, kinds: str = "iu") -> h5py.Dataset:
    if key not in f or not isinstance(f[key], h5py.Dataset):
        has = sorted(map(str, f.keys()))          # str: a damaged name reads as bytes
        raise DatasetError(f"{path}: missing dataset '{key}' (it has {has}); {H5_HINT} "
                           f"({FORMAT_HINT})")
    d = f[key]
    if d.dtype.kind not in kinds:
        raise DatasetError(f"{path}: dataset '{key}' has dtype {d.dtype}, expected "
                           f"{'int64' if kinds == 'iu' else 'float32'}; {H5_HINT}")
    return d


def _int(f, path, key, sel=slice(None)) -> np.ndarray:
    return as_int64(str(path), key, np.asarray(_dataset(f, path, key)[sel]))


def h5_num_nodes(path: str | os.PathLike) -> int:
    """``num_nodes`` of an h5 input file (checks that every required key is there)."""
    path = Path(path)
    with _open(path) as f:
        for key in REQUIRED:
            _dataset(f, path, key)
        if "features" not in f and not all(k in f for k in SPARSE_FEATURES):
            raise DatasetError(f"{path}: no features: add 'features' (float32 N x F) or "
                               f"{list(SPARSE_FEATURES)}; {H5_HINT}")
        for key in ONE_D:             # read by slices: a scalar was h5py's ValueError traceback
            if key in f and isinstance(f[key], h5py.Dataset) and f[key].ndim != 1:
                raise DatasetError(f"{path}: dataset '{key}' has shape {f[key].shape}, expected "
                                   f"1-D; {H5_HINT} ({FORMAT_HINT})")
        n = scalar_value(str(path), "num_nodes", np.asarray(f["num_nodes"][()]))
        if n >= 1:
            _check_row_counts(f, path, n)
    if n < 1:
        raise DatasetError(f"{path}: num_nodes is {n}; a graph needs at least one node")
    return n


def _check_row_counts(f: h5py.File, path: Path, n: int) -> None:
    """The per-node datasets hold ``n`` rows, checked on their shapes: a rank reads only its
    own rows, so a longer ``labels`` or ``features`` (another graph's) would pass unseen."""
    check_labels_shape(str(path), n, f["labels"].shape)
    if "features" in f:
        check_features_shape(str(path), n, _dataset(f, path, "features", "fiub").shape)
        return
    shape = tuple(int(s) for s in _int(f, path, "feat_shape").reshape(-1))
    check_features_shape(f"{path} (feat_shape)", n, shape)
    if _dataset(f, path, "feat_indptr").shape != (n + 1,):
        raise DatasetError(f"{path}: feat_indptr has shape {f['feat_indptr'].shape}, expected "
                           f"({n + 1},) = num_nodes + 1; {H5_HINT}")


def _check_finite(source: str, x: np.ndarray | sp.csr_matrix, row0: int) -> None:
    """No NaN/inf in ``x`` (rows ``row0..``), checked in blocks of CHECK_BYTES."""
    if sp.issparse(x):
        rows = nonfinite_rows(x)
    else:
        step = max(1, CHECK_BYTES // max(1, x.shape[1] * x.itemsize))
        rows = np.concatenate([a + nonfinite_rows(x[a:a + step])
                               for a in range(0, x.shape[0], step)] or [np.zeros(0, np.int64)])
    if rows.size:
        fail_nonfinite(source, rows.size, row0 + int(rows[0]))


def _slice_features(f, path: Path, lo: int, hi: int) -> np.ndarray:
    if "features" in f:
        x = np.asarray(_dataset(f, path, "features", "fiub")[lo:hi], dtype=np.float32)
        _check_finite(f"{path} (dataset 'features')", x, lo)
        return x
    shape = tuple(int(s) for s in _int(f, path, "feat_shape"))
    ptr = _int(f, path, "feat_indptr", slice(lo, hi + 1))
    if len(shape) != 2 or len(ptr) != hi - lo + 1 or bool(np.any(np.diff(ptr) < 0)):
        raise DatasetError(f"{path}: feat_shape/feat_indptr are not a CSR matrix of (num_nodes, "
                           f"F) rows (feat_shape {shape}); {H5_HINT}")
    cols = _int(f, path, "feat_indices", slice(ptr[0], ptr[-1]))
    data = np.asarray(_dataset(f, path, "feat_data", "fiub")[ptr[0]:ptr[-1]], dtype=np.float32)
    if len(cols) != ptr[-1] - ptr[0] or len(data) != len(cols):
        raise DatasetError(f"{path}: feat_indices holds {f['feat_indices'].shape[0]} entries "
                           f"and feat_data {f['feat_data'].shape[0]}; feat_indptr needs "
                           f"{int(ptr[-1])} of each; {H5_HINT}")
    if cols.size and (cols.min() < 0 or cols.max() >= shape[1]):
        raise DatasetError(f"{path}: feat_indices holds a column outside 0..{shape[1] - 1} "
                           f"(feat_shape {shape}); {H5_HINT}")
    x = sp.csr_matrix((data, cols, ptr - ptr[0]), shape=(hi - lo, shape[1]))
    _check_finite(f"{path} (dataset 'feat_data')", x, lo)
    return x.toarray()


def _slice_split(d: h5py.Dataset, path: Path, split: str, n: int, lo: int, hi: int) -> np.ndarray:
    """Rows ``lo:hi`` of a split as a mask, the split array read in chunks: every id in
    range, none of this slice's repeated."""
    if d.ndim != 1:
        check_split_ids(str(path), n, split, np.broadcast_to(np.int64(0), d.shape))
    m = np.zeros(hi - lo, dtype=bool)
    for start in range(0, d.shape[0], READ_CHUNK):
        idx = as_int64(str(path), split, np.asarray(d[start:start + READ_CHUNK]))
        check_split_ids(str(path), n, split, idx)
        local = np.sort(idx[(idx >= lo) & (idx < hi)] - lo)
        again = local[1:][local[1:] == local[:-1]]
        seen = local[m[local]]
        if again.size or seen.size:
            fail_repeat(str(path), split, lo + int((again if again.size else seen)[0]))
        m[local] = True
    return m


def _slice_masks(f, path: Path, n: int, lo: int, hi: int, labels: np.ndarray) -> dict:
    masks = {}
    for split in SPLITS:
        d = _dataset(f, path, split)
        m = _slice_split(d, path, split, n, lo, hi)
        unlabelled = np.flatnonzero(m & (labels < 0))
        if split == "train_idx" and unlabelled.size:
            fail_unlabelled_train(str(path), lo + int(unlabelled[0]))
        where = str(path) if (lo, hi) == (0, n) else f"{path} (rows {lo}:{hi})"
        warn_unlabelled(where, split, unlabelled.size, int(m.sum()))
        masks[split.replace("_idx", "_mask")] = m
    return masks


def _num_classes(f, path: Path) -> int | None:
    if "num_classes" not in f:
        return None
    return num_classes_value(str(path), np.asarray(_dataset(f, path, "num_classes")[()]))


def _slice_labels(f, path: Path, n: int, lo: int, hi: int) -> np.ndarray:
    """Rows ``lo:hi`` of ``labels``, whose shape ``h5_num_nodes`` checked (2-D multi-label
    targets are refused there)."""
    labels = _int(f, path, "labels", slice(lo, hi))
    if (top := _num_classes(f, path)) is not None:
        check_label_values(str(path), labels, top, True)
    else:
        check_label_values(str(path), labels, n, False)
    return labels


def read_h5_slice(path: str | os.PathLike, lo: int, hi: int, name: str | None = None) -> GraphSlice:
    """Rows ``lo:hi`` of an h5 input file, checked (CSR offsets, ids in range, shapes, and the
    npz reader's checks of labels, splits and features on what it reads)."""
    path = Path(path)
    n = h5_num_nodes(path)
    with _open(path) as f:
        if _dataset(f, path, "adj_indptr").shape != (n + 1,):
            raise DatasetError(f"{path}: adj_indptr has shape {f['adj_indptr'].shape}, expected "
                               f"({n + 1},) = num_nodes + 1; {H5_HINT}")
        ptr = _int(f, path, "adj_indptr", slice(lo, hi + 1))
        indices = _int(f, path, "adj_indices", slice(int(ptr[0]), int(ptr[-1])))
        local = ptr - ptr[0]
        if bool(np.any(np.diff(ptr) < 0)) or (lo == 0 and ptr[0] != 0) or \
                (hi == n and ptr[-1] != f["adj_indices"].shape[0]):
            raise DatasetError(f"{path}: adj_indptr is not a CSR row pointer (rows {lo}:{hi} "
                               f"decrease, or it does not start at 0 and end at "
                               f"len(adj_indices)); {H5_HINT}")
        if indices.size and (indices.min() < 0 or indices.max() >= n):
            bad = int(indices.min()) if indices.min() < 0 else int(indices.max())
            raise DatasetError(f"{path}: adj_indices holds node id {bad}, outside 0..{n - 1}; "
                               f"fix the file or num_nodes")
        labels = _slice_labels(f, path, n, lo, hi)       # row counts: h5_num_nodes checked
        feats = _slice_features(f, path, lo, hi)
        masks = _slice_masks(f, path, n, lo, hi, labels)
        classes = _num_classes(f, path)
    return GraphSlice(name or f"h5:{path}", n, lo, hi, local, indices, feats, labels, masks,
                      classes)


def read_h5(path: str | os.PathLike, name: str | None = None) -> Graph:
    """The whole graph of an h5 input file (the one-process path)."""
    s = read_h5_slice(path, 0, h5_num_nodes(path), name)
    splits = {k: np.flatnonzero(s.masks[k.replace("_idx", "_mask")]).astype(np.int64)
              for k in SPLITS}
    return Graph(name=s.name, num_nodes=s.num_nodes, indptr=s.indptr, indices=s.indices,
                 features=s.features, labels=s.labels, classes=s.classes, **splits)


def write_h5(graph: Graph, path: str | os.PathLike) -> None:
    """Write ``graph`` as an h5 input file, atomically (temporary name, then rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    rows = max(1, min(graph.num_nodes, (1 << 20) // max(1, 4 * graph.feature_dim)))
    try:
        # no chunk cache: each chunk is written as its dataset is made, so a failed write
        # (disk full) raises there, not when HDF5 flushes the cache on close (crashed h5py)
        with h5py.File(tmp, "w", rdcc_nbytes=0) as f:
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
            if graph.classes is not None:
                f["num_classes"] = np.int64(graph.classes)
            for split in SPLITS:
                f.create_dataset(split, data=getattr(graph, split).astype(np.int64),
                                 chunks=True if len(getattr(graph, split)) else None)
        fsync_file(tmp)                 # on disk before the name says it is complete
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
