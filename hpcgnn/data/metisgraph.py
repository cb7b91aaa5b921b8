"""``metis-graph:PATH,...``: a graph in METIS's text format (the METIS 5 manual, section 4.1.1)
with stand-in labels and features, since the format holds neither.

The file: ``%`` comment lines anywhere; a header ``n m [fmt [ncon]]``; then one line per vertex
``1..n`` (an empty line is a vertex without neighbours) listing its neighbours, 1-based. ``fmt``
is up to three digits ``[s][w][e]``: ``s`` a vertex size first on each line, ``w`` ``ncon``
vertex weights (default 1) next, ``e`` a weight after every neighbour. The graph is undirected:
each edge is listed at both of its ends and ``m`` counts it once. Sizes and weights are read
(they must be integers) and ignored. A count that differs from the header, an id out of range,
a self-loop, a neighbour listed twice and an edge listed at one end only are refused, naming the
file, the line and the fix.

Labels: ``max(classes, n // REGION)`` seed vertices drawn with ``seed``, each given a class
(the classes dealt round-robin over the shuffled seeds); every vertex takes the class of its
nearest seed by hop count (ties: the seed scipy's multi-source Dijkstra reaches first), and a
vertex no seed reaches (a component without a seed) takes a seeded random class. So a label is
constant over regions of about REGION vertices that follow the mesh, and most edges join equal
labels. Features: ``signal * mu_class + N(0, I)`` with unit-norm class means, as ``csbm:``. A
benchmark stand-in for the real topology, not a real task.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import dijkstra

from hpcgnn.data.errors import DatasetError
from hpcgnn.data.graph import Graph
from hpcgnn.data.synthetic import Split, _csbm_features, check_options

log = logging.getLogger("hpcgnn.data")
REGION = 64        # vertices per label region (seed), on average
LINES = 1 << 16    # vertex lines parsed at a time
FORMAT = "METIS's graph format: a header 'n m [fmt [ncon]]', then one line per vertex listing " \
         "its 1-based neighbours, each edge at both ends (docs/preprocessing.md)"


def _lines(path: Path) -> tuple[list[bytes], list[int]]:
    """The non-comment lines of ``path`` and their 1-based line numbers."""
    if not path.is_file():
        raise DatasetError(f"{path}: no such file; pass --dataset metis-graph:PATH with an "
                           f"existing file in {FORMAT}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read it ({exc}); check its permissions") from exc
    lines, numbers = [], []
    split = raw.split(b"\n")
    if split[-1] == b"":         # the newline that ends the last line starts no line
        split.pop()
    for i, line in enumerate(split, 1):
        if not line.lstrip().startswith(b"%"):
            lines.append(line)
            numbers.append(i)
    return lines, numbers


def _header(path: Path, lines: list[bytes], numbers: list[int]) -> tuple[int, int, int, int, int]:
    """(index of the header in ``lines``, n, m, fmt digits as s/w/e bits, ncon)."""
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        raise DatasetError(f"{path}: no header line 'n m [fmt [ncon]]'; the file is empty or "
                           f"only comments ({FORMAT})")
    words = lines[first].split()
    where = f"{path}, line {numbers[first]}"
    if not 2 <= len(words) <= 4 or not all(w.isdigit() for w in words):
        raise DatasetError(f"{where}: the header '{lines[first].strip().decode(errors='replace')}'"
                           f" is not 'n m [fmt [ncon]]' (2 to 4 non-negative integers); "
                           f"fix it ({FORMAT})")
    n, m = int(words[0]), int(words[1])
    fmt = words[2].decode() if len(words) > 2 else "0"
    if len(fmt) > 3 or set(fmt) - {"0", "1"}:
        raise DatasetError(f"{where}: fmt {fmt} is not up to three digits 0 or 1 ([s][w][e]: "
                           f"vertex sizes, vertex weights, edge weights); fix the header")
    fmt = fmt.rjust(3, "0")
    ncon = int(words[3]) if len(words) > 3 else 1
    if len(words) > 3 and fmt[1] != "1":
        raise DatasetError(f"{where}: ncon {ncon} is given but fmt {fmt} has no vertex weights "
                           f"(its middle digit is 0); write fmt 010 or 011, or drop ncon")
    if n < 1:
        raise DatasetError(f"{where}: n is 0; a graph needs at least one vertex; fix the header")
    if ncon < 1:
        raise DatasetError(f"{where}: ncon is 0; give ncon >= 1 vertex weights or drop it")
    return first, n, m, int(fmt, 2), ncon


def read_metis_graph(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """int64 CSR ``(indptr, indices)`` of the undirected graph in METIS's format at ``path``
    (0-based, every edge in both rows, rows sorted), checked; weights are ignored."""
    path = Path(path)
    lines, numbers = _lines(path)
    first, n, m, fmt, ncon = _header(path, lines, numbers)
    body, body_no = lines[first + 1:first + 1 + n], numbers[first + 1:first + 1 + n]
    extra = next((i for i in range(first + 1 + n, len(lines)) if lines[i].strip()), None)
    if len(body) < n or extra is not None:
        said = (f"has {len(body)} vertex line(s) after the header" if len(body) < n else
                f"has a line {numbers[extra]} past the {n} vertex lines")
        raise DatasetError(f"{path}: the header (line {numbers[first]}) says {n} vertices but "
                           f"the file {said}; a vertex without neighbours is an empty line: "
                           f"fix n or the vertex lines")
    lead = (fmt >> 2 & 1) + (fmt >> 1 & 1) * ncon      # size, then ncon weights
    step = 2 if fmt & 1 else 1                          # neighbour, weight pairs
    degree_parts, col_parts = [], []
    for lo in range(0, n, LINES):        # a chunk's words as Python objects, not the file's
        degree, cols = _neighbours(path, body[lo:lo + LINES], body_no, lo, lead, step,
                                   f"fmt {fmt:03b}, ncon {ncon}")
        degree_parts.append(degree)
        col_parts.append(cols)
    degree = np.concatenate(degree_parts)
    cols = np.concatenate(col_parts)
    del degree_parts, col_parts
    rows = np.repeat(np.arange(n, dtype=np.int64), degree)
    _check_edges(path, body_no, n, m, rows, cols)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(degree, out=indptr[1:])
    order = np.lexsort((cols, rows))
    return indptr, cols[order]


def _neighbours(path: Path, lines: list[bytes], line_no: list[int], lo: int, lead: int,
                step: int, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(degree, 0-based neighbour ids) of the vertex lines ``lines`` (vertices ``lo..``): each
    line ``lead`` values, then neighbours (with a weight after each when ``step`` is 2)."""
    words = [line.split() for line in lines]
    counts = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    bad = np.flatnonzero((counts < lead) | ((counts - lead) % step != 0))
    if bad.size:
        i = int(bad[0])
        raise DatasetError(
            f"{path}, line {line_no[lo + i]} (vertex {lo + i + 1}): {counts[i]} value(s) do not "
            f"fit {fmt}: a line is {lead} leading value(s) (vertex size, weights) then "
            f"{'neighbour, edge weight pairs' if step == 2 else 'neighbours'}; fix the line or "
            f"the header's fmt")
    flat = [w for ws in words for w in ws]
    try:
        values = np.fromiter(map(int, flat), dtype=np.int64, count=len(flat))
    except (ValueError, OverflowError):
        i = next(i for i, ws in enumerate(words) if not all(_is_int(w) for w in ws))
        raise DatasetError(f"{path}, line {line_no[lo + i]} (vertex {lo + i + 1}): "
                           f"'{lines[i].strip().decode(errors='replace')[:80]}' holds a value "
                           f"that is not an integer (or not below 2^63); METIS's format has "
                           f"integers only: fix the line") from None
    del flat, words
    starts = np.zeros(len(lines) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    pos = np.arange(len(values), dtype=np.int64) - np.repeat(starts[:-1], counts)
    return (counts - lead) // step, values[(pos >= lead) & ((pos - lead) % step == 0)] - 1


def _is_int(word: bytes) -> bool:
    try:
        return abs(int(word)) < 2**63
    except ValueError:
        return False


def _check_edges(path: Path, line_no: list[int], n: int, m: int, rows: np.ndarray,
                 cols: np.ndarray) -> None:
    """Ids in range, no self-loop, no neighbour twice, every edge at both ends, and ``2m``
    entries; the first offender is named with its line."""
    def at(k: int) -> str:
        return f"{path}, line {line_no[rows[k]]} (vertex {rows[k] + 1})"

    out = np.flatnonzero((cols < 0) | (cols >= n))
    if out.size:
        k = int(out[0])
        raise DatasetError(f"{at(k)}: neighbour {cols[k] + 1} is out of range 1..{n} (ids are "
                           f"1-based, at most n = {n}); fix the id or the header's n")
    loop = np.flatnonzero(rows == cols)
    if loop.size:
        raise DatasetError(f"{at(int(loop[0]))}: lists itself as a neighbour; METIS's format has "
                           f"no self-loops: remove it")
    keys = rows * n + cols
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    twice = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
    if twice.size:
        k = int(order[twice[0]])
        raise DatasetError(f"{at(k)}: lists neighbour {cols[k] + 1} twice; list each neighbour "
                           f"once")
    reverse = cols * n + rows
    found = np.searchsorted(sorted_keys, reverse)
    missing = np.flatnonzero(sorted_keys[np.minimum(found, len(keys) - 1)] != reverse) \
        if len(keys) else found
    if missing.size:
        k = int(missing[0])
        raise DatasetError(f"{at(k)}: lists neighbour {cols[k] + 1}, but vertex {cols[k] + 1}'s "
                           f"line {line_no[cols[k]]} does not list {rows[k] + 1}; an undirected "
                           f"graph lists each edge at both ends: add it there or remove it here")
    if len(keys) != 2 * m:
        raise DatasetError(f"{path}: the header says m = {m} edges but the lines list "
                           f"{len(keys) // 2} (each edge at both ends, {len(keys)} entries); fix "
                           f"the header's m to {len(keys) // 2}")


def region_labels(indptr: np.ndarray, indices: np.ndarray, classes: int,
                  rng: np.random.Generator) -> np.ndarray:
    """int64 [n]: the class of each vertex's nearest seed (module docstring)."""
    n = len(indptr) - 1
    seeds = np.sort(rng.choice(n, size=min(n, max(classes, n // REGION)), replace=False))
    seed_class = rng.permutation(len(seeds)) % classes
    adj = sp.csr_matrix((np.ones(len(indices), dtype=np.float64), indices, indptr), shape=(n, n))
    _, _, source = dijkstra(adj, directed=False, indices=seeds, unweighted=True, min_only=True,
                            return_predecessors=True)
    fill = rng.integers(0, classes, size=n, dtype=np.int64)
    reached = source >= 0
    labels = fill
    labels[reached] = seed_class[np.searchsorted(seeds, source[reached])]
    return labels


def metis_graph(name: str = "metis-graph", *, path: str = "", features: int = 32,
                classes: int = 4, signal: float = 1.0, train: float = 0.1, val: float = 0.2,
                seed: int = 0) -> Graph:
    """The graph at ``path`` in METIS's format, with region labels and cSBM-style features."""
    opts = dict(features=features, classes=classes, signal=signal, train=train, val=val,
                seed=seed)
    check_options(name, "metis-graph:PATH,", False, **opts)     # before the read
    indptr, indices = read_metis_graph(path)
    n = len(indptr) - 1
    check_options(name, "metis-graph:PATH,", True, nodes=n, **opts)
    log.info("%s: %s vertices, %s undirected edges (weights, if any, ignored)", name, f"{n:,}",
             f"{len(indices) // 2:,}")
    rng = np.random.default_rng(seed)
    labels = region_labels(indptr, indices, classes, rng)
    means = rng.standard_normal((classes, features))
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    x = _csbm_features(rng, signal, means, labels)
    tr, va, te = Split(train, val).indices(rng, n)
    return Graph(name=name, num_nodes=n, indptr=indptr, indices=indices, features=x,
                 labels=labels, train_idx=tr, val_idx=va, test_idx=te)
