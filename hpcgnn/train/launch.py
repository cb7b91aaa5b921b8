"""Start-up of a training job: every rank builds its trainer from local files only, then all
ranks agree (one tiny Allreduce) whether anyone failed, so a bad config or shard ends the job
with no rank left waiting in a collective; rank 0 then prints each distinct message once, with
the ranks that hit it (one gather, only on failure).
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
from hpcgnn.train.rundir import check_run_dir
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
    check_run_dir(run_dir, args.resume, getattr(args, "force", False))
    return prepare_trainer(ctx, cfg, args.shards, run_dir, policy, resume=args.resume,
                           force=getattr(args, "force", False),
                           stop_after=getattr(args, "stop_after", None))


def prepare_or_report(ctx: CommContext, args, build=build_trainer):
    """``build(ctx, args)`` (the trainer, or another start-up such as predict's), or None on
    every rank when any rank failed; then rank 0 alone says why, once per distinct message,
    with the ranks that hit it (``ranks 0-3: ...``)."""
    trainer, error = None, None
    try:
        trainer = build(ctx, args)
    except USER_ERRORS as exc:
        error = str(exc)
    if not any_true(ctx, error is not None):       # one tiny Allreduce on the good path
        return trainer
    report_failures(ctx, gather_errors(ctx, error))
    return None


def gather_errors(ctx: CommContext, error: str | None) -> list[str | None] | None:
    """Every rank's start-up error (None where it had none), on rank 0; None elsewhere.
    One gather of short strings, only when some rank failed."""
    if ctx.size == 1:
        return [error]
    return ctx.comm.gather(error, root=0)


def report_failures(ctx: CommContext, errors: list[str | None] | None) -> None:
    """Rank 0: one ERROR line per distinct message, naming the ranks that hit it, and which
    ranks stop only because of the others."""
    if errors is None:
        return
    log = get_logger()
    for message, ranks in group_errors(errors):
        log.error("%s: %s", rank_list(ranks), message)
    fine = [r for r, e in enumerate(errors) if e is None]
    if fine:
        log.error("%s: no error; stopping with the others", rank_list(fine))


def group_errors(errors: list[str | None]) -> list[tuple[str, list[int]]]:
    """(message, ranks) per distinct message, in order of the lowest rank that hit it."""
    groups: dict[str, list[int]] = {}
    for rank, message in enumerate(errors):
        if message is not None:
            groups.setdefault(message, []).append(rank)
    return list(groups.items())


def rank_list(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 5] -> 'ranks 0-3, 5'; [2] -> 'rank 2'."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text
