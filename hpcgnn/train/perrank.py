"""Per-rank figures: what each rank's training exchanges sent and received and how long its
steps took, so that an imbalanced partition shows (``per_rank`` in ``metrics.jsonl`` and
``summary.json``; docs/formats.md).

Every rank adds up its own figures epoch by epoch, locally: no collective per step. At a
record point — an evaluated epoch, and before a checkpoint is saved — one small Gather brings
them to rank 0, which keeps them in the run's ``Progress`` (so the checkpoint carries them and a
resumed run records what the uninterrupted one records): ``rank_totals`` since epoch
``rank_from``, and ``rank_pending``, gathered at a checkpoint and not yet in a metrics line.
An evaluated epoch's line gets the figures of the epochs since the previous evaluated one.
A resume on another rank count starts them again (``from_epoch``).
"""
from __future__ import annotations

import numpy as np

from hpcgnn.comm.collectives import gather_float64
from hpcgnn.comm.context import CommContext

FIELDS = ("bytes_sent", "bytes_received", "step_s", "comm_s", "compute_s")


class RankWindow:
    """One rank's figures since the last record point (``FIELDS``)."""

    def __init__(self) -> None:
        self.values = [0.0] * len(FIELDS)

    def add(self, *values: float) -> None:
        self.values = [a + float(b) for a, b in zip(self.values, values)]

    def gather(self, ctx: CommContext, progress, epoch: int, record: bool,
               received: bool = True) -> dict | None:
        """The record point after ``epoch`` (collective: every rank calls it at the same
        epochs). Rank 0 adds the gathered figures to ``progress``; with ``record``, returns the
        metrics line's ``per_rank`` (None on the other ranks, and without ``record``).
        ``received``: False where the exchange counts no received bytes (CAGNET)."""
        rows = gather_float64(ctx, self.values)
        self.values = [0.0] * len(FIELDS)
        if rows is None:
            return None
        p = progress
        if p.rank_totals is None or len(p.rank_totals) != ctx.size:   # a start, or other ranks
            p.rank_totals, p.rank_from = np.zeros_like(rows).tolist(), p.rank_window_from
            p.rank_pending = None
        p.rank_totals = (np.asarray(p.rank_totals) + rows).tolist()
        if p.rank_pending is not None:
            rows = rows + np.asarray(p.rank_pending)
        if not record:
            p.rank_pending = rows.tolist()
            return None
        out = spread(rows, epoch + 1 - p.rank_window_from, received)
        p.rank_pending, p.rank_window_from = None, epoch + 1
        return out

    def restart(self, progress, epochs_done: int, ranks: int) -> None:
        """A resume (every rank): rank 0's kept figures go on only on the same rank count."""
        p = progress
        if p.rank_totals is not None and len(p.rank_totals) == ranks:
            return
        p.rank_totals, p.rank_pending, p.rank_from = None, None, epochs_done
        p.rank_window_from = epochs_done


def spread(rows: np.ndarray, epochs: int, received: bool = True) -> dict:
    """``(ranks, FIELDS)`` figures -> ``{"epochs": n, field: {min, max, mean, min_rank,
    max_rank}}`` (bytes as integers; ``bytes_received`` null without ``received``)."""
    out: dict = {"epochs": int(epochs)}
    for i, name in enumerate(FIELDS):
        col = rows[:, i]
        if name == "bytes_received" and not received:
            out[name] = None
            continue
        cast = int if name.startswith("bytes") else float
        out[name] = {"min": cast(col.min()), "max": cast(col.max()), "mean": float(col.mean()),
                     "min_rank": int(col.argmin()), "max_rank": int(col.argmax())}
    return out


def summary(progress, epochs_done: int, received: bool = True) -> dict | None:
    """``summary.json``'s ``per_rank`` (rank 0): the run's totals per rank since ``rank_from``."""
    p = progress
    if p.rank_totals is None:
        return None
    return {"from_epoch": p.rank_from,
            **spread(np.asarray(p.rank_totals), epochs_done - p.rank_from, received)}
