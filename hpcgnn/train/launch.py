"""Start-up of a training job: every rank builds its trainer from local files only, then all
ranks agree (one tiny Allreduce) whether anyone failed, so a bad config or shard ends the job
with a clear message from every rank that hit it and no rank left waiting in a collective.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hpcgnn.codecs.base import FULL_PRECISION, CompressionPolicy
from hpcgnn.comm.collectives import any_true
from hpcgnn.comm.context import CommContext
from hpcgnn.config import ConfigError, load_config
from hpcgnn.log import get_logger
from hpcgnn.train.build import prepare_trainer
from hpcgnn.train.trainer import Trainer

# Errors a user can cause and fix (bad file, bad key, bad value); anything else is a bug and
# aborts the job with a traceback (python -m mpi4py).
USER_ERRORS = (ValueError, OSError)


def load_policy(path: str | None) -> CompressionPolicy:
    """The schedule file's policy, or full precision without ``--schedule``."""
    if path is None:
        return FULL_PRECISION
    try:
        from hpcgnn.schedule import load_schedule
    except ImportError as exc:
        raise ConfigError(f"--schedule {path}: this hpcgnn has no schedule support ({exc}); "
                          f"run without --schedule") from exc
    return load_schedule(path)


def build_trainer(ctx: CommContext, args) -> Trainer:
    cfg = load_config(args.config, args.set)
    if args.out:                                   # the resolved config says where the run is
        cfg = replace(cfg, run=replace(cfg.run, out=str(args.out)))
    policy = load_policy(args.schedule)
    run_dir = Path(cfg.run.out)
    return prepare_trainer(ctx, cfg, args.shards, run_dir, policy, resume=args.resume,
                           force=getattr(args, "force", False),
                           stop_after=getattr(args, "stop_after", None))


def prepare_or_report(ctx: CommContext, args, build=build_trainer):
    """``build(ctx, args)`` (the trainer, or another start-up such as predict's), or None on
    every rank when any rank failed (after each says why)."""
    log = get_logger()
    trainer, error = None, None
    try:
        trainer = build(ctx, args)
    except USER_ERRORS as exc:
        log.error("%s", exc)
        error = str(exc)
    failures = first_failure(ctx, error)
    if failures is None:
        return trainer
    if error is None:                   # say why on this rank too: the first failing rank's words
        log.error("stopping: another rank failed at start-up (rank %d: %s)", *failures)
    return None


def first_failure(ctx: CommContext, error: str | None) -> tuple[int, str] | None:
    """(rank, message) of the lowest rank whose start-up failed, on every rank; None if none.
    One tiny Allreduce; the message travels (one Bcast) only when some rank failed."""
    if not any_true(ctx, error is not None):
        return None
    if ctx.size == 1:
        return 0, error
    from mpi4py import MPI
    root = int(ctx.comm.allreduce(ctx.rank if error is not None else ctx.size, op=MPI.MIN))
    return root, ctx.comm.bcast(error, root=root)
