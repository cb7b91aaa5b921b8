"""When the halo transport splits an exchange into rounds, on real ranks.

MPI counts and displacements are C ints, so one call can move at most ``max_message`` bytes per
rank: that is what must hold of every call, whatever a single block's share of the limit. An
exchange whose per-rank totals fit goes in ONE call (a non-blocking exchange stays
non-blocking, as a stale layer needs), however large one block is next to ``max_message / P``;
one whose totals do not fit goes in rounds on every rank, and the bytes arrive the same.
The limits checked here are computed in the test from the byte counts, not by the transport.

The trainer's own collectives take the same limit (``hpcgnn.comm.collectives``: the gradient
``Allreduce``, the parameters' ``Bcast``, the checkpoint's bytes at ``--resume`` and ``predict``):
on a communicator that records every call's buffer, each call moves at most ``max_message``
bytes, and the values arrive as computed here and as one unsplit call gives them.
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
    if transport == "alltoallv":
        assert proc.stdout.count("collectives ok") == 3


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


def _recording(world):
    """``world`` as a communicator that records (name, bytes) of each Allreduce and Bcast it
    makes (the same MPI communicator: the calls go through to it)."""
    from mpi4py import MPI

    class Recording(MPI.Intracomm):
        calls: list = []

        def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
            self.calls.append(("Allreduce", memoryview(recvbuf).nbytes))
            return super().Allreduce(sendbuf, recvbuf, op)

        def Bcast(self, buf, root=0):
            self.calls.append(("Bcast", memoryview(buf).nbytes))
            return super().Bcast(buf, root)
    return Recording(world)


def _collectives(world_ctx) -> None:
    """allreduce_sum_, broadcast_params_ and bcast_bytes under HPCGNN_MAX_MESSAGE = LIMIT."""
    from dataclasses import replace

    import torch
    from hpcgnn.comm.collectives import allreduce_sum_, broadcast_params_
    from hpcgnn.comm.settings import CommSettings
    from hpcgnn.train.build import with_comm_settings
    ctx = with_comm_settings(world_ctx, CommSettings.resolve())      # as the trainer makes it
    assert ctx.max_message == LIMIT
    spy = _recording(ctx.comm)
    ctx = replace(ctx, comm=spy)
    me, size = ctx.rank, ctx.size
    shapes = [(5, 7), (300,), (1,)]                   # 336 float32 = 1344 bytes > LIMIT

    def values(r):      # multiples of 1/4 below 2^10: every sum over the ranks is exact
        return [((torch.arange(int(torch.tensor(s).prod())) * (7 + r) + 3 * r) % 1021 * 0.25)
                .to(torch.float32).reshape(s) for s in shapes]
    mine = values(me)
    sent = allreduce_sum_(ctx, mine)
    want = [sum(values(r)[i].double() for r in range(size)).float() for i in range(len(shapes))]
    assert all(torch.equal(a, b) for a, b in zip(mine, want)), me
    whole = values(me)
    allreduce_sum_(world_ctx, whole)                  # one unsplit call: the same bits
    assert all(torch.equal(a, b) for a, b in zip(mine, whole)), me
    assert sent == 1344
    calls = [n for name, n in spy.calls if name == "Allreduce"]
    assert sum(calls) == 1344 and max(calls) <= LIMIT and len(calls) == 2, calls
    spy.calls.clear()
    params = values(me)
    broadcast_params_(ctx, params)
    assert all(torch.equal(a, b) for a, b in zip(params, values(0))), me
    calls = [n for name, n in spy.calls if name == "Bcast"]
    assert sum(calls) == 1344 and max(calls) <= LIMIT, calls
    from hpcgnn.comm.collectives import bcast_bytes
    spy.calls.clear()
    blob = bytes((i * 13 + 5) % 256 for i in range(2000))
    got = bcast_bytes(ctx, blob if me == 0 else None)
    assert bytes(got) == blob, me
    calls = [n for name, n in spy.calls if name == "Bcast"]
    assert max(calls) <= LIMIT and sum(calls) == 2000 + 8, calls    # the length, then the bytes
    assert bcast_bytes(ctx, None) is None
    print(f"rank {me}: collectives ok", flush=True)


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
    import os
    if os.environ["HPCGNN_EXCHANGE"] == "alltoallv":
        _collectives(ctx)


if __name__ == "__main__":
    _worker()
