"""Training methods on real ranks against single-process computations of the same methods
written here. Bounded staleness (PipeGCN): halo terms of epoch t use the rows of epoch t - s,
halo gradients reach their owners s epochs later, the first s epochs are synchronous, and
smoothing averages both; resume with staleness on equals the uninterrupted run, and a stale
1-bit run still learns. Compression: a sampled, random-channel schedule trains exactly as the
whole-graph model whose halo rows are what the documented selection delivers."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from conftest import CSBM, check_ok, read_metrics, train, train_here
from test_codecs import np_hash32, ref_channels, ref_kept_rows

EPOCHS = 8
SETS = ("model.arch=gcn", "model.layers=2", "model.hidden=16", "model.dropout=0.0",
        f"train.epochs={EPOCHS}")


def _gcn_operator(g) -> np.ndarray:
    a = sp.csr_matrix((np.ones(g.num_edges), g.indices, g.indptr), shape=(g.num_nodes,) * 2).toarray()
    d = 1.0 / np.sqrt(a.sum(1) + 1.0)
    return d[:, None] * (a + np.eye(g.num_nodes)) * d[None, :]


def stale_reference(part_of: np.ndarray, init: dict, s: int, m: float, drop: float = 0.0,
                    arrival_mask: bool = False) -> list[float]:
    """Plain torch on the whole graph: 2-layer GCN (24 -> 16 -> 4). Layer 0 aggregates its
    input first and sends no gradient; layer 1 exchanges Z = D1 W1. With dropout ``drop``
    (masks: seed 0, per epoch and layer, by global node id — the run's random source), the
    halo rows of both layers are the rows posted at t - s, dropped with *that* epoch's mask
    (and smoothed: layer 0's too, which without dropout are the same every epoch), and
    a halo gradient reaching its owner at epoch t belongs to the rows posted at t - 2s, so it
    goes back through the mask of t - 2s (PipeGCN drops on the receiving side, where the mask
    of a row and of its gradient is the same one). ``arrival_mask``: the wrong way, through the
    owner's mask of the epoch t (what the test tells apart)."""
    from hpcgnn.data.datasets import load_dataset
    from hpcgnn.nn.dropout import keep_mask
    g = load_dataset(CSBM)
    a = torch.from_numpy(_gcn_operator(g)).float()
    same = torch.from_numpy(part_of[:, None] == part_of[None, :])
    a_loc, a_halo = a * same, a * ~same
    x, y = torch.from_numpy(g.dense_features()), torch.from_numpy(g.labels)
    train_idx = torch.from_numpy(g.train_idx)
    ids = torch.arange(g.num_nodes)

    def dropped(v, epoch, layer):
        if drop == 0.0:
            return v
        return v * keep_mask(ids, v.shape[1], drop, 0, epoch, layer) / (1.0 - drop)

    p = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = torch.optim.Adam(p.values(), lr=0.01, weight_decay=5e-4)
    posted, grads, avg_x, avg_z, avg_g, losses = {}, {}, None, None, None, []
    for t in range(EPOCHS):
        stale = s > 0 and t >= s
        if stale:       # layer 0's halo rows: the input as dropped at t - s, smoothed like all rows
            recv = dropped(x, t - s, 0)
            avg_x = recv if (m == 0 or avg_x is None) else m * avg_x + (1 - m) * recv
            agg0 = a_loc @ dropped(x, t, 0) + a_halo @ avg_x
        else:
            agg0 = a @ dropped(x, t, 0)
        h = torch.relu(agg0 @ p["layers.0.weight"] + p["layers.0.bias"])
        z = dropped(h, t, 1) @ p["layers.1.weight"]
        late = 0.0
        if not stale:
            out, halo = a @ z + p["layers.1.bias"], None
        else:
            recv = posted.pop(t - s)
            avg_z = recv if (m == 0 or avg_z is None) else m * avg_z + (1 - m) * recv
            halo = avg_z.clone().requires_grad_(True)
            out = a_loc @ z + a_halo @ halo + p["layers.1.bias"]
            back = grads.pop(t - s, None)
            if back is not None:
                avg_g = back if (m == 0 or avg_g is None) else m * avg_g + (1 - m) * back
                late = (dropped(h, t if arrival_mask else t - 2 * s, 1) @ p["layers.1.weight"] * avg_g).sum()
        posted[t] = z.detach().clone()
        loss = F.cross_entropy(out[train_idx], y[train_idx])
        opt.zero_grad()
        (loss + late).backward()
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
@pytest.mark.parametrize("ranks,s,m,progress", [(2, 1, 0.0, "test"), (2, 1, 0.0, "thread"),
                                                (3, 2, 0.0, "thread"), (3, 1, 0.5, "thread")])
def test_stale_training_equals_single_process_computation(ranks, s, m, progress, shards, init_params,
                                                          tmp_path):
    """Both ways of progressing the exchange in flight (a thread, or tests between layers)."""
    shard_dir = shards(CSBM, ranks, "random")
    proc = train(ranks, shard_dir, tmp_path / "run", *SETS, f"train.staleness={s}",
                 f"train.smoothing={m}", timeout=180, env={"HPCGNN_PROGRESS": progress})
    check_ok(proc)
    got = [r["loss"] for r in read_metrics(tmp_path / "run")]
    want = stale_reference(_parts(shard_dir, ranks), init_params, s, m)
    assert got == pytest.approx(want, rel=2e-5)
    sync = stale_reference(_parts(shard_dir, ranks), init_params, 0, 0.0)
    assert got[s:] != pytest.approx(sync[s:], rel=1e-4)    # staleness changed the trajectory


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,s,m", [(2, 1, 0.0), (3, 2, 0.5)])
def test_stale_training_with_dropout_equals_single_process_computation(ranks, s, m, shards,
                                                                       init_params, tmp_path):
    """Dropout 0.5: stale rows keep the mask they were sent with, and the late halo gradient
    goes back through that mask, not the owner's mask of the epoch it arrives in."""
    shard_dir = shards(CSBM, ranks, "random")
    proc = train(ranks, shard_dir, tmp_path / "run", *SETS[:3], "model.dropout=0.5", SETS[4],
                 f"train.staleness={s}", f"train.smoothing={m}", timeout=180)
    check_ok(proc)
    got = [r["loss"] for r in read_metrics(tmp_path / "run")]
    parts = _parts(shard_dir, ranks)
    assert got == pytest.approx(stale_reference(parts, init_params, s, m, drop=0.5), rel=2e-5)
    # the owner's own mask of the arriving epoch would give other losses from epoch 2s + 1 on
    wrong = stale_reference(parts, init_params, s, m, drop=0.5, arrival_mask=True)
    assert got[:2 * s + 1] == pytest.approx(wrong[:2 * s + 1], rel=2e-5)
    assert got[2 * s + 1:] != pytest.approx(wrong[2 * s + 1:], rel=1e-5)


@pytest.mark.mpi
def test_resume_with_staleness_is_exact(shards, tmp_path):
    shard_dir = shards(CSBM, 2, "random")
    sets = (*SETS[:4], "model.dropout=0.5", "train.staleness=2", "train.smoothing=0.5")
    sched = tmp_path / "q.toml"
    sched.write_text('codec = "sample+quant"\nbits = 2\nkind = "constant"\nratio = 2.0\n'
                     'compress_last_layer = true\n')
    extra = ("--schedule", str(sched))
    check_ok(train(2, shard_dir, tmp_path / "full", *sets, "train.epochs=8", extra=extra, timeout=180))
    # 3 epochs (checkpoint and stop), then resume to 8 with the same config
    check_ok(train(2, shard_dir, tmp_path / "part", *sets, "train.epochs=8",
                   extra=(*extra, "--stop-after", "3"), timeout=180))
    assert len(read_metrics(tmp_path / "part")) == 3
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


# -- compressed (sampled, random-channel) training against a single-process computation ----

COMPRESSED = ('codec = "sample+random"\nkeep = 0.5\nkind = "constant"\nratio = 2.0\n'
              'compress_last_layer = true\ncompress_backward = false\n')


def _block_key(seed: int, layer: int, src: int, dst: int, epoch: int) -> int:
    from test_exchange_exact import mix
    return int(np_hash32(np.uint64(mix(seed, layer, src, dst) & 0xFFFFFFFF) ^ np_hash32(epoch)))


def compressed_reference(shard_dir, ranks: int, init: dict) -> list[float]:
    """The same GCN on the whole graph, each part's halo rows of every layer replaced by what
    the documented selection of ``sample+random`` (keep 1/2 of each block's rows, half the
    channels, scaled by rows/kept) delivers; autograd gives the gradient of that forward."""
    from hpcgnn.data.datasets import load_dataset
    from hpcgnn.data.shard import read_shard
    g = load_dataset(CSBM)
    shards = [read_shard(shard_dir / f"part-{p:05d}.h5") for p in range(ranks)]
    part_of = _parts(shard_dir, ranks)
    a = torch.from_numpy(_gcn_operator(g)).float()
    same = torch.from_numpy(part_of[:, None] == part_of[None, :])
    a_loc = a * same
    a_halo = [a * ~same * torch.from_numpy(part_of == q)[:, None] for q in range(ranks)]
    x, y = torch.from_numpy(g.dense_features()), torch.from_numpy(g.labels)
    train_idx = torch.from_numpy(g.train_idx)
    p = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = torch.optim.Adam(p.values(), lr=0.01, weight_decay=5e-4)

    def masks(layer: int, width: int, epoch: int) -> list[torch.Tensor]:
        out = []
        for q, sq in enumerate(shards):
            m, start = torch.zeros(g.num_nodes, width), 0
            for src, rows in enumerate(sq.recv_counts.tolist()):
                gid = sq.halo_global_id[start:start + rows]
                key = _block_key(0, layer, src, q, epoch)
                kept = ref_kept_rows(key, rows, 0.5)
                chans = ref_channels(key, width, width // 2)
                if kept:
                    m[np.ix_(gid[kept], chans)] = rows / len(kept)
                start += rows
            out.append(m)
        return out

    def propagate(e: torch.Tensor, layer: int, epoch: int) -> torch.Tensor:
        ms = masks(layer, e.shape[1], epoch)
        return a_loc @ e + sum(a_halo[q] @ (ms[q] * e) for q in range(ranks))

    losses = []
    for t in range(EPOCHS):
        h = torch.relu(propagate(x, 0, t) @ p["layers.0.weight"] + p["layers.0.bias"])
        out = propagate(h @ p["layers.1.weight"], 1, t) + p["layers.1.bias"]
        loss = F.cross_entropy(out[train_idx], y[train_idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_compressed_training_equals_single_process_computation(ranks, shards, init_params, tmp_path):
    shard_dir = shards(CSBM, ranks, "random")
    (tmp_path / "s.toml").write_text(COMPRESSED)
    check_ok(train(ranks, shard_dir, tmp_path / "run", *SETS,
                   extra=("--schedule", str(tmp_path / "s.toml")), timeout=180))
    got = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert got == pytest.approx(compressed_reference(shard_dir, ranks, init_params), rel=2e-5)
