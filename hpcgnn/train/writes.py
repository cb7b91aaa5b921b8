"""A run directory that cannot be written while the job trains (a full disk, a quota, a file-size
limit, a file system gone read-only) ends the job at once with one error naming the file, the
reason, the fix and what is kept; it used to raise on the writing rank alone, whose peers then
waited in the next collective (a hang without ``python -m mpi4py``, a traceback with it).

The writing rank cannot tell its peers without a collective they are not in, so it aborts the
job (``MPI_Abort``, exit code ``EXIT_WRITE_FAILED``) after the error is out; every file it was
writing is written to a temporary name and renamed, so what is there stays valid:
``checkpoint.pt`` of the last saved epoch, and ``metrics.jsonl`` up to a possibly torn last line
(dropped on ``--resume``).
"""
from __future__ import annotations

import errno
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hpcgnn.log import get_logger

EXIT_WRITE_FAILED = 4
MOVE_RUN = "copy the run directory to another file system and pass that as --out"


def os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, or its cause or context (torch's checkpoint writer
    raises a RuntimeError while handling the OSError of the full disk)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def write_fix(err: OSError) -> str:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space on its file system or raise your quota (df -h; quota)"
    if err.errno == errno.EFBIG:
        return "raise the file-size limit (ulimit -f)"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make its directory writable again"
    return "check its file system"


def atomic_write_bytes(path: Path, data) -> None:
    """``path`` written under a temporary name and renamed; the temporary goes if that fails."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


@contextmanager
def fatal_if_unwritable(ctx, path: Path, kept: str, move: str = MOVE_RUN) -> Iterator[None]:
    """Around a write of ``path`` by this rank after the ranks agreed to start: an OSError
    (behind any exception) logs the error and aborts the job; ``kept``: what is still there and
    how to go on, e.g. "checkpoint.pt holds epoch 9: continue with --resume"; ``move``: the
    other fix, writing elsewhere."""
    try:
        yield
    except Exception as exc:
        err = os_error(exc)
        if err is None:
            raise
        get_logger().error("%s: cannot write it (%s), so the job stops on every rank. Fix: %s, "
                           "or %s; %s", path, os.strerror(err.errno) if err.errno else err, write_fix(err),
                           move, kept)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if ctx.size > 1:
            ctx.comm.Abort(EXIT_WRITE_FAILED)
        raise SystemExit(EXIT_WRITE_FAILED) from exc
