"""The collectives of CAGNET's algorithms (``hpcgnn.comm.cagnet_wire``) on real ranks, at the MPI
count limit and at a lowered one (``HPCGNN_MAX_MESSAGE``): every result equals a sum or
concatenation computed here, uneven blocks and empty ones included; each call is split into
the rounds the limit asks for; the bytes equal the standard collective costs.

The rank side is this file run under ``mpiexec`` (``python -m mpi4py tests/test_cagnet_wire.py``).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()


class Calls:
    """The real communicator, with a count of the calls made on it by name."""

    def __init__(self, comm):
        self.comm, self.count = comm, {}

    def __getattr__(self, name):
        fn = getattr(self.comm, name)
        if name[:1].isupper() and name not in ("Get_rank", "Get_size"):
            def counted(*args, **kw):
                self.count[name] = self.count.get(name, 0) + 1
                return fn(*args, **kw)
            return counted
        return fn


def block(rank: int, n: int, salt: int):
    """Rank ``rank``'s data: small integers, so float32 sums are exact in any order."""
    import torch
    return ((torch.arange(n) * 7 + rank * 3 + salt) % 23).to(torch.float32)


def rank_main(limit: int) -> None:
    import torch

    from hpcgnn.comm.cagnet_wire import Wire
    from hpcgnn.comm.context import CommContext
    from hpcgnn.comm.exchange import ExchangeStats
    ctx = CommContext.from_world("cpu")
    comm, me, m = Calls(ctx.comm), ctx.rank, ctx.size
    wire = Wire(ctx, limit, ExchangeStats())
    sizes = [(37 * (r + 1)) % 50 if r != 1 else 0 for r in range(m)]      # uneven, one empty
    per = lambda k: max(1, limit // (4 * k))                                  # noqa: E731
    want_calls, want_bytes = {}, 0

    # Bcast from rank 1 (an int32 payload too, as the sparse blocks' indices)
    x = block(1, 301, 0) if me == 1 else torch.empty(301)
    assert torch.equal(wire.bcast(comm, x, root=1), block(1, 301, 0))
    idx = torch.arange(55, dtype=torch.int32) if me == 1 else torch.zeros(55, dtype=torch.int32)
    assert torch.equal(wire.bcast(comm, idx, root=1), torch.arange(55, dtype=torch.int32))
    want_calls["Bcast"] = math.ceil(301 / per(1)) + math.ceil(55 / per(1))
    want_bytes += (m - 1) * (301 + 55) * 4

    # Reduce to the last rank, Allreduce
    got = wire.reduce(comm, block(me, 211, 1), root=m - 1)
    if me == m - 1:
        assert torch.equal(got, sum(block(r, 211, 1) for r in range(m)))
    assert torch.equal(wire.allreduce(comm, block(me, 99, 2)), sum(block(r, 99, 2) for r in range(m)))
    want_calls["Reduce"], want_calls["Allreduce"] = math.ceil(211 / per(1)), math.ceil(99 / per(1))
    want_bytes += (m - 1) * 211 * 4 + 2 * (m - 1) * 99 * 4

    # Allgatherv and Reduce_scatter of uneven blocks
    got = wire.allgather(comm, block(me, sizes[me], 3), sizes)
    assert torch.equal(got, torch.cat([block(r, sizes[r], 3) for r in range(m)]))
    full = lambda r: block(r, sum(sizes), 4)                                  # noqa: E731
    lo = sum(sizes[:me])
    got = wire.reduce_scatter(comm, full(me), sizes)
    assert torch.equal(got, sum(full(r) for r in range(m))[lo:lo + sizes[me]])
    rounds = math.ceil(max(sizes) / per(m))
    want_calls["Allgatherv"], want_calls["Reduce_scatter"] = rounds, rounds
    want_bytes += 2 * (m - 1) * sum(sizes) * 4

    assert comm.count == want_calls, (comm.count, want_calls)
    total = ctx.comm.allreduce(wire.stats.bytes_sent)
    assert total == want_bytes and wire.stats.bytes_full == wire.stats.bytes_sent, (total, want_bytes)
    if me == 0:
        print(f"wire ok: {comm.count}")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,limit", [(3, None), (3, "24"), (4, "7"), (2, "1000")])
def test_collectives_equal_the_sums_in_rounds(ranks, limit):
    from _mpi import run_mpi
    env = {} if limit is None else {"HPCGNN_MAX_MESSAGE": limit}
    proc = run_mpi(ranks, [str(HERE)], timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wire ok" in proc.stdout
    if limit == "7":                                      # below one float32 per block: 1 a round
        assert "'Bcast': 356" in proc.stdout


def test_a_bad_limit_is_refused(monkeypatch):
    from hpcgnn.comm.cagnet_wire import message_limit
    for bad in ("0", "-3", "lots", str(2**31)):
        monkeypatch.setenv("HPCGNN_MAX_MESSAGE", bad)
        with pytest.raises(ValueError, match=r"HPCGNN_MAX_MESSAGE=.*use an integer of bytes"):
            message_limit()
    monkeypatch.setenv("HPCGNN_MAX_MESSAGE", "4096")
    assert message_limit() == 4096


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    from hpcgnn.comm.cagnet_wire import message_limit
    rank_main(message_limit())
