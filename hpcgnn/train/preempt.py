"""Preemption: SIGUSR1/SIGTERM only set a flag; the trainer checks it at the end of every
epoch (all ranks agree through one tiny Allreduce), checkpoints and exits 0.

``hpcgnn train`` installs the process's flag (``process_flag``) first thing, before torch is
imported and the shards are read, so that a signal during start-up (a preemption right after
the job starts, or a short ``--time``) is kept for the first epoch's end instead of killing the
rank with SIGUSR1's default action.

SLURM: ``#SBATCH --signal=B:USR1@120`` (or ``scancel --signal=USR1``) reaches the ranks;
Open MPI's ``mpirun`` forwards SIGUSR1 to its ranks.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

PREEMPTED_NAME = "preempted.json"
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptFlag:
    """Set by a signal handler; nothing else happens in the handler."""

    def __init__(self) -> None:
        self.raised = False
        self.signum: int | None = None

    def install(self) -> "PreemptFlag":
        for sig in SIGNALS:
            signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        self.raised, self.signum = True, signum

    def stand_down(self) -> None:
        """The ranks agreed to stop (done, preempted, stopped, diverged): a later SIGUSR1/SIGTERM
        is ignored. Python's teardown puts the default action (terminate) back for a signal with
        a Python handler, and MPI_Finalize runs after it; a rank there, its part done, while
        rank 0 still wrote the checkpoint, was killed by a second signal, and the launcher then
        killed rank 0 mid-write: neither that checkpoint nor ``preempted.json`` was left. The job
        script also sends SIGUSR1 again until the ranks have ended (jobs/lib/common.sh)."""
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


LISTENING_ENV = "HPCGNN_LISTENING"


def say_listening(is_root: bool) -> None:
    """Rank 0, once every rank has installed its flag (after the start-up checks' Allreduce):
    create the file ``$HPCGNN_LISTENING`` names, if it does. The job script passes a USR1 on
    to the ranks only once it exists (jobs/lib/common.sh, ``hpcgnn_run_forwarding``): before,
    the signal would kill a rank whose bash wrapper has not run its first line."""
    path = os.environ.get(LISTENING_ENV)
    if not path or not is_root:
        return
    try:
        Path(path).touch()
    except OSError as exc:
        from hpcgnn.log import get_logger
        get_logger().warning("cannot create %s (%s): the job script passes a preemption "
                             "warning on to the ranks only after HPCGNN_LISTEN_WAIT seconds",
                             path, exc.strerror or exc)


_PROCESS_FLAG: PreemptFlag | None = None


def process_flag() -> PreemptFlag:
    """The one flag of this process (made on first use; installed by whoever starts training)."""
    global _PROCESS_FLAG
    if _PROCESS_FLAG is None:
        _PROCESS_FLAG = PreemptFlag()
    return _PROCESS_FLAG


def write_marker(run_dir: Path, epoch: int, epochs_done: int) -> None:
    """``RUN_DIR/preempted.json``: the last finished epoch (0-based, as in metrics.jsonl),
    written under a temporary name and renamed (a kill mid-write leaves no torn marker)."""
    from hpcgnn.train.writes import atomic_write_text
    atomic_write_text(Path(run_dir, PREEMPTED_NAME),
                      json.dumps({"epoch": epoch, "epochs_done": epochs_done}) + "\n")


def clear_marker(run_dir: Path) -> None:
    Path(run_dir, PREEMPTED_NAME).unlink(missing_ok=True)
