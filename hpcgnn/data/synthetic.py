"""Synthetic graphs: a contextual stochastic block model (accuracy depends on communication)
and R-MAT with Graph500 parameters (scale). Deterministic for a given seed; vectorised."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from hpcgnn.data.clean import edges_to_csr
from hpcgnn.data.errors import DatasetError
from hpcgnn.data.graph import Graph

log = logging.getLogger("hpcgnn.data")
CHUNK = 1 << 22     # edges generated per batch: bounds the temporaries of R-MAT


@dataclass(frozen=True)
class Option:
    """A generator option's type and allowed range (``None``: unbounded; ``open_low``: the
    lower bound itself is excluded), and a value to show as an example."""

    kind: type
    example: object
    low: float | None = None
    high: float | None = None
    open_low: bool = False

    def allowed(self) -> str:
        if self.kind is bool:
            return "true or false"
        what = "an integer" if self.kind is int else "a number"
        if self.high is not None:
            return f"{what} in {'(' if self.open_low else '['}{self.low}, {self.high}]"
        return f"a finite {what[2:]}" if self.low is None else f"{what} >= {self.low}"

    def accepts(self, value) -> bool:
        if self.kind is bool or isinstance(value, bool):
            return self.kind is bool and isinstance(value, bool)
        if not isinstance(value, int if self.kind is int else (int, float)) or \
                not math.isfinite(value):
            return False
        low_ok = self.low is None or (value > self.low if self.open_low else value >= self.low)
        return low_ok and (self.high is None or value <= self.high)


# the options of csbm/rmat and their sliced variants (docs/preprocessing.md, 'Dataset specs')
OPTIONS = {"nodes": Option(int, 2000, 1), "classes": Option(int, 4, 2),
           "degree": Option(float, 10, 0), "homophily": Option(float, 0.8, 0, 1),
           "features": Option(int, 32, 1), "signal": Option(float, 1.0),
           "train": Option(float, 0.1, 0, 1, open_low=True), "val": Option(float, 0.2, 0, 1),
           "seed": Option(int, 0, 0), "scale": Option(int, 12, 1, 62),
           "edge_factor": Option(int, 16, 1), "a": Option(float, 0.57, 0, 1),
           "b": Option(float, 0.19, 0, 1), "c": Option(float, 0.19, 0, 1),
           "symmetric": Option(bool, "true")}


def check_options(spec: str, kind: str, whole: bool, **opts) -> None:
    """Every option of generator ``kind`` (csbm, rmat; or a prefix ending in ``,`` such as
    ``metis-graph:PATH,``) of ``spec`` in its range, and the fractions adding up: a
    DatasetError names the option, its range and an example.
    ``whole``: the split takes ``round(train * nodes)`` nodes (not a per-node probability,
    as in the sliced generators), so a ``train`` that selects no node is refused here."""
    kind = kind if kind.endswith(",") else f"{kind}:"
    for key, value in opts.items():
        option = OPTIONS[key]
        if not option.accepts(value):
            raise DatasetError(f"dataset spec '{spec}': option {key}={value} is not allowed: "
                               f"{key} must be {option.allowed()}, e.g. "
                               f"{kind}{key}={option.example}")
    if opts["train"] + opts["val"] > 1:
        raise DatasetError(f"dataset spec '{spec}': train={opts['train']} + val={opts['val']} is "
                           f"more than 1 (the test set is the rest): lower them, e.g. "
                           f"{kind}train=0.1,val=0.2")
    if "a" in opts and opts["a"] + opts["b"] + opts["c"] > 1:
        raise DatasetError(f"dataset spec '{spec}': a + b + c = "
                           f"{opts['a'] + opts['b'] + opts['c']:g} is more than 1 (d = 1 - a - b "
                           f"- c is the fourth quadrant's share): e.g. {kind}a=0.57,b=0.19,c=0.19")
    nodes = (opts["nodes"] if "nodes" in opts else 1 << opts["scale"]) if whole else 0
    if whole and int(round(opts["train"] * nodes)) < 1:
        raise DatasetError(f"dataset spec '{spec}': train={opts['train']} of {nodes} nodes is no "
                           f"training node: raise train to at least {1 / nodes:.3g} (or nodes)")


@dataclass(frozen=True)
class Split:
    """Fractions of nodes in the training and validation sets; the rest is the test set."""

    train: float = 0.1
    val: float = 0.2

    def indices(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, ...]:
        perm = rng.permutation(n).astype(np.int64)
        a, b = int(round(self.train * n)), int(round((self.train + self.val) * n))
        return np.sort(perm[:a]), np.sort(perm[a:b]), np.sort(perm[b:])


def _graph(name: str, n: int, dst: np.ndarray, src: np.ndarray, features: np.ndarray,
           labels: np.ndarray, split: Split, rng: np.random.Generator, symmetric: bool) -> Graph:
    indptr, indices, report = edges_to_csr(dst, src, n, symmetrize=symmetric, source=name)
    log.info("%s: %s", name, report)
    train, val, test = split.indices(rng, n)
    return Graph(name=name, num_nodes=n, indptr=indptr, indices=indices, features=features,
                 labels=labels, train_idx=train, val_idx=val, test_idx=test)


def csbm(name: str = "csbm", *, nodes: int = 2000, classes: int = 4, degree: float = 10.0,
         homophily: float = 0.8, features: int = 32, signal: float = 1.0, train: float = 0.1,
         val: float = 0.2, seed: int = 0) -> Graph:
    """Contextual SBM: balanced classes; each of ``nodes * degree / 2`` undirected edges joins a
    uniform node to a node of its own class with probability ``homophily``, else of another
    class; features are ``signal * mu_class + N(0, I)`` with unit-norm class means ``mu``. With a
    weak signal the features alone classify poorly and neighbours' features carry the accuracy."""
    check_options(name, "csbm", True, nodes=nodes, classes=classes, degree=degree,
                  homophily=homophily, features=features, signal=signal, train=train, val=val,
                  seed=seed)
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(nodes, dtype=np.int64) % classes)
    members = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=classes)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    m = int(nodes * degree / 2)
    src = rng.integers(0, nodes, size=m, dtype=np.int64)
    same = rng.random(m) < homophily
    other = (labels[src] + rng.integers(1, max(classes, 2), size=m)) % classes
    cls = np.where(same, labels[src], other)
    dst = members[starts[cls] + (rng.random(m) * counts[cls]).astype(np.int64)]
    means = rng.standard_normal((classes, features))
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    x = _csbm_features(rng, signal, means, labels)
    return _graph(name, nodes, dst, src, x, labels, Split(train, val), rng, symmetric=True)


def _csbm_features(rng: np.random.Generator, signal: float, means: np.ndarray,
                   labels: np.ndarray) -> np.ndarray:
    """float32 ``signal * means[labels] + N(0, I)``, computed in float64 CHUNK elements at a
    time: the same draws and bits as the whole matrix at once, without its two float64
    temporaries (four times the float32 features' size, beside them)."""
    nodes, features = len(labels), means.shape[1]
    x = np.empty((nodes, features), dtype=np.float32)
    step = max(1, CHUNK // features)
    for lo in range(0, nodes, step):
        hi = min(lo + step, nodes)
        x[lo:hi] = signal * means[labels[lo:hi]] + rng.standard_normal((hi - lo, features))
    return x


def _rmat_edges(rng: np.random.Generator, scale: int, m: int,
                abc: tuple[float, float, float]) -> tuple[np.ndarray, np.ndarray]:
    """``m`` R-MAT edges over ``2**scale`` nodes, drawn bit by bit in batches of CHUNK."""
    a, b, c = abc
    src = np.zeros(m, dtype=np.int64)
    dst = np.zeros(m, dtype=np.int64)
    for lo in range(0, m, CHUNK):
        s, d = src[lo:lo + CHUNK], dst[lo:lo + CHUNK]
        for level in range(scale):
            u = rng.random(len(s), dtype=np.float32)
            row_bit = u >= a + b
            col_bit = ((u >= a) & ~row_bit) | (u >= a + b + c)
            s |= row_bit.astype(np.int64) << level
            d |= col_bit.astype(np.int64) << level
        if m > CHUNK:
            log.info("R-MAT: %s/%s edges drawn", f"{lo + len(s):,}", f"{m:,}")
    perm = rng.permutation(1 << scale).astype(np.int64)    # Graph500: hide the degree order
    return perm[src], perm[dst]


def rmat(name: str = "rmat", *, scale: int = 12, edge_factor: int = 16, a: float = 0.57,
         b: float = 0.19, c: float = 0.19, features: int = 16, classes: int = 4,
         symmetric: bool = True, train: float = 0.1, val: float = 0.2, seed: int = 0) -> Graph:
    """R-MAT (Graph500 a=0.57, b=0.19, c=0.19, d=0.05): ``2**scale`` nodes, ``edge_factor *
    2**scale`` generated edges (undirected unless ``symmetric=False``), random labels and
    Gaussian features: a graph for timing and memory, not for accuracy."""
    check_options(name, "rmat", True, scale=scale, edge_factor=edge_factor, a=a, b=b, c=c,
                  features=features, classes=classes, symmetric=symmetric, train=train, val=val,
                  seed=seed)
    rng = np.random.default_rng(seed)
    n = 1 << scale
    log.info("%s: generating %s edges over %s nodes", name, f"{edge_factor * n:,}", f"{n:,}")
    src, dst = _rmat_edges(rng, scale, edge_factor * n, (a, b, c))
    labels = rng.integers(0, classes, size=n, dtype=np.int64)
    x = rng.standard_normal((n, features), dtype=np.float32)
    return _graph(name, n, dst, src, x, labels, Split(train, val), rng, symmetric)
