"""Moving rows between preprocessing ranks holds the rows sent and the rows received, no more.

``send_to`` (``preprocess.exchange``) groups the rows by destination and exchanges them with
``alltoallv_rows``. In one round (the usual case, under ``HPCGNN_A2A_ROUND_BYTES``) it sends
from the grouped rows and receives into the result; it used to pack a send buffer and unpack a
receive buffer as well, a copy of each (the distributed path's peak, when a slice's features
move to their writers). Real ranks, the received rows checked against the senders' rows
rebuilt in the test; also in many rounds, where the buffers are a round's share.
"""
from __future__ import annotations

import pytest

from conftest import check_ok, run_mpi

pytestmark = pytest.mark.mpi

SCRIPT = r"""
import tracemalloc
import numpy as np
from mpi4py import MPI
from preprocess.exchange import send_to

comm = MPI.COMM_WORLD
ROWS, WIDTH = 20000, 64

def rows_of(rank):
    rng = np.random.default_rng(rank)
    dest = rng.integers(0, comm.size, size=ROWS)
    ids = rank * ROWS + np.arange(ROWS)
    return dest, ids, (ids[:, None] * WIDTH + np.arange(WIDTH)).astype(np.float32)

dest, ids, x = rows_of(comm.rank)
send_to(comm, dest[:10], ids[:10], x[:10])            # MPI and numpy warm, outside the count
tracemalloc.start()
(got_ids, got), counts = send_to(comm, dest, ids, x)
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
want = [(i[d == comm.rank], r[d == comm.rank]) for d, i, r in map(rows_of, range(comm.size))]
np.testing.assert_array_equal(got_ids, np.concatenate([w[0] for w in want]))
np.testing.assert_array_equal(got, np.concatenate([w[1] for w in want]))
assert counts.tolist() == [len(w[0]) for w in want]
# the grouped copy of x and the rows received, and the int64 row indices (generous)
bound = x.nbytes + got.nbytes + 8 * 8 * (ROWS + len(got))
assert peak <= bound, f"rank {comm.rank}: peak {peak / 2**20:.2f} MiB > {bound / 2**20:.2f} MiB"
print(f"rank {comm.rank} ok peak {peak / 2**20:.2f} MiB bound {bound / 2**20:.2f} MiB")
"""


@pytest.mark.parametrize("ranks, round_bytes", [(2, None), (3, None), (2, "65536")])
def test_rows_move_without_round_buffers(ranks, round_bytes):
    env = {"HPCGNN_A2A_ROUND_BYTES": round_bytes} if round_bytes else None
    proc = run_mpi(ranks, ["-c", SCRIPT], timeout=120, env=env)
    check_ok(proc)
    assert proc.stdout.count(" ok peak ") == ranks, proc.stdout
