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


def check_csr(source: str, num_nodes: int, indptr: np.ndarray, indices: np.ndarray) -> None:
    """``adj_indptr``/``adj_indices`` form a CSR over ``num_nodes`` rows with ids in range."""
    if num_nodes < 1:
        _fail(source, f"num_nodes is {num_nodes}", "a graph needs at least one node")
    if indptr.ndim != 1 or len(indptr) != num_nodes + 1:
        _fail(source, f"adj_indptr has shape {indptr.shape}, expected ({num_nodes + 1},)",
              f"it must hold num_nodes + 1 row offsets; {FORMAT_HINT}")
    if indptr[0] != 0 or indptr[-1] != len(indices) or bool(np.any(np.diff(indptr) < 0)):
        _fail(source, "adj_indptr is not a CSR row pointer (must start at 0, never decrease, "
              f"and end at len(adj_indices) = {len(indices)})", FORMAT_HINT)
    if indices.size and (indices.min() < 0 or indices.max() >= num_nodes):
        bad = int(indices.min()) if indices.min() < 0 else int(indices.max())
        _fail(source, f"adj_indices holds node id {bad}, outside 0..{num_nodes - 1}",
              "every neighbour id must be a node of the graph; fix the file or num_nodes")


def check_features(source: str, num_nodes: int, features: np.ndarray | sp.csr_matrix) -> None:
    """Features are ``[num_nodes, F]`` and finite."""
    if features.ndim != 2 or features.shape[0] != num_nodes:
        _fail(source, f"features have shape {features.shape}, expected ({num_nodes}, F)",
              "one feature row per node")
    values = features.data if sp.issparse(features) else features
    finite = np.isfinite(values)
    if not bool(finite.all()):
        rows = np.nonzero(~finite)[0] if not sp.issparse(features) else \
            np.unique(np.repeat(np.arange(num_nodes), np.diff(features.indptr))[~finite])
        _fail(source, f"features hold NaN or inf (in {len(np.unique(rows))} rows, first "
              f"row {int(rows.min())})", "replace them (e.g. with 0) before preprocessing")


def check_labels(source: str, num_nodes: int, labels: np.ndarray,
                 num_classes: int | None = None) -> None:
    """Labels are ``[num_nodes]``, -1 (unlabelled) or a class id in range."""
    if labels.shape != (num_nodes,):
        _fail(source, f"labels have shape {labels.shape}, expected ({num_nodes},)",
              "one label per node, -1 for unlabelled")
    if labels.size and labels.min() < -1:
        _fail(source, f"labels hold {int(labels.min())}",
              "use -1 for unlabelled, 0..C-1 for classes")
    top = num_nodes if num_classes is None else num_classes
    if labels.size and labels.max() >= top:
        _fail(source, f"labels hold class {int(labels.max())}, outside 0..{top - 1}"
              + ("" if num_classes is None else " (num_classes)"),
              "class ids must be 0..C-1 with C classes")


def check_split(source: str, num_nodes: int, labels: np.ndarray, name: str,
                idx: np.ndarray) -> None:
    """A split index is 1-D, in range, without repeats; training nodes are labelled."""
    if idx.ndim != 1:
        _fail(source, f"{name} has shape {idx.shape}", f"{name} must be a 1-D list of node ids")
    if idx.size and (idx.min() < 0 or idx.max() >= num_nodes):
        bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
        _fail(source, f"{name} holds node id {bad}, outside 0..{num_nodes - 1}",
              f"{name} must list nodes of the graph")
    if len(np.unique(idx)) != len(idx):
        _fail(source, f"{name} lists a node twice", f"list each node of {name} once")
    if name == "train_idx" and idx.size and labels[idx].min() < 0:
        _fail(source, "train_idx holds an unlabelled node (label -1)",
              "train only on labelled nodes: drop it from train_idx or give it a label")
    unlabelled = int((labels[idx] < 0).sum()) if idx.size else 0
    if unlabelled:
        log.warning("%s: %s selects %d unlabelled node(s) (label -1) of %d; accuracy counts "
                    "labelled nodes only (drop them from %s to silence this)", source, name,
                    unlabelled, idx.size, name)


def check_graph(graph: Graph, source: str, num_classes: int | None = None) -> None:
    """Every check above on a whole ``Graph``."""
    n = graph.num_nodes
    check_csr(source, n, graph.indptr, graph.indices)
    check_features(source, n, graph.features)
    check_labels(source, n, graph.labels, num_classes)
    for name in ("train_idx", "val_idx", "test_idx"):
        check_split(source, n, graph.labels, name, getattr(graph, name))
