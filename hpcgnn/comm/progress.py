"""Progress for non-blocking exchanges while the rank computes.

Open MPI moves the bytes of an ``Ialltoallv`` only inside MPI calls: over TCP, the socket
buffers fill and a large (rendezvous) message waits for the receiver's next call, so a posted
exchange does not overlap computation by itself. ``[comm] progress`` (or ``HPCGNN_PROGRESS``)
says who makes those calls:

- ``test`` (default): ``poke`` tests the requests in flight at every layer boundary of the
  forward and backward passes (``hpcgnn.comm.stale``);
- ``fine``: as ``test``, and at ``point``s inside each layer's work as well — between the
  dense products, the owned-row and halo-row sparse products and the receiver-side dropout,
  in the forward pass and again, in reverse order, in the backward pass (``point`` is an
  autograd identity that tests in both). The layers place the points through their
  propagation object (``hpcgnn.nn.propagation``); about five per layer and direction;
- ``thread``: where MPI granted ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it), a daemon thread
  calls ``MPI_Testall`` on them every ``interval`` seconds while there are any, and exits when
  there are none (without the grant, ``test``). A request is handed back (``release``) before
  anyone waits on it: MPI forbids two threads completing one request at once.

Open MPI's own progress thread for TCP (``OMPI_MCA_btl_tcp_progress_thread=1``, a site or
launch setting, not a config key) combines with any of them; ``bench/network.py --progress``
compares them. Measured on 4 ranks over 2 cores (``bench/results/network-progress.md``, before
``fine`` existed) the thread made no epoch shorter at 1 Gbit/s and made them up to 30 % longer
(it takes CPU from the ranks), so a thread is not the default.

Cost: one ``MPI_Testall`` over the requests in flight per test (microseconds) and, with
``fine``, one autograd node per point. ``tests`` counts the tests that found requests in flight.
"""
from __future__ import annotations

import threading
import time

import torch

from hpcgnn.comm.context import CommContext
from hpcgnn.comm.settings import CHOICES, CommSettings

MODES = CHOICES["progress"]


class Progress:
    """The requests in flight of one model's non-blocking exchanges, and who progresses them."""

    def __init__(self, ctx: CommContext, mode: str | None = None, interval: float = 2e-4):
        """``mode``: ``test`` | ``fine`` | ``thread`` (default: ``[comm] progress``'s default with
        the environment's override); ``thread`` without ``MPI_THREAD_MULTIPLE`` is ``test``."""
        from mpi4py import MPI
        mode = mode if mode is not None else CommSettings.resolve().progress
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r}: use one of {', '.join(MODES)}")
        threaded = ctx.thread_level >= MPI.THREAD_MULTIPLE and mode == "thread"
        self.mode = mode if threaded or mode != "thread" else "test"
        self.threaded = threaded
        self.interval = interval
        self.tests = 0                            # tests that found requests in flight
        self._lock = threading.Lock()
        self._active: dict[int, object] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None   # what ended the thread, raised by the rank

    def add(self, request) -> None:
        self._raise_thread_error()
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
        self._raise_thread_error()
        with self._lock:
            self._active.pop(id(request), None)

    def poke(self) -> None:
        """Without the thread: test what is in flight (an MPI call that progresses it)."""
        self._raise_thread_error()
        if self.threaded:
            return
        with self._lock:
            self._test()

    def point(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` unchanged. With ``fine``: a test now, and another when the backward pass
        reaches this point (an autograd identity); otherwise nothing."""
        if self.mode != "fine":
            return x
        return _Point.apply(x, self)

    def drain(self) -> None:
        """Wait until the thread has nothing left and exits."""
        thread = self._thread
        if thread is not None:
            thread.join()
        self._raise_thread_error()

    def _raise_thread_error(self) -> None:
        """An exception that ended the thread, raised in the rank's own thread (where it ends
        the job); it was printed by the thread alone and the run went on to exit 0."""
        if self._error is not None:
            raise RuntimeError(f"the progress thread failed: {self._error!r}") from self._error

    def _test(self) -> bool:
        """``MPI_Testall`` of the requests in flight (the lock held); False when there are none."""
        reqs = list(self._active.values())
        if not reqs:
            return False
        from mpi4py import MPI
        MPI.Request.Testall(reqs)
        self.tests += 1
        return True

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._test():
                        self._thread = None
                        return
                time.sleep(self.interval)
        except BaseException as exc:         # noqa: BLE001 (handed to the rank's thread)
            self._error = exc


class _Point(torch.autograd.Function):
    """Identity that tests the requests in flight in the forward and in the backward pass."""

    @staticmethod
    def forward(ctx, x, progress: Progress):
        progress.poke()
        ctx.progress = progress
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.progress.poke()
        return grad, None
