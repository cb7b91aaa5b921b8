"""The on-disk shard format: one module that both the writer (`preprocess`) and the reader
(the trainer) import, so the two sides cannot drift apart.

A shard set is a directory::

    DIR/meta.json            written last; lists every part with its sha256
    DIR/part-00000.h5 ...    one HDF5 file per rank (layout: ``DATASETS`` below)

Every file carries ``format_version``; every read checks it. Every write goes to a temporary
name in the same directory and is renamed into place, so an interrupted or failed write never
leaves a file that looks complete.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

import h5py
import numpy as np

from hpcgnn.data.errors import H5_ERRORS, hdf5_fix

FORMAT_VERSION = 1
META_NAME = "meta.json"
META_KEYS = ("format_version", "dataset", "num_nodes", "num_edges", "feature_dim",
             "num_classes", "num_parts", "partitioner", "seed", "edge_cut", "parts")
PART_KEYS = ("file", "num_owned", "num_halo", "num_edges", "sha256")
# optional in a part entry (sets written before it lack it): the part's labelled training nodes
NUM_TRAIN = "num_train"
# meta.json's numbers and the least each may be (seed: any integer)
META_INTS = {"format_version": None, "num_nodes": 1, "num_edges": 0, "feature_dim": 1,
             "num_classes": 1, "num_parts": 1, "seed": None, "edge_cut": 0}
PART_INTS = {"num_owned": 0, "num_halo": 0, "num_edges": 0, NUM_TRAIN: 0}

# field name -> (HDF5 path, dtype)
DATASETS = {
    "global_id": ("nodes/global_id", np.int64),
    "features": ("nodes/features", np.float32),
    "label": ("nodes/label", np.int64),
    "train_mask": ("nodes/train_mask", np.bool_),
    "val_mask": ("nodes/val_mask", np.bool_),
    "test_mask": ("nodes/test_mask", np.bool_),
    "degree": ("nodes/degree", np.int64),
    "halo_global_id": ("halo/global_id", np.int64),
    "halo_degree": ("halo/degree", np.int64),
    "recv_counts": ("halo/recv_counts", np.int64),
    "send_counts": ("halo/send_counts", np.int64),
    "send_index": ("halo/send_index", np.int64),
    "indptr": ("graph/indptr", np.int64),
    "indices": ("graph/indices", np.int64),
}

PartId = int


class ShardFormatError(ValueError):
    """A shard file or shard set that is missing, corrupt, or of another format."""


def part_name(part_id: PartId) -> str:
    """File name of part ``part_id`` inside a shard directory."""
    return f"part-{part_id:05d}.h5"


@dataclass
class Shard:
    """One part of a partitioned graph, as stored: the owned nodes, their halo and the plan.

    Local numbering: owned nodes are ``0 .. n_owned-1`` (ascending global id), halo slots are
    ``n_owned .. n_owned+n_halo-1``, grouped by owner part.
    """

    part_id: PartId
    num_parts: int
    global_id: np.ndarray       # int64 [n_owned], ascending
    features: np.ndarray        # float32 [n_owned, F]
    label: np.ndarray           # int64 [n_owned], -1 = unlabelled
    train_mask: np.ndarray      # bool [n_owned]
    val_mask: np.ndarray        # bool [n_owned]
    test_mask: np.ndarray       # bool [n_owned]
    degree: np.ndarray          # int64 [n_owned], global in-degree, no self-loop
    halo_global_id: np.ndarray  # int64 [n_halo]
    halo_degree: np.ndarray     # int64 [n_halo]
    recv_counts: np.ndarray     # int64 [num_parts]
    send_counts: np.ndarray     # int64 [num_parts]
    send_index: np.ndarray      # int64 [sum send_counts], owned local indices
    indptr: np.ndarray          # int64 [n_owned + 1]
    indices: np.ndarray         # int64 [nnz]

    @property
    def n_owned(self) -> int:
        return int(self.global_id.shape[0])

    @property
    def n_halo(self) -> int:
        return int(self.halo_global_id.shape[0])

    @property
    def feature_dim(self) -> int:
        return int(self.features.shape[1])

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])


def num_train(s: Shard) -> int:
    """Labelled training nodes of a part (``meta.json``'s ``parts[i].num_train``)."""
    return int(np.count_nonzero(s.train_mask & (s.label >= 0)))


def part_entry(path: Path, s: Shard) -> dict:
    """The ``meta.json`` entry of the part ``s`` just written to ``path``."""
    return {"file": path.name, "num_owned": s.n_owned, "num_halo": s.n_halo,
            "num_edges": s.num_edges, NUM_TRAIN: num_train(s), "sha256": sha256_file(path)}


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_shard(path: str | os.PathLike, shard: Shard) -> None:
    """Write ``shard`` to ``path`` atomically (temporary name, fsync, rename)."""
    path = Path(path)
    _check_shard(shard, path)
    tmp = _tmp_name(path)
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["part_id"] = shard.part_id
            f.attrs["num_parts"] = shard.num_parts
            for name, (h5path, dtype) in DATASETS.items():
                f.create_dataset(h5path, data=np.ascontiguousarray(getattr(shard, name), dtype=dtype))
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_shard(path: str | os.PathLike, *, part_id: PartId | None = None,
               num_parts: int | None = None, features: bool = True) -> Shard:
    """Read and check one part file. Raises ShardFormatError naming the file and the fix.

    ``features=False``: ``nodes/features`` is not read; the Shard holds a read-only zero-stride
    placeholder of its shape (no memory), to be filled with ``read_features_into``."""
    path = Path(path)
    fix = "re-run `python -m preprocess` to rewrite the shard set"
    if not path.is_file():
        raise ShardFormatError(f"{path}: shard file not found; {fix}")
    try:
        with h5py.File(path, "r") as f:
            version = f.attrs.get("format_version")
            if version != FORMAT_VERSION:
                raise ShardFormatError(f"{path}: format_version {version!r}, this hpcgnn reads "
                                       f"{FORMAT_VERSION}; {fix}")
            arrays = {}
            for name, (h5path, dtype) in DATASETS.items():
                if h5path not in f:
                    raise ShardFormatError(f"{path}: dataset '{h5path}' is missing; {fix}")
                if name == "features" and not features:
                    arrays[name] = np.broadcast_to(np.zeros((), dtype), f[h5path].shape)
                    continue
                arrays[name] = np.asarray(f[h5path][...]).astype(dtype, copy=False)
            shard = Shard(part_id=int(f.attrs["part_id"]), num_parts=int(f.attrs["num_parts"]),
                          **arrays)
    except ShardFormatError:
        raise
    except H5_ERRORS as exc:
        raise ShardFormatError(f"{path}: not a readable HDF5 shard ({exc}); {hdf5_fix(exc, fix)}") from exc
    if part_id is not None and shard.part_id != part_id:
        raise ShardFormatError(f"{path}: holds part {shard.part_id}, expected part {part_id}; {fix}")
    if num_parts is not None and shard.num_parts != num_parts:
        raise ShardFormatError(f"{path}: belongs to a {shard.num_parts}-part set, expected "
                               f"{num_parts} parts; {fix}")
    _check_shard(shard, path, values=features)
    return shard


def read_features_into(path: str | os.PathLike, out: np.ndarray, rows: np.ndarray,
                       block_bytes: int = 1 << 20) -> None:
    """``out[rows[i]] = nodes/features[i]`` for every owned row ``i`` of the part file ``path``,
    read in blocks of about ``block_bytes`` (the only memory beyond ``out``); checks that the
    values are finite. ``out``: float32 ``(n, F)``; ``rows``: int64 ``[n_owned]``."""
    path = Path(path)
    fix = "re-run `python -m preprocess` to rewrite the shard set"
    try:
        with h5py.File(path, "r") as f:
            dset = f[DATASETS["features"][0]]
            if dset.shape != (rows.shape[0], out.shape[1]):
                raise ShardFormatError(f"{path}: nodes/features is {dset.shape}, expected "
                                       f"{(rows.shape[0], out.shape[1])}; {fix}")
            step = max(1, min(rows.shape[0], block_bytes // max(1, out.shape[1] * out.itemsize)))
            buf = np.empty((step, out.shape[1]), dtype=out.dtype)     # one block, reused
            finite = np.empty(buf.shape, dtype=bool)
            for a in range(0, rows.shape[0], step):
                n = min(step, rows.shape[0] - a)
                dset.read_direct(buf, np.s_[a:a + n], np.s_[0:n])
                if not np.isfinite(buf[:n], out=finite[:n]).all():
                    raise ShardFormatError(f"{path}: nodes/features holds NaN or inf; {fix}")
                out[rows[a:a + n]] = buf[:n]
    except ShardFormatError:
        raise
    except H5_ERRORS as exc:
        raise ShardFormatError(f"{path}: cannot read nodes/features ({exc}); {hdf5_fix(exc, fix)}") from exc


def _check_shard(s: Shard, path: Path, values: bool = True) -> None:
    """Shape and range checks that need only this one part (``values``: the features' values
    too; off when they were not read)."""
    n, h, p = s.n_owned, s.n_halo, s.num_parts

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ShardFormatError(f"{path}: {what}; re-run `python -m preprocess` to rewrite the "
                                   f"shard set")

    need(0 <= s.part_id < p, f"part_id {s.part_id} outside 0..{p - 1}")
    need(s.features.ndim == 2 and s.features.shape[0] == n, "nodes/features is not [n_owned, F]")
    for name in ("label", "train_mask", "val_mask", "test_mask", "degree"):
        need(getattr(s, name).shape == (n,), f"{DATASETS[name][0]} is not [n_owned]")
    need(s.halo_degree.shape == (h,), "halo/degree is not [n_halo]")
    need(s.recv_counts.shape == (p,) and s.send_counts.shape == (p,),
         "halo/recv_counts or send_counts is not [num_parts]")
    need(int(s.recv_counts.sum()) == h, "halo/recv_counts does not sum to n_halo")
    need(s.recv_counts[s.part_id] == 0 and s.send_counts[s.part_id] == 0,
         "a part sends to or receives from itself")
    need(s.send_index.shape == (int(s.send_counts.sum()),), "halo/send_index length != sum(send_counts)")
    need(s.send_index.size == 0 or (s.send_index.min() >= 0 and s.send_index.max() < n),
         "halo/send_index holds an index outside the owned nodes")
    need(s.indptr.shape == (n + 1,) and s.indptr[0] == 0 and bool(np.all(np.diff(s.indptr) >= 0)),
         "graph/indptr is not a CSR row pointer over the owned nodes")
    need(s.indptr[-1] == s.indices.shape[0], "graph/indptr[-1] != len(graph/indices)")
    need(s.indices.size == 0 or (s.indices.min() >= 0 and s.indices.max() < n + h),
         "graph/indices holds an index outside owned + halo")
    need(bool(np.all(np.diff(s.global_id) > 0)), "nodes/global_id is not strictly ascending")
    need(not values or bool(np.isfinite(s.features).all()), "nodes/features holds NaN or inf")


def write_meta(directory: str | os.PathLike, meta: dict) -> None:
    """Write ``meta.json`` atomically; call it last, after every part is in place."""
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"meta.json would lack {missing}")
    path = Path(directory) / META_NAME
    tmp = _tmp_name(path)
    try:
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_meta(directory: str | os.PathLike) -> dict:
    """Read and check ``DIR/meta.json``. Raises ShardFormatError naming the file and the fix."""
    path = Path(directory) / META_NAME
    fix = "run `python -m preprocess --out DIR ...` to write a complete shard set"
    if Path(directory).is_file():               # e.g. the set's meta.json or a part file itself
        inside = (Path(directory).parent / META_NAME).is_file()
        raise ShardFormatError(
            f"{directory}: is a file, not a shard directory; pass the directory that holds "
            f"meta.json and the part files" + (f" ({Path(directory).parent})" if inside else
                                               f", or {fix}"))
    if not Path(directory).is_dir():
        raise ShardFormatError(f"{directory}: shard directory not found; {fix}")
    if not path.is_file():
        raise ShardFormatError(f"{path}: missing, so {directory} is not a complete shard set; {fix}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShardFormatError(f"{path}: unreadable ({exc}); {fix}") from exc
    if not isinstance(meta, dict):
        raise ShardFormatError(f"{path}: not a JSON object; {fix}")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ShardFormatError(f"{path}: lacks key(s) {missing}; {fix}")
    if meta["format_version"] != FORMAT_VERSION:
        raise ShardFormatError(f"{path}: format_version {meta['format_version']!r}, this hpcgnn "
                               f"reads {FORMAT_VERSION}; {fix}")
    _check_meta_types(path, meta)
    if len(meta["parts"]) != meta["num_parts"]:
        raise ShardFormatError(f"{path}: lists {len(meta['parts'])} parts, num_parts is "
                               f"{meta['num_parts']}; {fix}")
    for i, part in enumerate(meta["parts"]):
        _check_part_entry(path, i, part)
    return meta


META_FIX = ("meta.json is written by `python -m preprocess`, not by hand: re-run it with --force "
            "to rewrite the shard set")


def _meta_field(path: Path, field: str, value, want: str) -> ShardFormatError:
    return ShardFormatError(f"{path}: field '{field}' is {value!r} ({type(value).__name__}), "
                            f"expected {want}; {META_FIX}")


def _check_int(path: Path, field: str, value, least: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or \
            (least is not None and value < least):
        raise _meta_field(path, field, value, "an integer" if least is None
                          else f"an integer >= {least}")


def _check_meta_types(path: Path, meta: dict) -> None:
    """Every field of ``meta.json`` has its type and range (a message names the field)."""
    for key, least in META_INTS.items():
        _check_int(path, key, meta[key], least)
    for key in ("dataset", "partitioner"):
        if not isinstance(meta[key], str):
            raise _meta_field(path, key, meta[key], "a string")
    if not isinstance(meta["parts"], list):
        raise _meta_field(path, "parts", meta["parts"], "a list with one entry per part")


def _check_part_entry(path: Path, i: int, part) -> None:
    """``parts[i]``: its file name, counts and sha256 (``num_train`` where present)."""
    if not isinstance(part, dict) or any(k not in part for k in PART_KEYS):
        raise ShardFormatError(f"{path}: parts[{i}] lacks one of {list(PART_KEYS)}; {META_FIX}")
    if part["file"] != part_name(i):
        raise _meta_field(path, f"parts[{i}].file", part["file"], repr(part_name(i)))
    for key, least in PART_INTS.items():
        if key in part:
            _check_int(path, f"parts[{i}].{key}", part[key], least)
    sha = part["sha256"]
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise _meta_field(path, f"parts[{i}].sha256", sha, "64 hex digits")
    if part.get(NUM_TRAIN, 0) > part["num_owned"]:
        raise _meta_field(path, f"parts[{i}].{NUM_TRAIN}", part[NUM_TRAIN],
                          f"at most num_owned = {part['num_owned']}")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_field_names() -> list[str]:
    """Names of the array fields of ``Shard`` (for tests and tools)."""
    return [f.name for f in fields(Shard) if f.name not in ("part_id", "num_parts")]


def read_global_ids(directory: str | os.PathLike, part_id: PartId) -> np.ndarray:
    """``nodes/global_id`` of one part of a shard set (ascending), read alone."""
    path = Path(directory) / part_name(part_id)
    try:
        with h5py.File(path, "r") as f:
            return np.asarray(f["nodes/global_id"][...], dtype=np.int64)
    except H5_ERRORS as exc:
        fix = hdf5_fix(exc, "re-run `python -m preprocess` to rewrite the shard set")
        raise ShardFormatError(f"{path}: cannot read nodes/global_id ({exc}); {fix}") from exc
