"""Moving rows between the ranks of the distributed preprocessing: ``Alltoallv`` in rounds.

MPI counts and displacements are C ``int``: one ``Alltoallv`` of ``MPI.BYTE`` cannot move 2 GiB
or more per rank. :func:`alltoallv_rows` splits every peer's block into the same number of
rounds (agreed with one ``allreduce``) so that each round moves at most about ``limit`` bytes
per rank (``HPCGNN_A2A_ROUND_BYTES``, 1 GiB by default), and never 2^31 bytes or more: a round
of ``R`` takes ``ceil(c / R)`` rows or fewer of a block of ``c``, so up to one row per peer more
than ``limit`` (``round_count``). A round's buffers are packed from and unpacked into the whole
arrays; a single round (the usual case) sends from the array itself and receives into the
result, without buffers (they were a copy of each: the peak of moving a slice's features was
twice theirs more).
"""
from __future__ import annotations

import os

import numpy as np

from hpcgnn.comm.settings import INT_MAX      # the largest MPI count or displacement
from preprocess.errors import PreprocessError

ROUND_ENV = "HPCGNN_A2A_ROUND_BYTES"
DEFAULT_ROUND_BYTES = 1 << 30


def round_bytes() -> int:
    """Bytes per rank per round: ``HPCGNN_A2A_ROUND_BYTES``, or 1 GiB where it is unset; a
    ``PreprocessError`` naming the variable where it is not an integer in [1, 2^31 - 1]."""
    raw = os.environ.get(ROUND_ENV, "").strip()
    if not raw:
        return DEFAULT_ROUND_BYTES
    if not raw.isdigit() or not 1 <= int(raw) <= INT_MAX:
        raise PreprocessError(f"{ROUND_ENV}={raw!r}: expected the bytes per rank of one Alltoallv "
                              f"round, an integer in [1, {INT_MAX}] (MPI counts are C ints); "
                              f"unset it for {DEFAULT_ROUND_BYTES:,}")
    return int(raw)


def round_count(need: int, peers: int, row_bytes: int, limit: int) -> int:
    """This rank's rounds for ``need`` bytes (its larger total, sent or received) to or from
    ``peers`` ranks in rows of ``row_bytes``: about ``need / limit``, and enough that a round,
    which may take one row per peer beyond ``need / rounds``, stays below 2^31 bytes."""
    rounds = max(1, -(-int(need) // limit))
    room = max(row_bytes, INT_MAX - peers * row_bytes)    # a round's bytes besides that row
    return max(rounds, -(-int(need) // room))


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _gather(a: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    idx = np.repeat(starts - _offsets(lengths)[:-1], lengths) + np.arange(lengths.sum())
    return a[idx]


def _bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of the C-contiguous ``a``, a flat uint8 view (no copy)."""
    return a.view(np.uint8).reshape(-1)


def alltoallv_rows(comm, data: np.ndarray, counts: np.ndarray,
                   limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Send ``data`` (``[n, ...]``, rows grouped by destination: ``counts[r]`` rows to rank
    ``r``); return the rows received (grouped by source rank) and the per-source counts.

    Collective. Moves the rows' bytes once, in ``round_count`` rounds (the most of any rank)."""
    from mpi4py import MPI
    limit = round_bytes() if limit is None else limit
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    recv_counts = np.empty_like(counts)
    comm.Alltoall(counts, recv_counts)
    row_bytes = max(1, data.itemsize * int(np.prod(data.shape[1:], dtype=np.int64)))
    need = max(counts.sum(), recv_counts.sum()) * row_bytes
    rounds = comm.allreduce(round_count(need, comm.size, row_bytes, limit), op=MPI.MAX)
    out = np.empty((int(recv_counts.sum()),) + data.shape[1:], dtype=data.dtype)
    sdisp, rdisp = _offsets(counts)[:-1], _offsets(recv_counts)[:-1]
    src = np.ascontiguousarray(data)
    if rounds == 1:     # straight from ``data`` into ``out``: no round buffers, copies of both
        comm.Alltoallv([_bytes(src), counts * row_bytes, sdisp * row_bytes, MPI.BYTE],
                       [_bytes(out), recv_counts * row_bytes, rdisp * row_bytes, MPI.BYTE])
        return out, recv_counts
    for i in range(rounds):
        s_lo, s_len = counts * i // rounds, counts * (i + 1) // rounds - counts * i // rounds
        r_lo, r_len = (recv_counts * i // rounds,
                       recv_counts * (i + 1) // rounds - recv_counts * i // rounds)
        sbuf = np.ascontiguousarray(_gather(src, sdisp + s_lo, s_len))
        rbuf = np.empty((int(r_len.sum()),) + data.shape[1:], dtype=data.dtype)
        comm.Alltoallv([_bytes(sbuf), s_len * row_bytes,
                        _offsets(s_len)[:-1] * row_bytes, MPI.BYTE],
                       [_bytes(rbuf), r_len * row_bytes,
                        _offsets(r_len)[:-1] * row_bytes, MPI.BYTE])
        idx = np.repeat(rdisp + r_lo - _offsets(r_len)[:-1], r_len) + np.arange(r_len.sum())
        out[idx] = rbuf
    return out, recv_counts


def send_to(comm, dest: np.ndarray, *arrays: np.ndarray,
            limit: int | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """Send row ``i`` of every array to rank ``dest[i]``; the arrays received (grouped by
    source rank, each source's rows in their original order) and the per-source counts."""
    order = np.argsort(dest, kind="stable")
    counts = np.bincount(dest, minlength=comm.size).astype(np.int64)
    got, recv = [], None
    for a in arrays:
        r, recv = alltoallv_rows(comm, a[order], counts, limit)
        got.append(r)
    return got, recv if recv is not None else np.zeros(comm.size, dtype=np.int64)


def reply(comm, recv_counts: np.ndarray, *answers: np.ndarray,
          limit: int | None = None) -> list[np.ndarray]:
    """Send answers (one row per request received, in the order received) back to the
    requesters: each gets its answers in the order it asked."""
    return [alltoallv_rows(comm, a, recv_counts, limit)[0] for a in answers]
