"""Writing a shard set: one part at a time (each atomically), ``meta.json`` last.

An output directory that already holds a shard set is refused unless ``force``; with ``force``
the old ``meta.json`` goes first, so the directory never looks complete while it is rewritten.
A failed write removes the parts this run wrote, so no set that looks complete is left behind.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

import numpy as np

from hpcgnn.data.errors import hdf5_fix
from hpcgnn.data.graph import Graph
from hpcgnn.data.shard import FORMAT_VERSION, META_NAME, part_entry, part_name, write_meta, \
    write_shard
from hpcgnn.data.validate import PREDICT_ONLY
from preprocess.errors import PreprocessError
from preprocess.halo import HaloPairs, PartLayout, build_shard, check_key_range, masks

log = logging.getLogger("hpcgnn.preprocess")


def shard_files(out: Path) -> list[Path]:
    """Files in ``out`` that belong to a shard set, finished or half-written."""
    names = [META_NAME, f".{META_NAME}.tmp-*", "part-*.h5", ".part-*.h5.tmp-*"]
    return sorted(f for pattern in names for f in out.glob(pattern))


def check_out_dir(out: str | Path, force: bool) -> list[Path]:
    """Refuse an ``out`` that is a file, or holds shard files (unless ``force``); the old files."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PreprocessError(f"{out}: exists and is not a directory; choose another --out")
    old = shard_files(out) if out.is_dir() else []
    finished = [f for f in old if not f.name.startswith(".")]
    if finished and not force:
        shown = ", ".join(f.name for f in finished[:3]) + (", ..." if len(finished) > 3 else "")
        raise PreprocessError(f"{out}: already holds shard files ({shown}); pass --force to "
                              f"overwrite them, or choose another --out")
    check_writable(out, "--out")
    return old


def check_writable(folder: Path, option: str) -> None:
    """Make ``folder`` (and its missing parents) and a file in it, then remove all that was
    made: a folder that cannot be made or written to (permissions, a read-only file system) is
    refused before the long steps, not after them."""
    made = []
    while not folder.exists() and folder != folder.parent:
        made.append(folder)
        folder = folder.parent
    probe = (made[0] if made else folder) / f".hpcgnn-write-test-{os.getpid()}"
    try:
        for d in reversed(made):
            d.mkdir()
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        where = exc.filename or probe.parent
        raise PreprocessError(f"{where}: cannot write there ({exc.strerror}); choose another "
                              f"{option} (a folder you can write to)") from exc
    finally:
        for d in made:
            try:
                d.rmdir()
            except OSError:
                pass


def prepare_out_dir(out: Path, force: bool) -> None:
    """Create ``out``, or clear the shard set in it when ``force``; refuse otherwise."""
    old = check_out_dir(out, force)
    (out / META_NAME).unlink(missing_ok=True)            # first: the set stops looking complete
    for f in old:
        f.unlink(missing_ok=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PreprocessError(f"{out}: cannot create the output directory ({exc.strerror}); "
                              f"choose another --out") from exc


def warn_untrainable(dataset: str, labelled_train: int) -> None:
    """Warn of a graph without a labelled training node: its shard set is one to predict on
    (``hpcgnn train`` refuses it; ``hpcgnn predict`` uses it)."""
    if labelled_train == 0:
        log.warning("%s: no labelled training node (train_idx is empty): %s", dataset,
                    PREDICT_ONLY)


def check_classes(dataset: str, num_classes: int) -> None:
    """Refuse a graph without a class count: no labelled node and no ``num_classes`` key
    (its ``meta.json`` would say 0 classes, which no reader takes)."""
    if num_classes < 1:
        raise PreprocessError(f"{dataset}: no labelled node and no num_classes, so the shard set "
                              f"would have 0 classes; add the num_classes key (the trained "
                              f"model's class count) to the input to predict on it")


def check_part_array(graph: Graph, parts: np.ndarray, num_parts: int) -> np.ndarray:
    """``parts`` is int [N] with every value in 0..num_parts-1; returned as int64."""
    parts = np.asarray(parts)
    if parts.shape != (graph.num_nodes,) or parts.dtype.kind not in "iu":
        raise PreprocessError(f"part array has shape {parts.shape} and dtype {parts.dtype}; "
                              f"expected int [{graph.num_nodes}]")
    if parts.size and (parts.min() < 0 or parts.max() >= num_parts):
        raise PreprocessError(f"part array holds parts outside 0..{num_parts - 1}")
    check_key_range(graph.num_nodes, num_parts)
    return parts.astype(np.int64, copy=False)


def _errno(exc: BaseException) -> int | None:
    """The errno behind ``exc`` (h5py may raise a RuntimeError on close after an OSError)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def write_failed(path: Path, exc: BaseException) -> PreprocessError:
    code = _errno(exc)
    why = os.strerror(code) if code else str(exc)
    hint = ("free disk space (or raise the quota or file-size limit)"
            if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
            else "check that the directory is writable and has space")
    hint = hdf5_fix(exc, hint)
    return PreprocessError(f"{path}: write failed ({why}); {hint}, then re-run; no shard set "
                           f"was left in {path.parent}")


def _write_parts(graph: Graph, layout: PartLayout, pairs: HaloPairs, out: Path) -> list[dict]:
    """Build and write every part in turn; the ``parts`` list of ``meta.json``."""
    node_masks, degree = masks(graph), graph.in_degree()
    scratch = np.empty(graph.num_nodes, dtype=np.int64)      # global -> local id, per part
    entries, t0 = [], time.perf_counter()
    for p in range(layout.num_parts):
        shard = build_shard(graph, layout, pairs, node_masks, degree, p, scratch)
        path = out / part_name(p)
        try:
            write_shard(path, shard)
        except (OSError, RuntimeError) as exc:      # h5py: RuntimeError on close after a failure
            raise write_failed(path, exc) from exc
        entries.append(part_entry(path, shard))
        log.info("part %d/%d: %s owned, %s halo, %s edges (%.1f s)", p + 1, layout.num_parts,
                 f"{shard.n_owned:,}", f"{shard.n_halo:,}", f"{shard.num_edges:,}",
                 time.perf_counter() - t0)
    return entries


def input_stamp(dataset: str) -> dict | None:
    """``{"size", "mtime_ns"}`` of the file an ``npz:``, ``h5:`` or ``metis-graph:`` spec
    reads (None for other specs, or a file not there): jobs/preprocess.sbatch reuses a set only
    while they hold."""
    from hpcgnn.data.datasets import FILE_SPECS, parse_spec
    try:
        name, opts = parse_spec(dataset)
        if name not in FILE_SPECS:
            return None
        stat = Path(opts["path"]).stat()
    except (ValueError, KeyError, OSError):
        return None
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def meta_fields(dataset: str, num_nodes: int, num_edges: int, feature_dim: int,
                num_classes: int, num_parts: int, partitioner: str, seed: int, edge_cut: int,
                entries: list[dict] | None = None, symmetrize: bool = False,
                stamp: dict | None = None) -> dict:
    """The ``meta.json`` dict (DESIGN.md, 'Preprocess'), with ``symmetrize`` (--symmetrize:
    the input's edges were not all there as written) and ``input`` (``input_stamp`` of the
    input file as it was read), both of which jobs/preprocess.sbatch compares."""
    return {"format_version": FORMAT_VERSION, "dataset": dataset, "num_nodes": num_nodes,
            "num_edges": num_edges, "feature_dim": feature_dim, "num_classes": num_classes,
            "num_parts": num_parts, "partitioner": partitioner, "seed": seed,
            "symmetrize": bool(symmetrize), "input": stamp, "edge_cut": edge_cut,
            "parts": entries or []}


def _meta(graph: Graph, num_parts: int, partitioner: str, seed: int, edge_cut: int,
          entries: list[dict], symmetrize: bool, stamp: dict | None) -> dict:
    return meta_fields(graph.name, graph.num_nodes, graph.num_edges, graph.feature_dim,
                       graph.num_classes, num_parts, partitioner, seed, edge_cut, entries,
                       symmetrize, stamp)


def write_shards(graph: Graph, parts: np.ndarray, out_dir: str | Path, *, partitioner: str,
                 seed: int, force: bool = False, num_parts: int | None = None,
                 symmetrize: bool = False, stamp: dict | None = None) -> dict:
    """Write the shard set of ``graph`` split by ``parts`` into ``out_dir``; return its meta.

    ``num_parts`` defaults to ``parts.max() + 1`` (pass it when trailing parts are empty);
    ``symmetrize`` is recorded in ``meta.json`` (the graph was loaded with it)."""
    out = Path(out_dir)
    num_parts = int(np.max(parts)) + 1 if num_parts is None else int(num_parts)
    parts = check_part_array(graph, parts, num_parts)
    warn_untrainable(graph.name, int(np.count_nonzero(graph.labels[graph.train_idx] >= 0)))
    check_classes(graph.name, graph.num_classes)
    prepare_out_dir(out, force)
    t0 = time.perf_counter()
    layout = PartLayout.build(parts, num_parts)
    pairs = HaloPairs.build(graph, layout)
    log.info("halo maps: %s halo rows in all, edge cut %s (%.1f s)", f"{len(pairs.by_sender):,}",
             f"{pairs.edge_cut:,}", time.perf_counter() - t0)
    try:
        entries = _write_parts(graph, layout, pairs, out)
        meta = _meta(graph, num_parts, partitioner, seed, pairs.edge_cut, entries, symmetrize,
                     stamp)
        try:
            write_meta(out, meta)
        except OSError as exc:
            raise write_failed(out / META_NAME, exc) from exc
    except BaseException:
        for f in shard_files(out):
            f.unlink(missing_ok=True)
        raise
    log.info("wrote %s: %d parts, meta.json last", out, num_parts)
    return meta
