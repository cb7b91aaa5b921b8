"""Start-up of a training job: every rank builds its trainer from local files only, then all
ranks agree (one small Allreduce) whether anyone failed and whether all started from the same
inputs (``hpcgnn.train.agreement``), so a bad config or shard, or a rank started with other
inputs, ends the job with no rank left waiting in a collective; rank 0 then prints each distinct
message once, with the ranks that hit it (one gather, only on failure; ``hpcgnn.train.early``,
which also checks the config, ``--out``, ``meta.json`` and the rank count before torch is
imported).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hpcgnn.codecs.base import FULL_PRECISION, CompressionPolicy
from hpcgnn.comm.context import CommContext
from hpcgnn.config import ConfigError, config_source, load_config
from hpcgnn.train.agreement import agree, digest, report_differences, startup_facts
from hpcgnn.train.build import prepare_trainer
from hpcgnn.train.early import USER_ERRORS, gather_errors, report_failures
from hpcgnn.train.records import package_version
from hpcgnn.train.rundir import check_run_dir
from hpcgnn.train.trainer import Trainer


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
                           stop_after=getattr(args, "stop_after", None),
                           source=config_source(args.config, args.set))


def prepare_or_report(ctx: CommContext, args, build=build_trainer):
    """``build(ctx, args)`` (the trainer, or another start-up such as predict's), or None on
    every rank when any rank failed or the ranks' inputs differ (``hpcgnn.train.agreement``);
    then rank 0 alone says why, once per distinct message, with the ranks that hit it
    (``ranks 0-3: ...``)."""
    job, error, facts = None, None, None
    try:
        job = build(ctx, args)
        facts = startup_facts(getattr(job, "trainer", job).record, args, package_version())
    except USER_ERRORS as exc:
        error = str(exc)
    failed, differ = agree(ctx, error is not None, digest(facts) if facts else 0)
    if failed:                                     # one small Allreduce on the good path
        report_failures(gather_errors(ctx.comm, error))
        return None
    if differ:
        report_differences(ctx, facts)
        return None
    return job
