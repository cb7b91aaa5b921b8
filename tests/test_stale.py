"""Bounded staleness (PipeGCN) on real ranks against a single-process computation of the same
method written here: halo terms of epoch t use the rows of epoch t - s, halo gradients reach
their owners s epochs later, the first s epochs are synchronous, and smoothing averages both.
Also: resume with staleness on equals the uninterrupted run, and a stale run still learns."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from conftest import CSBM, check_ok, read_metrics, train, train_here

EPOCHS = 8
SETS = ("model.arch=gcn", "model.layers=2", "model.hidden=16", "model.dropout=0.0",
        f"train.epochs={EPOCHS}")


def _gcn_operator(g) -> np.ndarray:
    a = sp.csr_matrix((np.ones(g.num_edges), g.indices, g.indptr), shape=(g.num_nodes,) * 2).toarray()
    d = 1.0 / np.sqrt(a.sum(1) + 1.0)
    return d[:, None] * (a + np.eye(g.num_nodes)) * d[None, :]


def stale_reference(part_of: np.ndarray, init: dict, s: int, m: float) -> list[float]:
    """Plain torch on the whole graph: 2-layer GCN (24 -> 16 -> 4). Layer 0 aggregates the
    constant input first (its stale rows equal the fresh ones); layer 1 exchanges Z = H W1."""
    from hpcgnn.data.datasets import load_dataset
    g = load_dataset(CSBM)
    a = torch.from_numpy(_gcn_operator(g)).float()
    same = torch.from_numpy(part_of[:, None] == part_of[None, :])
    a_loc, a_halo = a * same, a * ~same
    x, y = torch.from_numpy(g.dense_features()), torch.from_numpy(g.labels)
    train_idx = torch.from_numpy(g.train_idx)
    p = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = torch.optim.Adam(p.values(), lr=0.01, weight_decay=5e-4)
    posted, grads, avg_z, avg_g, losses = {}, {}, None, None, []
    for t in range(EPOCHS):
        h = torch.relu((a @ x) @ p["layers.0.weight"] + p["layers.0.bias"])
        z = h @ p["layers.1.weight"]
        if s == 0 or t < s:
            out, halo = a @ z + p["layers.1.bias"], None
        else:
            recv = posted.pop(t - s)
            avg_z = recv if (m == 0 or avg_z is None) else m * avg_z + (1 - m) * recv
            halo = avg_z.clone().requires_grad_(True)
            out = a_loc @ z + a_halo @ halo + p["layers.1.bias"]
            back = grads.pop(t - s, None)
            if back is not None:
                avg_g = back if (m == 0 or avg_g is None) else m * avg_g + (1 - m) * back
                z.register_hook(lambda grad, inj=avg_g: grad + inj)
        posted[t] = z.detach().clone()
        loss = F.cross_entropy(out[train_idx], y[train_idx])
        opt.zero_grad()
        loss.backward()
        if halo is not None:
            grads[t] = halo.grad.clone()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def init_params(shards, tmp_path_factory):
    from hpcgnn.train.checkpoint import CHECKPOINT_NAME
    out = tmp_path_factory.mktemp("init")
    train_here(shards(CSBM, 1), out, *SETS[:4], "train.epochs=1", "train.lr=1e-30",
               "train.weight_decay=0", config=None)
    return torch.load(out / CHECKPOINT_NAME, weights_only=True)["model"]


def _parts(shard_dir, ranks: int) -> np.ndarray:
    from hpcgnn.data.shard import read_meta, read_shard
    part_of = np.zeros(read_meta(shard_dir)["num_nodes"], dtype=np.int64)
    for r in range(ranks):
        part_of[read_shard(shard_dir / f"part-{r:05d}.h5").global_id] = r
    return part_of


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,s,m", [(2, 1, 0.0), (3, 2, 0.0), (3, 1, 0.5)])
def test_stale_training_equals_single_process_computation(ranks, s, m, shards, init_params, tmp_path):
    shard_dir = shards(CSBM, ranks, "random")
    proc = train(ranks, shard_dir, tmp_path / "run", *SETS, f"train.staleness={s}",
                 f"train.smoothing={m}", timeout=180)
    check_ok(proc)
    got = [r["loss"] for r in read_metrics(tmp_path / "run")]
    want = stale_reference(_parts(shard_dir, ranks), init_params, s, m)
    assert got == pytest.approx(want, rel=2e-5)
    sync = stale_reference(_parts(shard_dir, ranks), init_params, 0, 0.0)
    assert got[s:] != pytest.approx(sync[s:], rel=1e-4)    # staleness changed the trajectory


@pytest.mark.mpi
def test_resume_with_staleness_is_exact(shards, tmp_path):
    shard_dir = shards(CSBM, 2, "random")
    sets = (*SETS[:4], "model.dropout=0.5", "train.staleness=2", "train.smoothing=0.5")
    sched = tmp_path / "q.toml"
    sched.write_text('codec = "sample+quant"\nbits = 2\nkind = "constant"\nratio = 2.0\n'
                     'compress_last_layer = true\n')
    extra = ("--schedule", str(sched))
    check_ok(train(2, shard_dir, tmp_path / "full", *sets, "train.epochs=8", extra=extra, timeout=180))
    # 3 epochs, then resume to 8 (the run config's epochs stay 8: the schedule's T is unchanged)
    check_ok(train(2, shard_dir, tmp_path / "part", *sets, "train.epochs=3", extra=extra, timeout=180))
    check_ok(train(2, shard_dir, tmp_path / "part", *sets, "train.epochs=8",
                   extra=(*extra, "--resume"), timeout=180))
    full = [r["loss"] for r in read_metrics(tmp_path / "full")]
    part = [r["loss"] for r in read_metrics(tmp_path / "part")]
    assert part == full


@pytest.mark.mpi
def test_one_bit_stale_run_still_learns(shards, tmp_path):
    check_ok(train(2, shards(CSBM, 2, "random"), tmp_path / "run", "train.epochs=60",
                   "train.staleness=1", "train.smoothing=0.9",
                   extra=("--schedule", "configs/schedules/quant1-all.toml"), timeout=180))
    last = read_metrics(tmp_path / "run")[-1]
    assert last["test_acc"] > 0.85
