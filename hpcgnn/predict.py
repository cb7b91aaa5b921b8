"""``hpcgnn predict``: per-node predictions and embeddings of a trained run, one HDF5 file per part.

``mpirun -n R python -m mpi4py -m hpcgnn predict --run RUN_DIR --shards DIR --out PRED_DIR``
(R = the shard set's part count). Reads ``RUN_DIR/config.toml``, ``RUN_DIR/schedule.toml`` (the
learned codec's modules are part of the checkpoint; ``recorded_schedule``) and ``RUN_DIR/checkpoint.pt`` and runs the
trainer's evaluation forward: uncompressed, no dropout, one exchange per layer.

``PRED_DIR/part-NNNNN.h5`` (attributes ``format_version``, ``part_id``, ``num_parts``,
``epochs_done``), each written to a temporary name and renamed:

| dataset | type, shape | meaning |
|---|---|---|
| ``global_id`` | int64 ``[n]`` | the part's owned nodes, ascending |
| ``pred`` | int64 ``[n]`` | ``argmax`` of the logits |
| ``logits`` | float32 ``[n, C]`` | the last layer's output |
| ``embedding`` | float32 ``[n, H]`` | the last layer's input: the last hidden layer's output after its activation (ReLU; GAT: ELU, ``H = heads x hidden``), the features when ``model.layers = 1`` |

``PRED_DIR/meta.json`` is written last, by rank 0, once every part is in place; without it the
directory is incomplete. ``read_predictions(PRED_DIR)`` gathers the parts in global-id order for
graphs that fit one process.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, replace
from pathlib import Path

import h5py
import numpy as np
import torch

from hpcgnn.codecs.base import FULL_PRECISION
from hpcgnn.comm.collectives import bcast_bytes
from hpcgnn.comm.context import CommContext
from hpcgnn.config import ParallelConfig
from hpcgnn.data.errors import H5_ERRORS, hdf5_fix
from hpcgnn.data.shard import part_name
from hpcgnn.log import get_logger
from hpcgnn.train import checkpoint as ckpt
from hpcgnn.train.records import CONFIG_NAME, SCHEDULE_NAME
from hpcgnn.train.build import prepare_trainer
from hpcgnn.train.early import read_run_config
from hpcgnn.train.outdir import FIELDS, META_NAME, PRED_VERSION, PredictError, stale_parts
from hpcgnn.train.trainer import Trainer
from hpcgnn.train.writes import atomic_write_bytes, atomic_write_text, fatal_if_unwritable

log = get_logger()


@dataclass
class Predictor:
    """One rank's predict job: the trainer's model and data, the checkpoint (rank 0 only)."""

    trainer: Trainer
    out: Path
    checkpoint: bytes | None

    def run(self) -> Path:
        """Load the checkpoint everywhere, forward once, write this rank's part, then meta.json."""
        ctx, tr = self.trainer.ctx, self.trainer
        if ctx.is_root:
            (self.out / META_NAME).unlink(missing_ok=True)      # incomplete until rewritten
            for old in stale_parts(self.out, ctx.size):         # an earlier predict's, more parts
                old.unlink()
        data = bcast_bytes(ctx, self.checkpoint)         # in pieces of [comm] max_message
        state = ckpt.decode_checkpoint(data, tr.run_dir)
        tr.model.load_state_dict(state["model"])
        logits, embedding = forward_outputs(tr)
        done = int(state["progress"]["epochs_done"])
        kept = "meta.json is not written, so the output is not taken for a finished one: run predict again"
        with fatal_if_unwritable(ctx, self.out / part_name(ctx.rank), kept, "pass another --out"):
            write_part(self.out, ctx.rank, ctx.size, done, {
                "global_id": tr.data.global_id, "pred": logits.argmax(dim=1), "logits": logits,
                "embedding": embedding})
        if ctx.size > 1:
            ctx.comm.Barrier()                                    # every part is in place
        if ctx.is_root:
            with fatal_if_unwritable(ctx, self.out / META_NAME, kept, "pass another --out"):
                _write_meta(self.out, tr, done)
        return self.out


def forward_outputs(trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits ``(n, C)``, embedding ``(n, H)``): the evaluation forward, and the input of the
    last layer captured on its way in (dropout is off in evaluation)."""
    seen: list[torch.Tensor] = []
    hook = trainer.model.layers[-1].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        logits = trainer.eval_logits(trainer.progress.epochs_done)
    finally:
        hook.remove()
    return logits, seen[0]


def write_part(out: Path, part_id: int, num_parts: int, epochs_done: int, arrays: dict) -> Path:
    """``out/part-NNNNN.h5`` via a temporary name and a rename (float tensors as float32). The
    HDF5 file is made in memory and written with plain file I/O: HDF5 writing to a full disk
    raised a cascade of errors and could crash the process (exit 139) before the error was
    reported."""
    path = Path(out) / part_name(part_id)
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        f.attrs.update(format_version=PRED_VERSION, part_id=part_id, num_parts=num_parts,
                       epochs_done=epochs_done)
        for name in FIELDS:
            a = arrays[name].detach().cpu().numpy()
            f.create_dataset(name, data=a.astype(np.float32 if a.dtype.kind == "f" else np.int64,
                                                 copy=False))   # no copy of what is already so
    atomic_write_bytes(path, buf.getbuffer())
    return path


def _write_meta(out: Path, tr: Trainer, epochs_done: int) -> None:
    meta = {"format_version": PRED_VERSION, "num_parts": tr.ctx.size,
            "num_nodes": int(tr.meta["num_nodes"]), "num_classes": int(tr.meta["num_classes"]),
            "dataset": tr.meta.get("dataset"), "run": str(tr.run_dir.resolve()),
            "epochs_done": epochs_done}
    atomic_write_text(out / META_NAME, json.dumps(meta, indent=2) + "\n")


# -- start-up (local only: every rank can fail cleanly) --------------------------------------
def build_predictor(ctx: CommContext, args) -> Predictor:
    """Config and schedule from the run directory, this rank's shard, the checkpoint (rank 0)."""
    run_dir = Path(args.run)
    cfg = run_config(run_dir)
    policy = FULL_PRECISION
    if (run_dir / SCHEDULE_NAME).is_file():
        policy = recorded_schedule(run_dir / SCHEDULE_NAME)
    trainer = prepare_trainer(ctx, cfg, args.shards, run_dir, policy, training=False,
                              source=str(run_dir / CONFIG_NAME))
    data = _checked_checkpoint(trainer) if ctx.is_root else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return Predictor(trainer, out, data)


def recorded_schedule(path: Path):
    """The run's schedule. Predict runs uncompressed and needs it only for the learned codec's
    modules (they are in the checkpoint), so a schedule this version refuses that names no
    ``learned`` codec (a run of an earlier version, from before a check was added) is set aside
    with a warning."""
    from hpcgnn.schedule import ScheduleError, load_schedule
    try:
        return load_schedule(path)
    except ScheduleError as err:
        if "learned" in path.read_text(errors="replace"):
            raise
        log.warning("%s. Predict runs uncompressed and needs the schedule only for a learned "
                    "codec, so it goes on without it", err)
        return FULL_PRECISION


def run_config(run_dir: Path):
    """The run's resolved config, set up for an uncompressed, synchronous halo forward on
    R = part-count ranks (a 1.5D or stale run's weights are the same GNN's; a run evaluated
    through its training codecs, ``train.eval_codec = 'train'``, is predicted uncompressed)."""
    cfg = read_run_config(run_dir)
    return replace(cfg, parallel=ParallelConfig(),
                   train=replace(cfg.train, staleness=0, smoothing=0.0, eval_codec="none"))


PREDICT_FIX = ("predict needs the run's whole checkpoint: train the run again (`hpcgnn train "
               "--force` over it), or pass another --run")


def _checked_checkpoint(trainer: Trainer) -> bytes:
    """Rank 0: the checkpoint's bytes, after checking it loads into this model."""
    path = trainer.run_dir / ckpt.CHECKPOINT_NAME
    data = ckpt.read_checkpoint_bytes(trainer.run_dir)
    if data is None:
        raise PredictError(f"{path}: not found; the run has not checkpointed yet (train it, or "
                           f"pass the --run directory that holds checkpoint.pt)")
    state = ckpt.decode_checkpoint(data, trainer.run_dir, fix=PREDICT_FIX)
    try:
        trainer.model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise PredictError(f"{path}: does not fit the model built from {CONFIG_NAME} and this shard "
                           f"set ({str(exc).splitlines()[0]} ...); pass the shard set of the "
                           f"graph the run trained on") from exc
    trainer.check_prediction_state(state)
    record = state.get("record") or {}
    if record.get("meta_sha256") not in (None, trainer.record.meta_sha256):
        log.warning("predicting on shard set %s; the run trained on %s (same shapes, so the "
                    "weights load)", trainer.record.shards_path, record.get("shards"))
    return data


# -- reading ----------------------------------------------------------------------------------
def read_predictions(pred_dir: str | Path) -> dict[str, np.ndarray]:
    """Every part's arrays concatenated in global-id order: ``global_id`` (= 0..N-1), ``pred``
    ``[N]``, ``logits`` ``[N, C]``, ``embedding`` ``[N, H]``. For graphs that fit one process."""
    pred_dir = Path(pred_dir)
    meta_path = pred_dir / META_NAME
    if not meta_path.is_file():
        raise PredictError(f"{meta_path}: not found; {pred_dir} is not a finished `hpcgnn "
                           f"predict` output (run predict again)")
    meta = json.loads(meta_path.read_text())
    parts = [_read_part(pred_dir / part_name(i)) for i in range(meta["num_parts"])]
    out = {name: np.concatenate([p[name] for p in parts]) for name in FIELDS}
    order = np.argsort(out["global_id"], kind="stable")
    out = {name: a[order] for name, a in out.items()}
    if not np.array_equal(out["global_id"], np.arange(meta["num_nodes"])):
        raise PredictError(f"{pred_dir}: the parts do not hold each of the {meta['num_nodes']} "
                           f"nodes once; run predict again into an empty directory")
    return out


def _read_part(path: Path) -> dict[str, np.ndarray]:
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format_version") != PRED_VERSION:
                raise PredictError(f"{path}: format_version {f.attrs.get('format_version')!r}, "
                                   f"this hpcgnn reads {PRED_VERSION}; run predict again")
            return {name: f[name][...] for name in FIELDS}
    except PredictError:
        raise
    except H5_ERRORS as exc:
        raise PredictError(f"{path}: unreadable ({exc}); {hdf5_fix(exc, 'run predict again')}") from exc
