"""Several ``hpcgnn`` commands (``train``, ``predict``) in ONE MPI job: ``python -m mpi4py
tests/_batch.py JOBS.json`` (``conftest.run_together`` writes it and reads what it leaves).

A rank's start is mostly ``import torch`` (about 2.5 s of CPU here), so a test that runs the
same rank count several times pays it once per rank instead of once per command. Every rank runs the
jobs in turn, in its own process, through the same ``hpcgnn.__main__.main`` as the command line:
for each, the job's environment variables are set (and put back after), ``sys.orig_argv`` is
the command line that would have started it (``run.json`` records it), the rank's stdout and
stderr go to ``LOG_DIR/rank-R.txt``, and ``LOG_DIR/rc-R`` holds the exit code. Only runs expected
to succeed belong here: a refusal ends the job (``_finalize_and_exit``), an exception aborts it,
and every test of the batch then sees that failure. A ``--resume`` may follow its stopped run
in the same batch (the jobs run in order); refusals and signals are tested on launches of their
own.

``JOBS.json``: ``[{"argv": [...], "env": {...}, "log": LOG_DIR}, ...]``.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path


def run_jobs(jobs_file: str) -> None:
    from mpi4py import MPI

    from hpcgnn.__main__ import main
    rank = MPI.COMM_WORLD.Get_rank()
    for job in json.loads(Path(jobs_file).read_text()):
        saved = {k: os.environ.get(k) for k in job["env"]}
        os.environ.update(job["env"])
        # what run.json records as the command: the line that would have started this run
        sys.orig_argv = [sys.executable, "-m", "mpi4py", "-m", "hpcgnn", *job["argv"]]
        log = Path(job["log"])
        log.mkdir(parents=True, exist_ok=True)
        with open(log / f"rank-{rank}.txt", "w") as f, \
                contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            try:
                rc = main(job["argv"])
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 1
        (log / f"rc-{rank}").write_text(str(rc))
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))     # this checkout's hpcgnn
    run_jobs(sys.argv[1])
