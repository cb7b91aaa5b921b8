"""One layer's stale exchange (``hpcgnn.comm.stale``) on real ranks, epoch by epoch, against
the timeline ``docs/staleness.md`` states, recomputed here in numpy from the shard files alone.

Every rank feeds the exchange deterministic rows ``h_t[v, c] = f(v, c, t)`` at epoch ``t``,
takes ``loss = sum(halo * w(q, v, c, t))`` and back-propagates, then posts its kept halo
gradients as the trainer does after its Allreduce. With staleness ``s`` and smoothing ``m``:

- epochs ``t < s`` are synchronous: the halo is ``f(., t)`` and each owned row's gradient is
  the sum over the ranks holding it as a halo row of their ``w(q, ., t)``;
- from ``t = s`` the halo is the rows posted at ``t - s``, smoothed as ``A_s = f(., 0)``,
  ``A_t = m A_{t-1} + (1 - m) f(., t - s)`` (the average starts at the first received value);
- epochs ``s <= t < 2s`` add no late gradient (the warm-up's went back synchronously), and
  from ``t = 2s`` each owned row gets, smoothed the same way from ``t = 2s``, the halo
  gradients its peers computed at ``t - s``.

This file is also the MPI worker.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import CSBM, check_ok, run_mpi

WIDTH, EPOCHS = 3, 7
CASES = ((1, 0.0), (2, 0.0), (1, 0.5), (2, 0.75))      # (staleness, smoothing)


def f(gid, t):
    c = np.arange(WIDTH)
    return np.sin(0.37 * gid[:, None] + 1.3 * c[None, :] + 0.9 * t) + (gid[:, None] % 5)


def w(rank, gid, t):
    c = np.arange(WIDTH)
    return np.cos(0.11 * gid[:, None] - 0.7 * c[None, :] + rank + 2.1 * t)


def smoothed(values: list, m: float) -> list:
    """``a_0 = v_0``, ``a_i = m a_{i-1} + (1 - m) v_i``."""
    out = []
    for v in values:
        out.append(v if not out else m * out[-1] + (1 - m) * v)
    return out


def expected(shard_dir: Path, ranks: int, s: int, m: float):
    """(halo per epoch per rank, owned-row gradient per epoch per rank)."""
    from hpcgnn.data.shard import read_shard
    shards = [read_shard(shard_dir / f"part-{p:05d}.h5") for p in range(ranks)]

    def returned(p: int, t: int) -> np.ndarray:
        """What rank ``p``'s owned rows get back from the halo rows used at epoch ``t``."""
        grad = np.zeros((shards[p].n_owned, WIDTH))
        for q, sq in enumerate(shards):
            if q != p:
                mine = np.isin(sq.halo_global_id, shards[p].global_id)
                gid = sq.halo_global_id[mine]
                np.add.at(grad, np.searchsorted(shards[p].global_id, gid), w(q, gid, t))
        return grad

    halos, grads = [], []
    for p, sp in enumerate(shards):
        gid = sp.halo_global_id
        stale = smoothed([f(gid, t - s) for t in range(s, EPOCHS)], m)
        halos.append([f(gid, t) for t in range(s)] + stale)
        late = smoothed([returned(p, t - s) for t in range(2 * s, EPOCHS)], m)
        grads.append([returned(p, t) for t in range(s)]
                     + [np.zeros((sp.n_owned, WIDTH))] * min(s, EPOCHS - s) + late)
    return halos, grads


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_stale_exchange_follows_the_documented_timeline(ranks, shards, tmp_path):
    shard_dir = shards(CSBM, ranks, "random")
    check_ok(run_mpi(ranks, [__file__, str(shard_dir), str(tmp_path)], timeout=180))
    for s, m in CASES:
        halos, grads = expected(shard_dir, ranks, s, m)
        for r in range(ranks):
            got = json.loads((tmp_path / f"s{s}-m{m}-{r}.json").read_text())
            assert len(got) == EPOCHS
            for t, (halo, grad) in enumerate(got):
                where = f"staleness {s}, smoothing {m}, rank {r}, epoch {t}"
                np.testing.assert_allclose(np.array(halo).reshape(-1, WIDTH), halos[r][t],
                                           rtol=1e-5, atol=1e-5, err_msg=f"{where}: halo")
                np.testing.assert_allclose(np.array(grad).reshape(-1, WIDTH), grads[r][t],
                                           rtol=1e-5, atol=1e-5, err_msg=f"{where}: gradient")
        assert any(np.abs(g).sum() > 0 for g in grads[0][2 * s:])    # late gradients arrive


def _worker(shard_dir: str, out: str) -> None:
    import torch

    from hpcgnn.comm.context import CommContext
    from hpcgnn.comm.exchange import ExchangeSettings, ExchangeStats, HaloExchanger
    from hpcgnn.comm.plan import HaloPlan
    from hpcgnn.comm.stale import StaleExchange
    from hpcgnn.train.inputs import load_part
    ctx = CommContext.from_world("cpu")
    _, shard = load_part(shard_dir, ctx.rank, ctx.size)
    plan = HaloPlan.from_shard(shard)
    for s, m in CASES:
        ex = HaloExchanger(ctx, plan, layer=1, seed=0, stats=ExchangeStats())
        stale, record = StaleExchange(ex, s, m), []
        for t in range(EPOCHS):
            h = torch.tensor(f(shard.global_id, t), dtype=torch.float32, requires_grad=True)
            halo = stale.exchange(h, ExchangeSettings(t))
            weight = torch.tensor(w(ctx.rank, shard.halo_global_id, t), dtype=torch.float32)
            (halo * weight).sum().backward()
            stale.post_late_gradients()                  # the trainer: after its Allreduce
            record.append((halo.detach().reshape(-1).tolist(), h.grad.reshape(-1).tolist()))
        stale.state_dict()                               # completes what is still in flight
        Path(out, f"s{s}-m{m}-{ctx.rank}.json").write_text(json.dumps(record))
    print(f"rank {ctx.rank}: done", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _worker(*sys.argv[1:3])
