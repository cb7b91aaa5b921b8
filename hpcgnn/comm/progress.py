"""Progress for non-blocking exchanges while the rank computes.

Open MPI moves the bytes of an ``Ialltoallv`` only inside MPI calls: over TCP, the socket
buffers fill and the transfer stalls until the next call, so a posted exchange does not overlap
computation by itself. By default ``poke`` tests the requests in flight at every layer boundary
of the forward and backward passes (``[comm] progress = "test"``). With ``progress = "thread"``
(or ``HPCGNN_PROGRESS=thread``),
where MPI granted ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it), a daemon thread calls
``MPI_Testall`` on them every ``interval`` seconds while there are any, and exits when there
are none. Measured on 4 ranks over 2 cores (``bench/results/network-progress.md``), the thread
made no epoch shorter at 1 Gbit/s and made them up to 30 % longer (it takes CPU from the
ranks), so tests are the default; a node with idle cores may differ. A request is handed back
(``release``) before anyone waits on it: MPI forbids two threads completing one request at once.
"""
from __future__ import annotations

import threading
import time

from hpcgnn.comm.context import CommContext
from hpcgnn.comm.settings import CommSettings



class Progress:
    """The requests in flight of one model's non-blocking exchanges, and who progresses them."""

    def __init__(self, ctx: CommContext, mode: str | None = None, interval: float = 2e-4):
        """``mode``: ``test`` | ``thread`` (default: ``[comm] progress``'s default with the
        environment's override)."""
        from mpi4py import MPI
        mode = mode if mode is not None else CommSettings.resolve().progress
        self.threaded = ctx.thread_level >= MPI.THREAD_MULTIPLE and mode == "thread"
        self.interval = interval
        self._lock = threading.Lock()
        self._active: dict[int, object] = {}
        self._thread: threading.Thread | None = None

    @property
    def mode(self) -> str:
        return "thread" if self.threaded else "test"

    def add(self, request) -> None:
        if request is None:
            return
        with self._lock:
            self._active[id(request)] = request
            start = self.threaded and (self._thread is None or not self._thread.is_alive())
            if start:
                self._thread = threading.Thread(target=self._run, name="hpcgnn-progress", daemon=True)
                self._thread.start()

    def release(self, request) -> None:
        """Stop progressing ``request`` (call before waiting on it)."""
        with self._lock:
            self._active.pop(id(request), None)

    def poke(self) -> None:
        """Without the thread: test what is in flight (an MPI call that progresses it)."""
        if self.threaded:
            return
        with self._lock:
            reqs = list(self._active.values())
            if reqs:
                from mpi4py import MPI
                MPI.Request.Testall(reqs)

    def drain(self) -> None:
        """Wait until the thread has nothing left and exits."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        from mpi4py import MPI
        while True:
            with self._lock:
                reqs = list(self._active.values())
                if not reqs:
                    self._thread = None
                    return
                MPI.Request.Testall(reqs)
            time.sleep(self.interval)
