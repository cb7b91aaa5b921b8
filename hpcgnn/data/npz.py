"""Reader of the npz input format (docs/formats.md, 'Input graph')."""
from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from hpcgnn.data.errors import DatasetError
from hpcgnn.data.graph import Graph
from hpcgnn.data.validate import (FORMAT_HINT, as_int64, check_graph, num_classes_value,
                                  scalar_value)

REQUIRED = ("num_nodes", "adj_indptr", "adj_indices", "labels", "train_idx", "val_idx", "test_idx")
SPARSE_FEATURES = ("feat_indptr", "feat_indices", "feat_data", "feat_shape")


def _open(path: Path) -> np.lib.npyio.NpzFile:
    if not path.is_file():
        raise DatasetError(f"{path}: no such file; pass --dataset npz:PATH with an existing .npz "
                           f"file ({FORMAT_HINT})")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{path}: not a readable .npz file ({exc}); write it with "
                           f"numpy.savez ({FORMAT_HINT})") from exc


def _array(z, path: Path, key: str) -> np.ndarray:
    """``z[key]``; a damaged member (bad CRC, truncated) is a DatasetError naming the key."""
    try:
        return z[key]
    except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise DatasetError(f"{path}: cannot read key '{key}' ({exc}); rewrite the file "
                           f"({FORMAT_HINT})") from exc


def _int_array(z, path: Path, key: str) -> np.ndarray:
    a = _array(z, path, key)
    if a.dtype.kind not in "iu":
        raise DatasetError(f"{path}: key '{key}' has dtype {a.dtype}, expected int64; store "
                           f"it as an integer array ({FORMAT_HINT})")
    return as_int64(str(path), key, a)


def _features(z, path: Path, num_nodes: int) -> np.ndarray | sp.csr_matrix:
    keys = set(z.files)
    if "features" in keys:
        x = _array(z, path, "features")
        if x.dtype.kind not in "fiub":
            raise DatasetError(f"{path}: key 'features' has dtype {x.dtype}, expected float32")
        return x.astype(np.float32, copy=False)
    if all(k in keys for k in SPARSE_FEATURES):
        shape = tuple(int(s) for s in _int_array(z, path, "feat_shape").reshape(-1))
        if len(shape) != 2:
            raise DatasetError(f"{path}: feat_shape is {shape}, expected (num_nodes, F); store "
                               f"the sparse features' shape as two integers ({FORMAT_HINT})")
        indptr, indices = _int_array(z, path, "feat_indptr"), _int_array(z, path, "feat_indices")
        # a decreasing feat_indptr (a row of negative length) was taken, its rows garbled
        if indptr.ndim != 1 or indices.ndim != 1 or len(indptr) != shape[0] + 1 or \
                indptr[0] != 0 or indptr[-1] != len(indices) or bool(np.any(np.diff(indptr) < 0)) \
                or (indices.size and (indices.min() < 0 or indices.max() >= shape[1])):
            raise DatasetError(f"{path}: feat_indptr/feat_indices are not a CSR matrix of shape "
                               f"{shape} (feat_indptr: {shape[0]} + 1 offsets from 0, never "
                               f"decreasing, to len(feat_indices); feat_indices: columns in "
                               f"0..F-1); {FORMAT_HINT}")
        data = _array(z, path, "feat_data")
        if data.dtype.kind not in "fiub" or data.shape != indices.shape:
            raise DatasetError(f"{path}: feat_data has shape {data.shape} and dtype {data.dtype}; "
                               f"it must hold one float32 value per entry of feat_indices (shape "
                               f"{indices.shape}); rewrite the sparse keys ({FORMAT_HINT})")
        return sp.csr_matrix((data.astype(np.float32), indices, indptr), shape=shape)
    missing = [k for k in SPARSE_FEATURES if k not in keys]
    raise DatasetError(f"{path}: no features: add key 'features' (float32 N x F) or the sparse "
                       f"keys {list(SPARSE_FEATURES)} (missing {missing}); {FORMAT_HINT}")


def read_npz(path: str | Path, name: str | None = None) -> Graph:
    """Read and check an npz graph. Raises DatasetError naming the file, the key and the fix."""
    path = Path(path)
    with _open(path) as z:
        missing = [k for k in REQUIRED if k not in z.files]
        if missing:
            raise DatasetError(f"{path}: missing key(s) {missing} (it has {sorted(z.files)}); "
                               f"{FORMAT_HINT}")
        num_nodes = scalar_value(str(path), "num_nodes", _int_array(z, path, "num_nodes"))
        arrays = {k: _int_array(z, path, k) for k in REQUIRED[1:]}
        features = _features(z, path, num_nodes)
        num_classes = num_classes_value(str(path), _int_array(z, path, "num_classes")) \
            if "num_classes" in z.files else None
    graph = Graph(name=name or path.stem, num_nodes=num_nodes, indptr=arrays["adj_indptr"],
                  indices=arrays["adj_indices"], features=features, labels=arrays["labels"],
                  train_idx=arrays["train_idx"], val_idx=arrays["val_idx"],
                  test_idx=arrays["test_idx"], classes=num_classes)
    check_graph(graph, str(path), num_classes)
    return graph
