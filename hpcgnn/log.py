"""The one named logger ``hpcgnn``, rank-prefixed; rank 0 speaks by default.

``setup_logging(rank)`` is called once per process. Other ranks log warnings and errors only,
unless ``HPCGNN_LOG_ALL_RANKS=1`` (then every rank logs at INFO).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

LOGGER_NAME = "hpcgnn"


def say_error(line: str) -> None:
    """``line`` on stderr in one write, flushed: the ranks of a job share stderr (a pipe through
    the launcher), and a line written in pieces (``print`` writes its newline apart under
    ``PYTHONUNBUFFERED``) can run into another rank's; Open MPI 4 forwards such pieces
    interleaved."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def setup_logging(rank: int, size: int = 1, level: int | None = None) -> logging.Logger:
    """Configure the ``hpcgnn`` logger for this rank: prefix ``[rank r/size]``, stderr."""
    log = get_logger()
    all_ranks = os.environ.get("HPCGNN_LOG_ALL_RANKS", "0") == "1"
    if level is None:
        level = logging.INFO if (rank == 0 or all_ranks) else logging.WARNING
    log.setLevel(level)
    log.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}/{size}] %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    return log


def abort_on_uncaught(code: int = 1) -> None:
    """An exception escaped a command's ``main`` (a bug: user errors are reported and end every
    rank cleanly) or the rank was interrupted (SIGINT, ``code`` 130): print it and, with MPI up
    on more than one rank, abort the job with ``code``, as ``python -m mpi4py`` does; without it
    the other ranks waited in their next collective until the job's time limit (an interrupted
    rank, leaving through MPI_Finalize, waited there with them)."""
    traceback.print_exc()
    sys.stderr.flush()
    mpi = _world_of_several()
    if mpi is not None:
        mpi.COMM_WORLD.Abort(code)
    sys.exit(code)


def _world_of_several():
    """``mpi4py.MPI`` when MPI is up on more than one rank, else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() \
            and mpi.COMM_WORLD.Get_size() > 1:
        return mpi
    return None


def run_command(main) -> None:
    """``sys.exit(main())``, with an exception that escapes it ended by ``abort_on_uncaught``;
    a reader of stdout that left early (``hpcgnn summary RUN | head -1``) is not a bug: the
    command ends with exit code 1 and no traceback (on one rank; a job's rank still ends the
    job)."""
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except KeyboardInterrupt:
        abort_on_uncaught(128 + signal.SIGINT)
    except BrokenPipeError:
        if _world_of_several() is not None:
            abort_on_uncaught()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush
        sys.exit(1)
    except BaseException:
        abort_on_uncaught()
