"""The halo exchange on real ranks: forward delivers exactly the halo rows' values, backward
scatter-adds every halo gradient into the owned row it came from, with and without overlap,
with the identity codec and with a codec of its own (fp16 + a per-block key header), whose
byte counts and shared keys the exchange must honour. This file is also the MPI worker."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from conftest import CSBM, run_mpi

WIDTH = 5


def test_block_keys_and_displacements():
    from hpcgnn.comm.keys import BACKWARD, FORWARD, block_key
    from hpcgnn.comm.plan import displacements
    keys = {block_key(0, e, l, d, s, t) for e in range(3) for l in range(2)
            for d in (FORWARD, BACKWARD) for s in range(3) for t in range(3)}
    assert len(keys) == 3 * 2 * 2 * 3 * 3 and all(0 <= k < 2**63 for k in keys)
    assert block_key(1, 2, 3, 0, 4, 5) == block_key(1, 2, 3, 0, 4, 5) != block_key(2, 2, 3, 0, 4, 5)
    assert displacements([3, 0, 2, 5]) == [0, 3, 3, 5]


def test_plan_from_shard(shards):
    from hpcgnn.comm.plan import HaloPlan
    from hpcgnn.data.shard import read_shard
    d = shards("cora", 3, "random")
    for part in range(3):
        s = read_shard(d / f"part-{part:05d}.h5")
        plan = HaloPlan.from_shard(s)
        assert plan.n_send == sum(plan.send_counts) and plan.n_halo == sum(plan.recv_counts)
        assert sorted(plan.peers) == [p for p in range(3) if p != part]
        assert set(plan.boundary_rows()) <= set(range(s.n_owned))


TRANSPORTS = {"default": {}, "neighbor": {"HPCGNN_EXCHANGE": "neighbor"},
              "rounds": {"HPCGNN_MAX_MESSAGE": "700"},            # blocks of 350 bytes a round (2 peers)
              "neighbor-rounds": {"HPCGNN_EXCHANGE": "neighbor", "HPCGNN_MAX_MESSAGE": "4000"}}


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,transport", [(2, "default"), (3, "default"), (3, "neighbor"),
                                             (3, "rounds"), (4, "neighbor-rounds")])
def test_exchange_on_ranks(ranks, transport, shards):
    """Every transport (all-to-all, neighbourhood collective, rounds under a lowered message
    limit) delivers the same rows and gradients."""
    proc = run_mpi(ranks, [__file__, str(shards(CSBM, ranks, "random"))], timeout=120,
                   env=TRANSPORTS[transport])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("exchange ok") == ranks


# -- the worker (runs on every rank) --------------------------------------------------------

def _half_codec():
    from dataclasses import dataclass

    from hpcgnn.codecs.base import WireCodec

    @dataclass(frozen=True)
    class HalfWithKey(WireCodec):
        """fp16 rows, each non-empty block led by its 8-byte block key (checked on decode)."""

        @property
        def name(self):
            return "half-with-key"

        def block_bytes(self, rows, width):
            return 8 + rows * width * 2

        def encode(self, x, blocks, keys, noise_key=0):
            out, start = [], 0
            for c, k in zip(blocks.counts, keys.tolist()):
                if c:
                    out += [torch.tensor([k], dtype=torch.int64).view(torch.uint8),
                            x[start:start + c].to(torch.float16).contiguous().view(torch.uint8).reshape(-1)]
                start += c
            return torch.cat(out) if out else torch.zeros(0, dtype=torch.uint8)

        def decode(self, buf, blocks, width, keys):
            rows, pos = [], 0
            for c, k in zip(blocks.counts, keys.tolist()):
                if c:
                    assert int(buf[pos:pos + 8].clone().view(torch.int64)) == k, "block keys disagree"
                    n = c * width * 2
                    rows.append(buf[pos + 8:pos + 8 + n].view(torch.float16).float().reshape(c, width))
                    pos += 8 + n
            return torch.cat(rows) if rows else torch.zeros(0, width)

    return HalfWithKey()


def _values(gid: np.ndarray) -> torch.Tensor:
    """Row values exact in fp16: (gid % 97) + channel / 8."""
    return torch.tensor((gid[:, None] % 97) + np.arange(WIDTH)[None, :] / 8.0, dtype=torch.float32)


def _weights(rank: int, gid: np.ndarray) -> torch.Tensor:
    """Per-(receiving rank, halo node, channel) weights, exact in fp16."""
    return torch.tensor((rank + 1) * 0.5 + (gid[:, None] % 5) + np.arange(WIDTH)[None, :] * 0.25,
                        dtype=torch.float32)


def _expected_grad(shard, rank_count: int) -> torch.Tensor:
    """What the owned rows must get back: the weights of every peer they were sent to."""
    grad = torch.zeros(shard.n_owned, WIDTH)
    start = 0
    for p, c in enumerate(shard.send_counts):
        rows = shard.send_index[start:start + c]
        grad.index_add_(0, torch.as_tensor(rows), _weights(p, shard.global_id[rows]))
        start += c
    return grad


def _check(ctx, shard, plan, codec, overlap: bool) -> None:
    from hpcgnn.comm.exchange import ExchangeSettings, ExchangeStats, HaloExchanger
    stats = ExchangeStats()
    exch = HaloExchanger(ctx, plan, layer=1, seed=7, stats=stats, overlap=overlap)
    settings = ExchangeSettings(epoch=3, forward=codec, backward=codec)
    x = _values(shard.global_id).requires_grad_(True)
    halo = exch.exchange(x, settings)
    assert torch.equal(halo, _values(shard.halo_global_id)), (codec.name, overlap)
    (halo * _weights(ctx.rank, shard.halo_global_id)).sum().backward()
    assert torch.equal(x.grad, _expected_grad(shard, ctx.size)), (codec.name, overlap)
    sent = sum(codec.byte_counts(list(shard.send_counts), WIDTH))
    back = sum(codec.byte_counts(list(shard.recv_counts), WIDTH))
    assert stats.bytes_sent == sent + back and stats.exchanges == 2
    assert stats.bytes_full == 4 * WIDTH * (plan.n_send + plan.n_halo)


def _worker(shard_dir: str) -> None:
    from hpcgnn.codecs.base import IDENTITY
    from hpcgnn.comm.exchange import ExchangeStats, HaloExchanger
    from hpcgnn.comm.context import CommContext
    from hpcgnn.comm.plan import HaloPlan
    from hpcgnn.train.inputs import load_part
    ctx = CommContext.from_world("cpu")
    _, shard = load_part(shard_dir, ctx.rank, ctx.size)
    plan = HaloPlan.from_shard(shard)
    for codec in (IDENTITY, _half_codec()):
        for overlap in (True, False):
            _check(ctx, shard, plan, codec, overlap)
    import os
    exch = HaloExchanger(ctx, plan, layer=0, seed=0, stats=ExchangeStats())
    assert exch._transport.mode == "unconnected"          # nothing collective at construction
    lay, _ = exch._layout(IDENTITY, WIDTH, True)           # the first layout chooses
    want_mode = "neighbor" if os.environ.get("HPCGNN_EXCHANGE") == "neighbor" else "alltoallv"
    assert exch._transport.mode == want_mode
    if "HPCGNN_MAX_MESSAGE" in os.environ:
        from mpi4py import MPI
        # bytes of a block per round: the limit over the most peers any rank has in a call
        peers = max(sum(c > 0 for c in lay.s_counts), sum(c > 0 for c in lay.r_counts))
        chunk = int(os.environ["HPCGNN_MAX_MESSAGE"]) // ctx.comm.allreduce(peers, op=MPI.MAX)
        widest = ctx.comm.allreduce(max(lay.s_counts + lay.r_counts), op=MPI.MAX)
        assert lay.rounds == -(-widest // chunk) > 1, (lay, chunk, widest)
    print(f"rank {ctx.rank}: exchange ok", flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1])
