"""A synchronous layer's aggregation holds its two sparse products' blocks, not a third.

``HaloPropagation.aggregate`` computes ``owned @ src`` while the halo rows travel, then
``halo @ src_halo``, and returned their sum as a new ``(n_owned, w)`` block beside both: the
peak of a wide layer (SAGE, hidden 256, 2 ranks of a 300k-node cSBM: predict peaked at
1423 MiB resident, training at 1718; adding in place, 1276 and 1572, the same bits). Two real
ranks; the result against scipy's product of the operators and the halo rows rebuilt from
their global ids; the peak from ``VmHWM`` (reset before the call), with blocks above glibc's
largest mmap threshold so that each one shows.
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
    from hpcgnn.nn.propagation import HaloPropagation
    from hpcgnn.train.inputs import load_part

    ctx = CommContext.from_world("cpu")
    _, shard = load_part(shard_dir, ctx.rank, ctx.size)
    graph = LocalGraph.from_shard(shard, "sage")
    plan = HaloPlan.from_shard(shard)
    prop = HaloPropagation(HaloExchanger(ctx, plan, layer=1, seed=0, stats=ExchangeStats()))
    src = _rows(shard.global_id)
    with torch.no_grad():
        prop.aggregate(graph, src, ExchangeSettings(epoch=0))     # warm, outside the count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                           # VmHWM := VmRSS
        base = _rss_kib()
        out = prop.aggregate(graph, src, ExchangeSettings(epoch=1))
        peak = (_hwm_kib() - base) * 1024

    def scipy_of(op):
        m = op.mat
        return sp.csr_matrix((m.values().double().numpy(), m.col_indices().numpy(),
                              m.crow_indices().numpy()), shape=op.shape)
    want = (scipy_of(graph.owned) @ src.double().numpy()
            + scipy_of(graph.halo) @ _rows(shard.halo_global_id).double().numpy())
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-4)
    block = graph.n_owned * WIDTH * 4
    bound = 2 * block + (plan.n_send + plan.n_halo) * WIDTH * 4 + (16 << 20)
    assert peak <= bound, f"rank {ctx.rank}: peak {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"
    print(f"rank {ctx.rank}: ok peak {peak / 2**20:.1f} MiB bound {bound / 2**20:.1f} MiB "
          f"block {block / 2**20:.1f} MiB", flush=True)


def test_aggregation_adds_the_halo_product_in_place(shards):
    pytest.importorskip("scipy")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        pytest.skip(f"cannot reset the peak resident set here ({exc})")
    proc = run_mpi(2, [__file__, shards(GRAPH, 2)], timeout=180)
    check_ok(proc)
    assert proc.stdout.count(": ok peak ") == 2, proc.stdout


if __name__ == "__main__":
    _worker(sys.argv[1])
