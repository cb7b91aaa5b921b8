"""What an ``hpcgnn predict`` output directory holds, and whether ``--out`` may be written.

Torch-free, so that ``predict`` checks ``--out`` with its other early checks, on every rank,
before torch is imported (``hpcgnn.train.early.predict_checks``). ``predict`` writes
``part-NNNNN.h5`` files and ``meta.json``: the names of a shard set's files. So ``--out`` must
be a new or empty directory, or an earlier prediction output (replaced); a directory that holds a
shard set, a training run or other part files, the ``--shards`` or ``--run`` directory itself, or
a path that is a file, is refused with the fix.
"""
from __future__ import annotations

import json
from pathlib import Path

import h5py

from hpcgnn.data.errors import H5_ERRORS
from hpcgnn.data.shard import META_NAME                           # a shard set's name too
from hpcgnn.train.rundir import check_dir_path, describe_run     # torch-free too

PRED_VERSION = 1
FIELDS = ("global_id", "pred", "logits", "embedding")
PART_GLOB = "part-*.h5"


class PredictError(ValueError):
    """A run, checkpoint or prediction directory that cannot be used; names the file and fix."""


def check_out_dir(out: Path, shards: Path, run: Path) -> None:
    """Raise ``PredictError`` unless ``out`` is absent, empty of parts and ``meta.json``, or an
    earlier prediction output. Reads ``meta.json`` and the part files' attributes only."""
    out = Path(out)
    fix = "give --out a new or empty directory (or an earlier `hpcgnn predict` output)"
    for name, other in (("--shards", shards), ("--run", run)):
        if out.resolve() == Path(other).resolve():
            raise PredictError(f"--out {out}: is the {name} directory; predict writes "
                               f"part-NNNNN.h5 and {META_NAME} there and would replace its "
                               f"files; {fix}")
    check_dir_path(out, "--out", fix)
    if not out.is_dir():
        return
    what = describe_run(out)
    if what is not None:
        raise PredictError(f"--out {out}: holds {what}; predict would write beside it; {fix}")
    meta = out / META_NAME
    if meta.is_file():
        if _is_prediction_meta(meta):
            return          # an earlier prediction: no part file opened (every rank runs this)
        holds = "a shard set" if (out / "part-00000.h5").is_file() else "another tool's meta.json"
        raise PredictError(f"--out {out}: holds {holds} ({META_NAME} is not a prediction's); "
                           f"predict would replace its meta.json and part files; {fix}")
    for part in sorted(out.glob(PART_GLOB)):    # no meta.json: an interrupted predict's, or not
        if not is_prediction_part(part):
            raise PredictError(f"--out {out}: {part.name} is not a prediction part (a shard's, "
                               f"or another file); predict would replace it; {fix}")


def stale_parts(out: Path, num_parts: int) -> list[Path]:
    """Prediction parts in ``out`` beyond ``num_parts`` (an earlier predict on more ranks)."""
    return [p for p in sorted(Path(out).glob(PART_GLOB))
            if (_index(p) or 0) >= num_parts and is_prediction_part(p)]


def is_prediction_part(path: Path) -> bool:
    try:
        with h5py.File(path, "r") as f:
            return "epochs_done" in f.attrs and "pred" in f and "logits" in f
    except H5_ERRORS:
        return False            # unreadable: not ours to overwrite


def _is_prediction_meta(path: Path) -> bool:
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "run" in meta and "parts" not in meta


def _index(path: Path) -> int | None:
    digits = path.name[len("part-"):-len(".h5")]
    return int(digits) if digits.isdigit() else None
