"""When rank 0 reports training progress, and the ETA it reports.

A report is due every 5 % of the epochs, or once ``interval_s`` of wall time passed since the
last report (long epochs, long runs), and at the last epoch. The ETA extrapolates the wall time
per epoch of this segment (since start or resume; evaluation and checkpoints included).
"""
from __future__ import annotations

import time


class EpochReporter:
    """``due(epoch)`` after each epoch; ``eta_s(epoch)`` the seconds left after ``epoch``."""

    def __init__(self, first_epoch: int, epochs: int, interval_s: float = 5.0, clock=time.monotonic):
        self.first, self.epochs, self.interval_s, self.clock = first_epoch, epochs, interval_s, clock
        self.every = max(1, epochs // 20)
        self.t0 = self.last = clock()

    def due(self, epoch: int) -> bool:
        """True (and the report clock restarts) when ``epoch`` (0-based, just finished) is reported."""
        now = self.clock()
        done = epoch + 1
        if done % self.every == 0 or done == self.epochs or now - self.last >= self.interval_s:
            self.last = now
            return True
        return False

    def eta_s(self, epoch: int) -> float:
        per_epoch = (self.clock() - self.t0) / max(1, epoch + 1 - self.first)
        return per_epoch * (self.epochs - epoch - 1)


def format_eta(seconds: float) -> str:
    """``1h02m``, ``3m05s``, ``12s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
