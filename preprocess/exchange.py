"""Moving rows between the ranks of the distributed preprocessing: ``Alltoallv`` in rounds.

MPI counts and displacements are C ``int``: one ``Alltoallv`` of ``MPI.BYTE`` cannot move 2 GiB
or more per rank. :func:`alltoallv_rows` splits every peer's block into the same number of
rounds (agreed with one ``allreduce``) so that each round moves at most about ``limit`` bytes
per rank; a round's buffers are packed from and unpacked into the whole arrays.
"""
from __future__ import annotations

import os

import numpy as np

from preprocess.errors import PreprocessError

ROUND_ENV = "HPCGNN_A2A_ROUND_BYTES"
MAX_ROUND_BYTES = (1 << 31) - 1          # MPI counts and displacements are C int


def round_bytes() -> int:
    """Bytes per rank per ``Alltoallv`` round: ``HPCGNN_A2A_ROUND_BYTES``, default 1 GiB."""
    raw = os.environ.get(ROUND_ENV)
    if raw is None:
        return 1 << 30
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_ROUND_BYTES:
        raise PreprocessError(f"{ROUND_ENV}={raw}: need a byte count in 1..{MAX_ROUND_BYTES:,} "
                              f"(MPI counts are C int); unset it for 1 GiB")
    return value


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _gather(a: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    idx = np.repeat(starts - _offsets(lengths)[:-1], lengths) + np.arange(lengths.sum())
    return a[idx]


def alltoallv_rows(comm, data: np.ndarray, counts: np.ndarray,
                   limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Send ``data`` (``[n, ...]``, rows grouped by destination: ``counts[r]`` rows to rank
    ``r``); return the rows received (grouped by source rank) and the per-source counts.

    Collective. Moves the rows' bytes once, in ``ceil(max bytes per rank / limit)`` rounds."""
    from mpi4py import MPI
    limit = round_bytes() if limit is None else limit
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    recv_counts = np.empty_like(counts)
    comm.Alltoall(counts, recv_counts)
    row_bytes = max(1, data.itemsize * int(np.prod(data.shape[1:], dtype=np.int64)))
    need = max(counts.sum(), recv_counts.sum()) * row_bytes
    rounds = comm.allreduce(max(1, -(-int(need) // limit)), op=MPI.MAX)
    out = np.empty((int(recv_counts.sum()),) + data.shape[1:], dtype=data.dtype)
    sdisp, rdisp = _offsets(counts)[:-1], _offsets(recv_counts)[:-1]
    src = np.ascontiguousarray(data)
    for i in range(rounds):
        s_lo, s_len = counts * i // rounds, counts * (i + 1) // rounds - counts * i // rounds
        r_lo, r_len = (recv_counts * i // rounds,
                       recv_counts * (i + 1) // rounds - recv_counts * i // rounds)
        sbuf = np.ascontiguousarray(_gather(src, sdisp + s_lo, s_len))
        rbuf = np.empty((int(r_len.sum()),) + data.shape[1:], dtype=data.dtype)
        comm.Alltoallv([sbuf.view(np.uint8).reshape(-1), s_len * row_bytes,
                        _offsets(s_len)[:-1] * row_bytes, MPI.BYTE],
                       [rbuf.view(np.uint8).reshape(-1), r_len * row_bytes,
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
