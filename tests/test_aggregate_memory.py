"""A synchronous layer holds its blocks one at a time where it can: measured on real ranks.

``HaloPropagation.aggregate`` computes ``owned @ src`` while the halo rows travel, then
``halo @ src_halo``, and returned their sum as a new ``(n_owned, w)`` block beside both; and
GraphSAGE made its self term ``x W_s`` before the neighbours' exchange, so it lived through it.
Each was one block more at a wide layer's peak (SAGE, hidden 256, 2 ranks of a 300k-node cSBM:
training peaked at 1718 MiB resident, predict at 1423; with both fixed, 1447 and 1130, the same
bits). Two real ranks; the results against scipy's products of the operators and the halo rows
rebuilt from their global ids; the peaks from ``VmHWM`` (reset before each call), with blocks
above glibc's largest mmap threshold so that each one shows.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import check_ok, run_mpi

pytestmark = pytest.mark.mpi

GRAPH = "csbm:nodes=40000,classes=4,degree=10,features=4,seed=11"
WIDTH = 512            # 20,000 owned rows x 512 x 4 B = 41 MB a block: always mmapped


def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _rows(gid: np.ndarray):
    import torch
    return torch.from_numpy(((gid[:, None] * 7 + np.arange(WIDTH)) % 13 - 6).astype(np.float32))


def _worker(shard_dir: str) -> None:
    import scipy.sparse as sp
    import torch
    from hpcgnn.comm.context import CommContext
    from hpcgnn.comm.exchange import ExchangeSettings, ExchangeStats, HaloExchanger
    from hpcgnn.comm.plan import HaloPlan
    from hpcgnn.nn.graph import LocalGraph
    from hpcgnn.nn.layers import SAGELayer
    from hpcgnn.nn.propagation import HaloPropagation
    from hpcgnn.nn.step import LayerStep
    from hpcgnn.train.inputs import load_part

    ctx = CommContext.from_world("cpu")
    _, shard = load_part(shard_dir, ctx.rank, ctx.size)
    graph = LocalGraph.from_shard(shard, "sage")
    plan = HaloPlan.from_shard(shard)
    prop = HaloPropagation(HaloExchanger(ctx, plan, layer=1, seed=0, stats=ExchangeStats()))
    src = _rows(shard.global_id)
    halo_src = _rows(shard.halo_global_id).double().numpy()

    def peak_of(call):
        """(result, peak bytes above the resident set before ``call()``)."""
        with torch.no_grad():
            call()                                                 # warm, outside the count
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                                       # VmHWM := VmRSS
            base = _rss_kib()
            out = call()
            return out, (_hwm_kib() - base) * 1024

    def scipy_of(op):
        m = op.mat
        return sp.csr_matrix((m.values().double().numpy(), m.col_indices().numpy(),
                              m.crow_indices().numpy()), shape=op.shape)

    def check(what, peak, blocks):
        block = graph.n_owned * WIDTH * 4
        bound = blocks * block + (plan.n_send + plan.n_halo) * WIDTH * 4 + (16 << 20)
        assert peak <= bound, (f"rank {ctx.rank}: {what} peak {peak / 2**20:.1f} MiB > "
                               f"{bound / 2**20:.1f} MiB")
        print(f"rank {ctx.rank}: {what} ok peak {peak / 2**20:.1f} MiB bound "
              f"{bound / 2**20:.1f} MiB block {block / 2**20:.1f} MiB", flush=True)

    # the aggregation: its two products' blocks and the exchanged rows
    out, peak = peak_of(lambda: prop.aggregate(graph, src, ExchangeSettings(epoch=1)))
    want = scipy_of(graph.owned) @ src.double().numpy() + scipy_of(graph.halo) @ halo_src
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-4)
    check("aggregate", peak, 2)

    # a SAGE layer that transforms first: x W_n, then the aggregation's two blocks, no x W_s
    torch.manual_seed(0)
    layer = SAGELayer(WIDTH, WIDTH, graph, prop)
    assert layer.transform_first
    step = LayerStep(epoch=2, training=False, seed=0, layer=1, exchange=ExchangeSettings(epoch=2))
    x = src / 8
    out, peak = peak_of(lambda: layer.forward_owned(x, step))
    w = layer.weight.detach().double().numpy()
    w_self, w_neigh = w[:, :WIDTH], w[:, WIDTH:]
    want = (x.double().numpy() @ w_self + scipy_of(graph.owned) @ (x.double().numpy() @ w_neigh)
            + scipy_of(graph.halo) @ ((halo_src / 8) @ w_neigh)
            + layer.bias.detach().double().numpy())
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-3)
    check("sage layer", peak, 3)


def test_aggregation_and_sage_layer_peaks(shards):
    pytest.importorskip("scipy")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        pytest.skip(f"cannot reset the peak resident set here ({exc})")
    proc = run_mpi(2, [__file__, shards(GRAPH, 2)], timeout=180)
    check_ok(proc)
    assert proc.stdout.count(" ok peak ") == 4, proc.stdout


if __name__ == "__main__":
    _worker(sys.argv[1])
