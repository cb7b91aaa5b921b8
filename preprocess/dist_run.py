"""The driver of the distributed preprocessing (steps in ``preprocess/distributed.py``)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np

from hpcgnn.data.shard import META_NAME, part_entry, part_name, write_meta, write_shard
from hpcgnn.data.validate import warn_split_overlap
from preprocess.dist_halo import build_shards
from preprocess.distributed import add_reverse, collective, csr_of_keys, known_nodes, \
    local_keys, move_to_writers, on_root, random_parts_slice, read_slice, row_bounds
from preprocess.errors import PreprocessError
from preprocess.exchange import round_bytes
from preprocess.partition import check_parts, warn_empty_parts
from preprocess.write import check_classes, check_out_dir, input_stamp, meta_fields, \
    prepare_out_dir, shard_files, warn_untrainable, write_failed

log = logging.getLogger("hpcgnn.preprocess")


def check_shared_out(comm, out: Path) -> None:
    """Every rank sees the folder rank 0 writes ``out`` into: rank 0 puts an empty probe file
    in the nearest folder of ``out`` that exists, and the others look for it. A node-local
    ``--out`` (``/tmp``, ``$TMPDIR``) on a multi-node job is refused here, before the input is
    read, not at the write hours later. Collective; the same outcome on every rank."""
    probe = None
    if comm.rank == 0:
        try:
            base = out
            while not base.is_dir() and base != base.parent:
                base = base.parent
            probe = base / f".hpcgnn-shared-test-{os.getpid()}"
            probe.write_bytes(b"")
        except OSError:              # check_out_dir found it writable: a race; skip the check
            probe = None
    probe = comm.bcast(None if probe is None else str(probe), root=0)
    seen = probe is None or comm.rank == 0
    for _ in range(50):              # a shared file system may show a new file a little late
        if seen or Path(probe).exists():
            seen = True
            break
        time.sleep(0.1)
    blind = [r for r, ok in enumerate(comm.allgather(seen)) if not ok]
    if comm.rank == 0 and probe is not None:
        Path(probe).unlink(missing_ok=True)
    if blind:
        raise PreprocessError(
            f"{out}: rank(s) {', '.join(map(str, blind))} of {comm.size} do not see the folder "
            f"rank 0 writes to ({Path(probe).parent}): every rank writes its own parts there; "
            f"choose an --out on a file system all the job's nodes share (not node-local "
            f"storage such as /tmp or $TMPDIR)")


def _partition(comm, partitioner: str, sym_indptr, sym_cols, lo: int, hi: int, n: int,
               num_parts: int, seed: int) -> np.ndarray:
    """Parts (int64 [hi - lo]) of this rank's rows."""
    if partitioner == "random":
        return random_parts_slice(lo, hi, n, num_parts, seed)
    from preprocess.ptscotch import PtScotch
    scotch = collective(comm, PtScotch, comm)
    if num_parts == 1:
        return np.zeros(hi - lo, dtype=np.int64)
    parts = scotch.part(sym_indptr, sym_cols, num_parts, seed)
    sizes = comm.allreduce(np.bincount(parts, minlength=num_parts))
    if comm.rank == 0:
        warn_empty_parts("PT-Scotch", sizes)
    return parts


def _write_own(shards: list, out: Path) -> list[dict]:
    entries = []
    for s in shards:
        path = out / part_name(s.part_id)
        try:
            write_shard(path, s)
        except (OSError, RuntimeError) as exc:
            raise write_failed(path, exc) from exc
        entries.append({"part": s.part_id, **part_entry(path, s)})
    return entries


def _finish(comm, out: Path, entries: list[dict], meta: dict) -> dict:
    """Rank 0 writes meta.json once every rank's parts are in; any failure removes them all."""
    gathered = comm.gather(entries, root=0)
    if comm.rank == 0:
        parts = sorted((e for es in gathered for e in es), key=lambda e: e["part"])
        meta["parts"] = [{k: v for k, v in e.items() if k != "part"} for e in parts]
        try:
            write_meta(out, meta)
        except OSError as exc:
            raise write_failed(out / META_NAME, exc) from exc
    return meta


def _clean_slice(comm, sl, symmetrize: bool, bounds: np.ndarray) -> tuple:
    """(indptr, cols) of the cleaned slice as written, and of its symmetric closure (the same
    arrays when the input is symmetrised; both are only read)."""
    n = sl.num_nodes
    keys = local_keys(sl)
    sym = csr_of_keys(add_reverse(comm, keys, n, bounds), n, sl.lo, sl.hi)
    data = sym if symmetrize else csr_of_keys(keys, n, sl.lo, sl.hi)
    del keys
    return data, sym


def _write_set(comm, out: Path, force: bool, shards: list, meta: dict) -> dict:
    """Every writer writes its parts, then rank 0 ``meta.json``; on any failure rank 0
    removes the set."""
    on_root(comm, prepare_out_dir, out, force)
    try:
        entries = collective(comm, _write_own, shards, out)
        return collective(comm, _finish, comm, out, entries, meta, name_ranks=False)
    except BaseException:
        for f in shard_files(out) if comm.rank == 0 else []:
            f.unlink(missing_ok=True)
        raise


def run_distributed(comm, spec: str, num_parts: int, partitioner: str, out: str, seed: int,
                    force: bool, symmetrize: bool) -> dict:
    """Partition ``spec`` into ``num_parts`` parts across the ranks of ``comm`` and write the
    shard set to ``out``; every rank returns the meta (rank 0 wrote it). Collective."""
    t0, out = time.perf_counter(), Path(out)
    on_root(comm, check_out_dir, out, force)
    check_shared_out(comm, out)
    collective(comm, round_bytes)                 # a bad value fails here, not hours later
    collective(comm, lambda: check_parts(num_parts, known_nodes(spec, symmetrize)))
    stamp = comm.bcast(input_stamp(spec) if comm.rank == 0 else None, root=0)   # as read
    sl = collective(comm, read_slice, spec, comm, symmetrize)
    n, bounds = sl.num_nodes, row_bounds(sl.num_nodes, comm.size)
    collective(comm, check_parts, num_parts, n)
    warn_untrainable(sl.name, comm.allreduce(  # the same count, so the same outcome, on every rank
        int(np.count_nonzero(sl.masks["train_mask"] & (sl.labels >= 0)))))
    train = sl.masks["train_mask"]
    overlaps = {name: comm.allreduce(int(np.count_nonzero(train & sl.masks[f"{name[:-4]}_mask"])))
                for name in ("val_idx", "test_idx")}
    if comm.rank == 0:
        warn_split_overlap(sl.name, overlaps)
    num_classes = comm.allreduce(int(sl.labels.max()) + 1 if sl.labels.size else 0, op=_max()) \
        if sl.classes is None else sl.classes          # every rank read the same key
    collective(comm, check_classes, sl.name, num_classes)
    (indptr, cols), (sym_indptr, sym_cols) = _clean_slice(comm, sl, symmetrize, bounds)
    log.log(_level(comm), "rank %d: rows %d:%d, %s edges, %s symmetric (%.1f s, peak %s)",
            comm.rank, sl.lo, sl.hi, f"{len(cols):,}", f"{len(sym_cols):,}",
            time.perf_counter() - t0, _peak())
    parts = _partition(comm, partitioner, sym_indptr, sym_cols, sl.lo, sl.hi, n, num_parts,
                       seed)
    log.log(_level(comm), "rank %d: partitioned (%s, %.1f s, peak %s)", comm.rank, partitioner,
            time.perf_counter() - t0, _peak())
    del sym_indptr, sym_cols
    degree = np.diff(indptr)
    moved = move_to_writers(comm, sl, indptr, cols, parts, num_parts)
    meta = dict(dataset=sl.name, feature_dim=int(sl.features.shape[1]))
    del sl, indptr, cols
    shards, cut = build_shards(comm, moved, num_parts, bounds, parts, degree,
                               int(bounds[comm.rank]), n)
    log.log(_level(comm), "rank %d: moved rows to their writers, built halo maps (%.1f s, "
            "peak %s)", comm.rank, time.perf_counter() - t0, _peak())
    del moved
    meta = meta_fields(meta["dataset"], n, comm.allreduce(sum(s.num_edges for s in shards)),
                       meta["feature_dim"], num_classes,
                       num_parts, partitioner, seed, comm.allreduce(cut), symmetrize=symmetrize,
                       stamp=stamp)
    meta = _write_set(comm, out, force, shards, meta)
    log.log(_level(comm), "rank %d: wrote parts %s (%.1f s)", comm.rank,
            [s.part_id for s in shards], time.perf_counter() - t0)
    return meta


def _peak() -> str:
    """This process's peak resident set so far (VmHWM), for the progress lines."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return f"{int(line.split()[1]) / 2**20:.2f} GiB"
    except OSError:
        pass
    return "n/a"


def _level(comm) -> int:
    """Rank 0 speaks at INFO, the others at DEBUG."""
    return logging.INFO if comm.rank == 0 else logging.DEBUG


def _max():
    from mpi4py import MPI
    return MPI.MAX
