"""When the halo transport splits an exchange into rounds, on real ranks.

MPI counts and displacements are C ints, so one call can move at most ``max_message`` bytes per
rank: that is what must hold of every call, whatever a single block's share of the limit. An
exchange whose per-rank totals fit goes in ONE call (a non-blocking exchange stays
non-blocking, as a stale layer needs), however large one block is next to ``max_message / P``;
one whose totals do not fit goes in rounds on every rank, and the bytes arrive the same. A
round carries ``max_message // k`` bytes of each block, ``k`` the most peers any rank exchanges
with (not ``P``): a partition's few neighbours need fewer rounds. The limits and round counts
checked here are computed in the test from the byte counts, not by the transport, and every
call the transport makes is recorded on the communicator (its bytes each way).

The trainer's own collectives take the same limit (``hpcgnn.comm.collectives``: the gradient
``Allreduce``, the parameters' ``Bcast``, the checkpoint's bytes at ``--resume`` and ``predict``):
on a communicator that records every call's buffer, each call moves at most ``max_message``
bytes, and the values arrive as computed here and as one unsplit call gives them.
This file is also the MPI worker."""
from __future__ import annotations

import pytest

from conftest import run_mpi

LIMIT = 700          # HPCGNN_MAX_MESSAGE of the worker: 700 // k bytes a block and round, k peers


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
    whether the exchange was posted non-blocking, and the (bytes sent, bytes received) of each
    all-to-all call the transport made."""
    from dataclasses import replace

    import torch
    from hpcgnn.comm.plan import HaloPlan
    from hpcgnn.comm.transport import Transport
    ctx = replace(ctx, comm=_recording(ctx.comm))
    ctx.comm.calls.clear()
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
    moves = [n for name, n in ctx.comm.calls if name in ("Alltoallv", "Neighbor_alltoallv",
                                                         "Ialltoallv", "Ineighbor_alltoallv")]
    return lay, request is not None, moves


def _recording(world):
    """``world`` as a communicator that records (name, bytes) of each Allreduce and Bcast it
    makes, and (name, (bytes sent, bytes received)) of each all-to-all, its dist-graph
    communicators' too (the same MPI communicators: the calls go through to them)."""
    from mpi4py import MPI
    calls: list = []

    def spied(base, *names):
        """``base``'s all-to-alls ``names``, each recording (name, (bytes out, bytes in))."""
        def spy(name):
            def call(self, smsg, rmsg):
                calls.append((name, (sum(smsg[1][0]), sum(rmsg[1][0]))))
                return getattr(base, name)(self, smsg, rmsg)
            return call
        return {name: spy(name) for name in names}

    Graph = type("Graph", (MPI.Distgraphcomm,),
                 spied(MPI.Distgraphcomm, "Neighbor_alltoallv", "Ineighbor_alltoallv"))

    class Recording(MPI.Intracomm):
        def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
            calls.append(("Allreduce", memoryview(recvbuf).nbytes))
            return super().Allreduce(sendbuf, recvbuf, op)

        def Bcast(self, buf, root=0):
            calls.append(("Bcast", memoryview(buf).nbytes))
            return super().Bcast(buf, root)

        def Create_dist_graph_adjacent(self, sources, destinations, **kw):
            return Graph(super().Create_dist_graph_adjacent(sources, destinations, **kw))
    for name, call in spied(MPI.Intracomm, "Alltoallv", "Ialltoallv").items():
        setattr(Recording, name, call)
    rec = Recording(world)
    rec.calls = calls
    return rec


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
    spy.calls.clear()
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
    # sizes that are a whole number of LIMIT-byte pieces: the last piece goes too
    spy.calls.clear()
    even = [((torch.arange(350) * (3 + me)) % 509 * 0.5).to(torch.float32)]    # 1400 bytes
    allreduce_sum_(ctx, even)
    assert torch.equal(even[0], sum((torch.arange(350) * (3 + r)) % 509 * 0.5
                                    for r in range(size)).to(torch.float32)), me
    params = [((torch.arange(350) * (3 + me)) % 509 * 0.5).to(torch.float32)]
    broadcast_params_(ctx, params)
    assert torch.equal(params[0], ((torch.arange(350) * 3) % 509 * 0.5).to(torch.float32)), me
    blob = bytes((i * 7 + 1) % 256 for i in range(3 * LIMIT))
    got = bcast_bytes(ctx, blob if me == 0 else None)
    assert bytes(got) == blob, me
    calls = [(name, n) for name, n in spy.calls]
    assert calls == [("Allreduce", LIMIT)] * 2 + [("Bcast", LIMIT)] * 2 + [("Bcast", 8)] + \
        [("Bcast", LIMIT)] * 3, calls
    # 8-byte elements, LIMIT not a multiple of 8: whole elements, at most LIMIT bytes a call
    spy.calls.clear()
    wide = [torch.arange(200, dtype=torch.float64) * (me + 1)]                  # 1600 bytes
    allreduce_sum_(ctx, wide)
    assert torch.equal(wide[0], torch.arange(200, dtype=torch.float64) * sum(range(1, size + 1)))
    calls = [n for name, n in spy.calls if name == "Allreduce"]
    assert sum(calls) == 1600 and max(calls) <= LIMIT and len(calls) == 3, calls
    print(f"rank {me}: collectives ok", flush=True)


def _worker() -> None:
    from hpcgnn.comm.context import CommContext
    ctx = CommContext.from_world("cpu")
    assert ctx.size == 3
    # every rank moves 2 x 300 = 600 <= 700 bytes each way: one call, posted non-blocking,
    # though each block is past 700 // 3 = 233
    lay, nonblocking, moves = _exchange(ctx, [[0, 300, 300], [300, 0, 300], [300, 300, 0]])
    assert max(lay.s_counts) > LIMIT // 3
    assert moves == [(600, 600)], moves
    assert lay.rounds == 1 and nonblocking, lay
    # totals of exactly LIMIT bytes each way still fit one call, though a block (600) is past
    # the LIMIT // 2 bytes a round would carry of it
    lay, nonblocking, moves = _exchange(ctx, [[0, 600, 100], [100, 0, 600], [600, 100, 0]])
    assert moves == [(LIMIT, LIMIT)], moves
    assert lay.rounds == 1 and nonblocking, lay
    # rank 0 sends 800 > 700 bytes to rank 1 (rank 1 receives 850): rounds on every rank, each
    # call within the limit, the same bytes delivered. Every rank has 2 peers: 350 bytes of a
    # block a round, 3 rounds for the 800-byte block (700 // 3 = 233 a round took 4)
    for send, peers in (([[0, 800, 10], [20, 0, 30], [40, 50, 0]], 2),
                        # a ring, one peer each way: 700 bytes a round, 2 rounds (4 with P)
                        ([[0, 800, 0], [0, 0, 750], [690, 0, 0]], 1),
                        # rank 0 receives from 2 peers, and no rank sends to more than 1: k
                        # counts the receivers' peers too (350 bytes a block and round)
                        ([[0, 0, 0], [800, 0, 0], [750, 0, 0]], 2)):
        lay, nonblocking, moves = _exchange(ctx, send)
        widest = max(max(sum(map(bool, row)), sum(map(bool, col)))
                     for row, col in zip(send, zip(*send)))
        assert widest == peers
        want = -(-800 // (LIMIT // peers))          # ceil: the largest block's rounds
        assert lay.rounds == want < -(-800 // (LIMIT // ctx.size)), (lay, send)
        assert not nonblocking and len(moves) == want, moves
        me = ctx.rank
        assert all(a <= LIMIT and b <= LIMIT for a, b in moves), moves
        assert sum(a for a, _ in moves) == sum(send[me]), moves
        assert sum(b for _, b in moves) == sum(row[me] for row in send), moves
    print(f"rank {ctx.rank}: rounds ok", flush=True)
    import os
    if os.environ["HPCGNN_EXCHANGE"] == "alltoallv":
        _collectives(ctx)


if __name__ == "__main__":
    _worker()
