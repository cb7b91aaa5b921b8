"""When the halo transport splits an exchange into rounds, on real ranks.

MPI counts and displacements are C ints, so one call can move at most ``max_message`` bytes per
rank: that is what must hold of every call, whatever a single block's share of the limit. An
exchange whose per-rank totals fit goes in ONE call (a non-blocking exchange stays
non-blocking, as a stale layer needs), however large one block is next to ``max_message / P``;
one whose totals do not fit goes in rounds on every rank, and the bytes arrive the same.
The limits checked here are computed in the test from the byte counts, not by the transport.
This file is also the MPI worker."""
from __future__ import annotations

import pytest

from conftest import run_mpi

LIMIT = 700          # HPCGNN_MAX_MESSAGE of the worker: 233 bytes a block and round at 3 ranks


@pytest.mark.mpi
@pytest.mark.parametrize("transport", ("alltoallv", "neighbor"))
def test_rounds_only_when_a_call_would_pass_the_limit(transport):
    proc = run_mpi(3, [__file__], timeout=120,
                   env={"HPCGNN_MAX_MESSAGE": str(LIMIT), "HPCGNN_EXCHANGE": transport})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("rounds ok") == 3


# -- the worker (runs on every rank) --------------------------------------------------------

def _exchange(ctx, send: list[list[int]]):
    """Every rank sends ``send[me][p]`` bytes to ``p`` (byte ``i`` of the block from ``q`` to
    ``p`` is ``(31 q + 7 p + i) % 251``), through a real ``Transport``; returns the layout,
    whether the exchange was posted non-blocking, and the bytes received."""
    import torch
    from hpcgnn.comm.plan import HaloPlan
    from hpcgnn.comm.transport import Transport
    me, size = ctx.rank, ctx.size
    out = [send[me][p] for p in range(size)]
    inn = [send[q][me] for q in range(size)]
    plan = HaloPlan(send_counts=tuple(out), recv_counts=tuple(inn),
                    send_index=torch.zeros(0, dtype=torch.long), n_owned=0, n_halo=0)
    tr = Transport(ctx, plan)
    lay = tr.layout(out, inn)
    buf = torch.cat([(31 * me + 7 * p + torch.arange(n)) % 251 for p, n in enumerate(out)])
    buf = buf.to(torch.uint8)
    recv = torch.empty(sum(inn), dtype=torch.uint8)
    request, keep = tr.post(buf, lay, recv, recv.numpy(), {}, "t", nonblocking=True)
    if request is not None:
        request.Wait()
    want = torch.cat([(31 * q + 7 * me + torch.arange(n)) % 251 for q, n in enumerate(inn)])
    assert torch.equal(recv, want.to(torch.uint8)), (me, send)
    return lay, request is not None


def _worker() -> None:
    from hpcgnn.comm.context import CommContext
    ctx = CommContext.from_world("cpu")
    assert ctx.size == 3
    # every rank moves 2 x 300 = 600 <= 700 bytes each way: one call, posted non-blocking,
    # though each block is past 700 // 3 = 233
    lay, nonblocking = _exchange(ctx, [[0, 300, 300], [300, 0, 300], [300, 300, 0]])
    assert max(lay.s_counts) > LIMIT // 3
    assert sum(lay.s_counts) <= LIMIT and sum(lay.r_counts) <= LIMIT
    assert lay.rounds == 1 and nonblocking, lay
    # rank 0 sends 800 > 700 bytes to rank 1 (rank 1 receives 850): rounds on every rank, each
    # call within the limit, the same bytes delivered
    lay, nonblocking = _exchange(ctx, [[0, 800, 10], [20, 0, 30], [40, 50, 0]])
    assert lay.rounds > 1 and not nonblocking, lay
    print(f"rank {ctx.rank}: rounds ok", flush=True)


if __name__ == "__main__":
    _worker()
