"""``hpcgnn train``'s and ``predict``'s first check, before torch is imported, and how ranks
report start-up errors (``hpcgnn.train.launch`` uses the same).

Importing torch costs every rank seconds (about 3 s of CPU on the development machine). The
mistakes a user makes most often need none of it: a bad key or value in the run config, an
``--out`` that holds a run without ``--resume`` or ``--force``, a missing or damaged
``meta.json``, a rank count that does not divide the part count. So every rank first checks
those with mpi4py (and h5py) alone, the ranks agree with one small ``Allreduce`` whether any
failed, and on failure rank 0 prints each distinct message once, with the ranks that hit it,
and the job ends with exit code 2. ``predict`` checks its ``--run`` directory's config, the
shard set and the rank count the same way. The full start-up (the part files, schedule,
checkpoint, device) runs after torch, as before, and checks these again.
"""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Callable

from hpcgnn.comm.settings import check_halo_message
from hpcgnn.config import Config, ConfigError, config_source, load_config
from hpcgnn.data.shardset import ShardSet
from hpcgnn.log import get_logger, setup_logging
from hpcgnn.train.rundir import CONFIG_NAME, check_run_dir, check_writable

# Errors a user can cause and fix (bad file, bad key, bad value); anything else is a bug and
# aborts the job with a traceback (python -m mpi4py).
USER_ERRORS = (ValueError, OSError)


def train_checks(args, size: int) -> None:
    """``hpcgnn train``: the run config (``--config``, ``--set``), ``--out`` against
    ``--resume``/``--force``, the shard set's ``meta.json`` and, for the halo algorithm, the
    rank count against its parts and ``comm.max_message`` against the rank count (CAGNET's
    grids check theirs later)."""
    cfg = load_config(args.config, args.set)
    if cfg.parallel.algorithm == "halo":
        check_halo_message(cfg.comm, size, config_source(args.config, args.set))
    run_dir = Path(args.out or cfg.run.out)
    check_run_dir(run_dir, args.resume, getattr(args, "force", False))
    shards = ShardSet.open(args.shards)
    shards.check_trainable()                   # from meta.json's counts (older sets: later)
    if cfg.parallel.algorithm == "halo":
        shards.check_ranks(size)
    check_writable(run_dir)                    # last: made only where the rest passed here


def predict_checks(args, size: int) -> None:
    """``hpcgnn predict``: the ``--run`` directory's config, ``--out`` (not a shard set, a run or
    either input; made and writable on this rank), the shard set's ``meta.json``, the rank
    count against its parts and ``comm.max_message`` against the rank count (predict runs the
    halo algorithm)."""
    from hpcgnn.train.outdir import check_out_dir
    cfg = read_run_config(Path(args.run))
    check_halo_message(cfg.comm, size, str(Path(args.run) / CONFIG_NAME))
    check_out_dir(Path(args.out), Path(args.shards), Path(args.run))
    ShardSet.open(args.shards).check_ranks(size)
    check_writable(Path(args.out))             # last: made only where the rest passed here


def read_run_config(run_dir: Path) -> Config:
    """The resolved config ``hpcgnn train`` recorded in ``run_dir``."""
    path = run_dir / CONFIG_NAME
    if not path.is_file():
        raise ConfigError(f"{path}: not found; --run must be a run directory written by "
                          f"`hpcgnn train` (it records the resolved config there at start)")
    return load_config(path)


def check_before_torch(args, checks: Callable = train_checks) -> bool:
    """Every rank: ``checks(args, ranks)``. True where every rank passed; otherwise rank 0
    has said why (``report_failures``) and every rank returns False."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    setup_logging(comm.rank, comm.size)
    error = None
    try:
        checks(args, comm.size)
    except USER_ERRORS as exc:
        error = str(exc)
    if not comm.allreduce(error is not None, op=MPI.LOR):
        return True
    report_failures(gather_errors(comm, error))
    return False


def gather_errors(comm, error: str | None) -> list[tuple[str, str | None]] | None:
    """Every rank's (host, start-up error or None), on rank 0 of the mpi4py communicator
    ``comm``; None elsewhere. One gather of short strings, only on failure."""
    mine = (socket.gethostname(), error)
    if comm.size == 1:
        return [mine]
    return comm.gather(mine, root=0)


def report_failures(failures: list[tuple[str, str | None]] | None) -> None:
    """Rank 0 (``failures``: every rank's (host, start-up error or None); None on the other
    ranks): one ERROR line per distinct message, naming the ranks that hit it (and, in a job
    on several hosts where not every rank hit it, their hosts: a file one node cannot read),
    and which ranks stop only because of the others."""
    if failures is None:
        return
    log = get_logger()
    errors = [error for _, error in failures]
    several = len({host for host, _ in failures}) > 1
    for message, ranks in group_errors(errors):
        some = several and len(ranks) < len(errors)
        log.error("%s: %s", on_hosts(ranks, failures) if some else rank_list(ranks), message)
    fine = [r for r, e in enumerate(errors) if e is None]
    if fine:
        log.error("%s: no error; stopping with the others", rank_list(fine))


def device_failures(failures: list[tuple[str, str | None]]) -> str:
    """The one line every rank logs when some ranks could not take their device
    (``hpcgnn.comm.context.DeviceUnavailable``; ``failures``: every rank's (host, error or
    None)): which ranks on which hosts failed, and why, once per distinct message."""
    errors = [error for _, error in failures]
    groups = group_errors(errors)
    failed = sum(len(ranks) for _, ranks in groups)
    said = "; also ".join(f"{on_hosts(ranks, failures)}: {message}" for message, ranks in groups)
    return (f"no device on {failed} of {len(errors)} rank{'s' * (len(errors) != 1)}; nothing "
            f"was exchanged, so every rank stops: {said}")


def device_mix(devices: tuple) -> str | None:
    """The warning rank 0 logs when ``--device auto`` gave some ranks a GPU and others the CPU
    (``devices``: ``CommContext.mixed_devices``, every rank's (host, device type)): how many
    ranks took which, the CPU ranks and their hosts, and the fix; None when they did not."""
    cpu = [r for r, (_, kind) in enumerate(devices) if kind == "cpu"]
    if not cpu or len(cpu) == len(devices):
        return None
    gpus = len(devices) - len(cpu)
    return (f"--device auto put {gpus} of {len(devices)} ranks on a GPU and {len(cpu)} on the "
            f"CPU ({on_hosts(cpu, list(devices))}: no GPU that torch sees there). The job trains, "
            f"but every exchange waits for the CPU ranks, so they pace it, and summary.json's "
            f"device is rank 0's. Fix: give the job a GPU on every node (e.g. sbatch "
            f"--gpus-per-task=1, or a constraint that selects GPU nodes), or use --device cpu")


def group_errors(errors: list[str | None]) -> list[tuple[str, list[int]]]:
    """(message, ranks) per distinct message, in order of the lowest rank that hit it."""
    groups: dict[str, list[int]] = {}
    for rank, message in enumerate(errors):
        if message is not None:
            groups.setdefault(message, []).append(rank)
    return list(groups.items())


def on_hosts(ranks: list[int], failures: list[tuple[str, str | None]]) -> str:
    """'rank 1 (host node07)', 'ranks 2-3 (hosts node07, node08)': ``ranks`` and their hosts
    (``failures``: every rank's (host, error or None))."""
    hosts = sorted({failures[r][0] for r in ranks})
    return f"{rank_list(ranks)} (host{'s' * (len(hosts) > 1)} {', '.join(hosts)})"


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
