"""Checks every reader runs on the graph it built; an error names the file, the field, the fix."""
from __future__ import annotations

import logging

import numpy as np
import scipy.sparse as sp

from hpcgnn.data.errors import DatasetError
from hpcgnn.data.graph import Graph

FORMAT_HINT = "see docs/formats.md, 'Input graph', for the npz input format"
log = logging.getLogger("hpcgnn.data")


def _fail(source: str, what: str, fix: str) -> None:
    raise DatasetError(f"{source}: {what}; {fix}")


def as_int64(source: str, key: str, a: np.ndarray) -> np.ndarray:
    """``a`` (any integer dtype) as int64; a uint64 value past int64's range would wrap to a
    negative id that later checks quoted as the file's value."""
    if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
        _fail(source, f"{key} holds {int(a.max())} (uint64), past int64's largest value",
              f"every id and count must fit int64; store it as int64; {FORMAT_HINT}")
    return a.astype(np.int64, copy=False)


def check_csr(source: str, num_nodes: int, indptr: np.ndarray, indices: np.ndarray) -> None:
    """``adj_indptr``/``adj_indices`` form a CSR over ``num_nodes`` rows with ids in range."""
    if num_nodes < 1:
        _fail(source, f"num_nodes is {num_nodes}", "a graph needs at least one node")
    if indptr.ndim != 1 or len(indptr) != num_nodes + 1:
        _fail(source, f"adj_indptr has shape {indptr.shape}, expected ({num_nodes + 1},)",
              f"it must hold num_nodes + 1 row offsets; {FORMAT_HINT}")
    if indices.ndim != 1:        # a scalar was a TypeError; a 2-D array was blamed on adj_indptr
        _fail(source, f"adj_indices has shape {indices.shape}, expected 1-D",
              f"it lists every row's neighbour ids, one row after another; {FORMAT_HINT}")
    if indptr[0] != 0 or indptr[-1] != len(indices) or bool(np.any(np.diff(indptr) < 0)):
        _fail(source, "adj_indptr is not a CSR row pointer (must start at 0, never decrease, "
              f"and end at len(adj_indices) = {len(indices)})", FORMAT_HINT)
    if indices.size and (indices.min() < 0 or indices.max() >= num_nodes):
        bad = int(indices.min()) if indices.min() < 0 else int(indices.max())
        _fail(source, f"adj_indices holds node id {bad}, outside 0..{num_nodes - 1}",
              "every neighbour id must be a node of the graph; fix the file or num_nodes")


def scalar_value(source: str, key: str, value: np.ndarray) -> int:
    """The one value of a count key (``num_nodes``, ``num_classes``: a scalar, or an array of
    one element)."""
    if value.size != 1:
        _fail(source, f"{key} has shape {value.shape}, expected a scalar",
              f"store the count alone (numpy.int64(...)); {FORMAT_HINT}")
    return int(value.reshape(-1)[0])


def num_classes_value(source: str, value: np.ndarray) -> int:
    """The optional ``num_classes`` key: one integer >= 1."""
    classes = scalar_value(source, "num_classes", value)
    if classes < 1:
        _fail(source, f"num_classes is {classes}",
              "it must be the class count, >= 1 (or leave the key out: the largest label + 1)")
    return classes


def check_features_shape(source: str, num_nodes: int, shape: tuple) -> None:
    if len(shape) != 2 or shape[0] != num_nodes:
        _fail(source, f"features have shape {tuple(shape)}, expected ({num_nodes}, F)",
              "one feature row per node")
    if shape[1] < 1:          # meta.json's feature_dim would be 0, which no reader takes
        _fail(source, f"features have shape {tuple(shape)}, no feature column",
              "give every node at least one feature (a constant 1 if there is none)")


def check_labels_shape(source: str, num_nodes: int, shape: tuple) -> None:
    if tuple(shape) != (num_nodes,):
        _fail(source, f"labels have shape {tuple(shape)}, expected ({num_nodes},)",
              "one label per node, -1 for unlabelled")


def check_features(source: str, num_nodes: int, features: np.ndarray | sp.csr_matrix) -> None:
    """Features are ``[num_nodes, F]`` and finite."""
    check_features_shape(source, num_nodes, features.shape)
    rows = nonfinite_rows(features)
    if rows.size:
        fail_nonfinite(source, rows.size, int(rows[0]))


def nonfinite_rows(features: np.ndarray | sp.csr_matrix) -> np.ndarray:
    """The rows (ascending) that hold a NaN or inf."""
    if sp.issparse(features):
        bad = ~np.isfinite(features.data)
        if not bad.any():
            return np.zeros(0, dtype=np.int64)
        rows = np.repeat(np.arange(features.shape[0]), np.diff(features.indptr))
        return np.unique(rows[bad])
    return np.flatnonzero(~np.isfinite(features).all(axis=1))


def fail_nonfinite(source: str, count: int, first: int) -> None:
    _fail(source, f"features hold NaN or inf (in {count} rows, first row {first})",
          "replace them (e.g. with 0) before preprocessing")


def check_labels(source: str, num_nodes: int, labels: np.ndarray,
                 num_classes: int | None = None) -> None:
    """Labels are ``[num_nodes]``, -1 (unlabelled) or a class id in range."""
    check_labels_shape(source, num_nodes, labels.shape)
    check_label_values(source, labels, num_nodes if num_classes is None else num_classes,
                       num_classes is not None)


def check_label_values(source: str, labels: np.ndarray, top: int, is_num_classes: bool) -> None:
    """Every label is -1 or a class id below ``top`` (``num_classes`` if the input gives it;
    any block of the labels can be checked alone)."""
    if labels.size and labels.min() < -1:
        _fail(source, f"labels hold {int(labels.min())}",
              "use -1 for unlabelled, 0..C-1 for classes")
    if labels.size and labels.max() >= top:
        _fail(source, f"labels hold class {int(labels.max())}, outside 0..{top - 1}"
              + (" (num_classes)" if is_num_classes
                 else " (the node count, without a num_classes key)"),
              "class ids must be 0..C-1 with C classes" + (
                  "" if is_num_classes else "; add the num_classes key if the graph has more "
                                            "classes than nodes"))


def check_split_ids(source: str, num_nodes: int, name: str, idx: np.ndarray) -> None:
    """A split index (or a chunk of one) is 1-D with every id in range."""
    if idx.ndim != 1:
        _fail(source, f"{name} has shape {idx.shape}", f"{name} must be a 1-D list of node ids")
    if idx.size and (idx.min() < 0 or idx.max() >= num_nodes):
        bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
        _fail(source, f"{name} holds node id {bad}, outside 0..{num_nodes - 1}",
              f"{name} must list nodes of the graph")


def fail_repeat(source: str, name: str, node: int | None = None) -> None:
    _fail(source, f"{name} lists a node{'' if node is None else f' ({node})'} twice",
          f"list each node of {name} once")


def fail_unlabelled_train(source: str, node: int | None = None) -> None:
    _fail(source, f"train_idx holds an unlabelled node{'' if node is None else f' ({node})'} "
          "(label -1)", "train only on labelled nodes: drop it from train_idx or give it a label")


def warn_unlabelled(source: str, name: str, unlabelled: int, total: int) -> None:
    if unlabelled:
        log.warning("%s: %s selects %d unlabelled node(s) (label -1) of %d; accuracy counts "
                    "labelled nodes only (drop them from %s to silence this)", source, name,
                    unlabelled, total, name)


def check_split(source: str, num_nodes: int, labels: np.ndarray, name: str,
                idx: np.ndarray) -> None:
    """A split index is 1-D, in range, without repeats; training nodes are labelled. An empty
    ``train_idx`` is a graph to predict on (preprocess warns; ``hpcgnn train`` refuses it)."""
    check_split_ids(source, num_nodes, name, idx)
    if len(np.unique(idx)) != len(idx):
        fail_repeat(source, name)
    if name == "train_idx" and idx.size and labels[idx].min() < 0:
        fail_unlabelled_train(source)
    warn_unlabelled(source, name, int((labels[idx] < 0).sum()) if idx.size else 0, idx.size)


def warn_split_overlap(source: str, overlaps: dict[str, int]) -> None:
    """Warn, once, of training nodes that ``val_idx`` / ``test_idx`` select too (``overlaps``:
    split name -> count): that accuracy then counts nodes the model trained on."""
    found = [f"{count} node(s) of {name}" for name, count in overlaps.items() if count]
    if found:
        log.warning("%s: %s are in train_idx too, so their accuracy counts nodes the model "
                    "trained on (make the splits disjoint to silence this)", source,
                    " and ".join(found))


def check_graph(graph: Graph, source: str, num_classes: int | None = None) -> None:
    """Every check above on a whole ``Graph``."""
    n = graph.num_nodes
    check_csr(source, n, graph.indptr, graph.indices)
    check_features(source, n, graph.features)
    check_labels(source, n, graph.labels, num_classes)
    for name in ("train_idx", "val_idx", "test_idx"):
        check_split(source, n, graph.labels, name, getattr(graph, name))
    warn_split_overlap(source, {name: np.intersect1d(graph.train_idx, getattr(graph, name)).size
                                for name in ("val_idx", "test_idx")})


PREDICT_ONLY = ("the shard set is one to predict on: `hpcgnn predict` uses it, `hpcgnn train` "
                "refuses it (give the input a training split to train on it)")
