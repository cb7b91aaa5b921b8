"""``python -m hpcgnn train|predict|plot|info|summary``: the thin command line.

Launch training with ``mpirun -n K python -m mpi4py -m hpcgnn train ...`` (``-m mpi4py`` turns
an exception on one rank into an abort of the whole job instead of a hang; ``python -m hpcgnn``
alone does the same for an exception that escapes ``main``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

from hpcgnn.log import get_logger, run_command, say_error, setup_logging

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3           # the training loss was not finite (Trainer.run)
DEVICE_HELP = ("auto (default): cuda when torch sees a GPU, else cpu; on cuda each rank takes the "
               "GPU numbered its node-local rank modulo the GPU count; cuda without a GPU is "
               "refused")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hpcgnn", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train on a K-part shard set (launch with mpirun -n R, R "
                        "dividing K; parallel.algorithm = 1.5d/2d/3d take other counts: "
                        "docs/cagnet.md)")
    tr.add_argument("--shards", required=True, help="shard directory written by `python -m preprocess`")
    tr.add_argument("--config", help="run config TOML (see configs/); defaults if omitted")
    tr.add_argument("--schedule", help="compression schedule TOML (see configs/schedules/)")
    tr.add_argument("--out", help="run directory (overrides run.out)")
    tr.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config key, e.g. --set train.epochs=10 (repeatable)")
    tr.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoint.pt "
                    "(refused when the config, schedule or shard set differs from the run's)")
    tr.add_argument("--force", action="store_true",
                    help="with --resume: continue even though the config/schedule/shards differ; "
                    "without it: start a new run in an --out that holds one (its checkpoint, "
                    "summary and metrics are replaced)")
    tr.add_argument("--stop-after", type=_count, metavar="N",
                    help="checkpoint and stop once N epochs are done (continue with --resume)")
    tr.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help=DEVICE_HELP)
    pr = sub.add_parser("predict", help="per-node predictions and embeddings of a trained run "
                        "(launch with mpirun -n R, R dividing the shard set's part count)")
    pr.add_argument("--run", required=True, help="run directory of `hpcgnn train` (checkpoint.pt)")
    pr.add_argument("--shards", required=True, help="shard directory of the graph to predict on")
    pr.add_argument("--out", required=True, help="output directory: part-NNNNN.h5 + meta.json")
    pr.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help=DEVICE_HELP)
    pl = sub.add_parser("plot", help="loss, accuracy and ratio of runs against epoch and bytes (PNG)")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    pl.add_argument("--out", required=True, help="the PNG file to write")
    sub.add_parser("info", help="print the MPI library, CUDA-awareness, devices and torch")
    sm = sub.add_parser("summary", help="print test accuracy and bytes of a finished run")
    sm.add_argument("run_dir")
    return ap


def _count(text: str) -> int:
    """An integer >= 0 (argparse turns the ValueError into a usage error naming the option)."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


_count.__name__ = "epoch count (an integer >= 0)"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "info":
        return cmd_info()
    if args.cmd == "summary":
        return cmd_summary(Path(args.run_dir))
    if args.cmd == "predict":
        _configure_memory()
        return cmd_predict(args)
    if args.cmd == "plot":
        return cmd_plot(args)
    _configure_memory()
    return cmd_train(args)


def _configure_memory() -> None:
    """``hpcgnn.memory.configure`` before torch is imported (train, predict); a bad
    ``HPCGNN_MALLOC`` ends the job on every rank (each reads its own environment)."""
    from hpcgnn.memory import configure
    try:
        configure()
    except ValueError as exc:
        say_error(f"error: {exc}")
        sys.exit(EXIT_USER_ERROR)


def _start(args, build=None):
    """The MPI context and ``build(ctx, args)`` (the trainer by default), agreed by all ranks;
    a start-up failure on any rank ends the job cleanly with code 2."""
    from hpcgnn.comm.context import CommContext, DeviceUnavailable
    from hpcgnn.train.early import device_failures, device_mix
    from hpcgnn.train.launch import build_trainer, prepare_or_report
    freeze_imports()
    try:
        ctx = CommContext.from_world(args.device)
    except DeviceUnavailable as exc:            # e.g. --device cuda on a node without a GPU:
        setup_logging(exc.rank, exc.size)       # every rank knows which ranks failed, and why
        get_logger().error("%s", device_failures(exc.failures))
        _finalize_and_exit(EXIT_USER_ERROR)
    setup_logging(ctx.rank, ctx.size)
    mixed = device_mix(ctx.mixed_devices)       # --device auto: GPU and CPU ranks alike
    if mixed and ctx.is_root:
        get_logger().warning("%s", mixed)
    job = prepare_or_report(ctx, args, build or build_trainer)
    if job is None:                           # every rank knows: someone failed at start-up
        _finalize_and_exit(EXIT_USER_ERROR)
    return job


def freeze_imports() -> None:
    """Move every object made so far (torch's import alone makes about 170k) into the garbage
    collector's permanent generation, so that no later full collection walks them again, and
    neither does the interpreter's teardown at exit: a rank that imported torch spent about
    0.7 s of CPU leaving otherwise (2-core machine, Python 3.11). Objects the run makes later
    are collected as before; the frozen ones stay freed by reference counting."""
    gc.freeze()


def cmd_predict(args) -> int:
    from hpcgnn.train.early import check_before_torch, predict_checks
    if not check_before_torch(args, predict_checks):   # --run's config, meta.json, rank count
        _finalize_and_exit(EXIT_USER_ERROR)
    from hpcgnn.predict import build_predictor
    out = _start(args, build_predictor).run()
    get_logger().info("predictions in %s (read with hpcgnn.predict.read_predictions)", out)
    return 0


def cmd_train(args) -> int:
    from hpcgnn.train.preempt import process_flag, say_listening
    process_flag().install()             # a SIGUSR1/SIGTERM from here on is kept, not fatal
    from hpcgnn.train.early import check_before_torch
    if not check_before_torch(args):     # config, --out, meta.json, rank count: before torch
        _finalize_and_exit(EXIT_USER_ERROR)
    from mpi4py import MPI
    say_listening(MPI.COMM_WORLD.rank == 0)   # every rank passed install(): tell the job script
    trainer = _start(args)
    if args.force and not args.resume and trainer.ctx.is_root:   # all ranks agreed to start
        _replace_old_run(trainer.run_dir)
    trainer.start()
    outcome = trainer.run()
    process_flag().stand_down()          # decided on every rank: a later signal cannot kill it
    get_logger().info("%s; run directory %s", outcome, trainer.run_dir)
    if outcome == "diverged":             # every rank: the same reduced loss, the same epoch
        _finalize_and_exit(EXIT_DIVERGED)
    return 0


def _replace_old_run(run_dir: Path) -> None:
    """``train --force`` without ``--resume``: the old run's checkpoint, marker and summary go."""
    from hpcgnn.train.rundir import clear_old_run, describe_run
    what = describe_run(run_dir)
    if what is not None:
        clear_old_run(run_dir)
        get_logger().warning("--force: starting a new run in %s over %s", run_dir, what)


def _finalize_and_exit(code: int) -> None:
    """All ranks agreed to stop: leave MPI cleanly (no MPI_Abort noise) with ``code``."""
    from mpi4py import MPI
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.Finalize()
    os._exit(code)


def cmd_plot(args) -> int:
    from hpcgnn.plot import PlotError, plot_runs
    try:
        out = plot_runs(args.run_dirs, args.out)
    except (PlotError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {out}")
    return 0


def cmd_info() -> int:
    """The report once; started on several ranks (``srun python -m hpcgnn info`` in a job), rank
    0 prints it once, what differs between the ranks' reports, and where each rank runs."""
    from mpi4py import MPI

    from hpcgnn.comm.info import describe, rank_facts
    comm = MPI.COMM_WORLD
    try:
        facts, error = describe(), None
    except RuntimeError as exc:             # e.g. HPCGNN_CUDA_AWARE set to something else than 0/1
        facts, error = None, str(exc)
    if comm.size == 1:
        gathered = [(facts, error, None)]
    else:
        gathered = comm.gather((facts, error, rank_facts()), root=0)
    code = 0
    if gathered is not None:                 # rank 0
        code = _print_info(gathered)
    return comm.bcast(code, root=0) if comm.size > 1 else code


def _print_info(gathered: list) -> int:
    """Rank 0: every rank's (report, error, where it runs), printed as ``cmd_info`` says."""
    from hpcgnn.train.agreement import differences
    from hpcgnn.train.early import group_errors, rank_list
    errors = [error for _, error, _ in gathered]
    if any(errors):
        for message, ranks in group_errors(errors):
            where = f"{rank_list(ranks)}: " if len(gathered) > 1 else ""
            print(f"error: {where}{message}", file=sys.stderr)
        return EXIT_USER_ERROR
    for key, value in gathered[0][0].items():
        print(f"{key:>16}: {value}")
    if len(gathered) > 1:
        differ = differences([facts for facts, _, _ in gathered])
        if differ:
            print("the ranks' reports differ:")
            for line in differ:
                print(f"  {line}")
        for line in _rank_lines([where for _, _, where in gathered]):
            print(line)
    return 0


INFO_RANK_LINES = 64   # info: one line per rank up to this many ranks, then one per kind


def _rank_lines(facts: list[dict[str, str]]) -> list[str]:
    """One line per rank (``rank 3: host n07, 8 cpus, 8 threads, CUDA_VISIBLE_DEVICES=3, devices
    NVIDIA H100``); past ``INFO_RANK_LINES`` ranks, one line per distinct set of facts but the
    host, naming its ranks and how many hosts."""
    def text(f: dict[str, str], host: bool = True) -> str:
        where = f"host {f['host']}, " if host else ""
        return (f"{where}{f['cpus']} cpus, {f['threads']} threads, CUDA_VISIBLE_DEVICES="
                f"{f['CUDA_VISIBLE_DEVICES']}, devices {f['devices']}")
    if len(facts) <= INFO_RANK_LINES:
        return [f"rank {r}: {text(f)}" for r, f in enumerate(facts)]
    from hpcgnn.train.early import rank_list
    groups: dict[str, list[int]] = {}
    for r, f in enumerate(facts):
        groups.setdefault(text(f, host=False), []).append(r)
    lines = []
    for line, ranks in groups.items():
        hosts = len({facts[r]["host"] for r in ranks})
        lines.append(f"{rank_list(ranks)} ({hosts} host{'s' * (hosts != 1)}): {line}")
    return lines


def _unfinished(run_dir: Path) -> str:
    """Why ``run_dir`` has no summary.json, and the fix: it is written once a run has done all
    its epochs, so a stopped or preempted run is continued with --resume."""
    from hpcgnn.train.preempt import PREEMPTED_NAME
    from hpcgnn.train.rundir import CHECKPOINT_NAME, describe_run
    what = describe_run(run_dir)
    if what is None:
        return (f"{run_dir} holds no run (no checkpoint.pt, metrics.jsonl or run.json); pass a run "
                f"directory, the --out of `hpcgnn train`")
    if not (run_dir / PREEMPTED_NAME).is_file():
        what += ", or a run still training"
    done = f"{run_dir} holds {what}; summary.json is written once the run has done all its epochs"
    if (run_dir / CHECKPOINT_NAME).is_file():
        return (f"{done}: continue a stopped run with `hpcgnn train --resume --out {run_dir}` and "
                f"its --shards, --config and --schedule")
    return (f"{done} (its epochs' records are in {run_dir}/metrics.jsonl); a run stopped without "
            f"a checkpoint cannot be continued: train anew with --force")


def cmd_summary(run_dir: Path) -> int:
    path = run_dir / "summary.json"
    if not path.is_file():
        print(f"{path}: not found; {_unfinished(run_dir)}", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        s = json.loads(path.read_text())
        missing = [k for k in SUMMARY_KEYS if k not in s] if isinstance(s, dict) else ["all keys"]
        what = f"lacks {', '.join(missing)}" if missing else ""
    except (OSError, ValueError) as exc:
        what = f"is unreadable ({exc})"
    if what:
        print(f"{path}: {what}, so it is not a finished run's summary (damaged, or written by "
              f"another tool); the epochs' records are in {run_dir}/metrics.jsonl", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"run {run_dir}: {s['ranks']} rank{'s' * (s['ranks'] != 1)}, {s['epochs']} epochs on "
          f"{s['device']}")
    at = ("no labelled validation node: the last evaluation's" if s["best_val_acc"] is None
          else f"at best validation {s['best_val_acc']:.4f}")
    print(f"  test accuracy {_accuracy(s['test_acc'])} ({at}); final {_accuracy(s['final_test_acc'])}")
    print(f"  {_traffic_name(run_dir)} {s['bytes_sent']:,} (fp32 would be {s['bytes_full']:,}); "
          f"gradient allreduce {s['allreduce_bytes']:,}")
    wall = f"; with evaluation {s['wall_time_s']:.2f} s" if "wall_time_s" in s else ""
    print(f"  training time {s['train_time_s']:.2f} s, median epoch {1e3 * s['epoch_time_s_median']:.1f} ms{wall}")
    if "peak_rss_bytes" in s:                   # runs written before it was recorded lack it
        dev = (f", GPU {s['peak_device_bytes'] / 2**20:,.0f} MiB"
               if "peak_device_bytes" in s else "")
        print(f"  peak memory of the largest rank: resident {s['peak_rss_bytes'] / 2**20:,.0f} MiB{dev}")
    if s.get("per_rank"):                       # runs written before it was recorded lack it
        print(_per_rank_line(s["per_rank"]))
    return 0


def _per_rank_line(r: dict) -> str:
    """``summary.json``'s ``per_rank``: each figure's range over the ranks, and whose."""
    def span(f: dict, fmt) -> str:
        return f"{fmt(f['min'])} (rank {f['min_rank']}) to {fmt(f['max'])} (rank {f['max_rank']})"
    parts = [f"sent {span(r['bytes_sent'], '{:,}'.format)}"]
    if r.get("bytes_received"):
        parts.append(f"received {span(r['bytes_received'], '{:,}'.format)}")
    if r.get("compute_s"):
        parts.append(f"compute {span(r['compute_s'], '{:.2f} s'.format)}")
    since = f" from epoch {r['from_epoch']}" if r.get("from_epoch") else ""
    return f"  per rank{since}: " + "; ".join(parts)


SUMMARY_KEYS = ("ranks", "epochs", "device", "test_acc", "best_val_acc", "final_test_acc",
                "bytes_sent", "bytes_full", "allreduce_bytes", "train_time_s", "epoch_time_s_median")


def _accuracy(value: float | None) -> str:
    return "none (no labelled test node)" if value is None else f"{value:.4f}"


def _traffic_name(run_dir: Path) -> str:
    """What the run's training traffic is, by its ``parallel.algorithm`` (RUN_DIR/config.toml)."""
    from hpcgnn.config import ConfigError, load_config
    try:
        algorithm = load_config(run_dir / "config.toml").parallel.algorithm
    except ConfigError:
        return "bytes exchanged"
    return TRAFFIC.get(algorithm, "halo bytes exchanged")


TRAFFIC = {"1.5d": "1.5D bytes exchanged (column broadcasts and reduces, row all-reduces)",
           "2d": "2D bytes exchanged (SUMMA broadcasts, column reduces, row all-gathers and "
                 "reduce-scatters)",
           "3d": "3D bytes exchanged (SUMMA broadcasts, column reduces, all-gathers and "
                 "reduce-scatters along rows and layers)"}


def cli() -> None:
    """The console script's entry (pyproject's ``[project.scripts]``): ``main`` as ``python -m``
    runs it, an escaping exception ending the whole job (``run_command``)."""
    run_command(main)


if __name__ == "__main__":
    cli()
