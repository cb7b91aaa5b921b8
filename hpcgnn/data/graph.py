"""The in-memory input graph: what a dataset reader returns and what the partitioner consumes.

CSR convention (the input contract): row ``i`` of ``indptr``/``indices`` lists the nodes whose
messages reach ``i`` (in-neighbours). Ids are int64 throughout.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp


@dataclass
class Graph:
    """A whole graph with features, labels and the train/val/test split."""

    name: str
    num_nodes: int
    indptr: np.ndarray          # int64 [N + 1]
    indices: np.ndarray         # int64 [nnz]
    features: np.ndarray | sp.csr_matrix   # float32 [N, F], dense or CSR
    labels: np.ndarray          # int64 [N], -1 = unlabelled
    train_idx: np.ndarray       # int64
    val_idx: np.ndarray         # int64
    test_idx: np.ndarray        # int64
    classes: int | None = None  # the input's ``num_classes`` key, where it has one

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    @property
    def feature_dim(self) -> int:
        return int(self.features.shape[1])

    @property
    def num_classes(self) -> int:
        """The input's ``num_classes``, else the largest label + 1 (0: no labelled node)."""
        if self.classes is not None:
            return int(self.classes)
        labelled = self.labels[self.labels >= 0]
        return int(labelled.max()) + 1 if labelled.size else 0

    def in_degree(self) -> np.ndarray:
        """int64 [N]: in-degree of every node (self-loops are removed on load)."""
        return np.diff(self.indptr).astype(np.int64)

    def dense_features(self, rows: np.ndarray | None = None) -> np.ndarray:
        """float32 dense features, of all nodes or of ``rows``."""
        x = self.features if rows is None else self.features[rows]
        if sp.issparse(x):
            x = x.toarray()
        return np.asarray(x, dtype=np.float32)
