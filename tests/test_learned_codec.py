"""VARCO's ``learned`` codec as the authors' code applies it (issue 23), on real ranks: the
encoder/decoder pair touches the halo rows only while the exchange compresses.

- at ratio 1 the pair is never applied, so a ``learned`` run at ratio 1 is full communication,
  bit for bit (before the fix, ``decoder(encoder(.))`` was applied at every ratio and drifted
  from the identity under Adam: 76.0 % against 82.0 % on Cora);
- the pair starts as the identity and making it draws nothing from the global RNG, so the
  first step of a ``learned`` run is the first step of the same ``truncate`` run, bit for bit;
- while compressing, the pair trains (its parameters leave the identity);
- ``truncate`` and ``learned`` runs equal a whole-graph GCN written here whose cut edges carry
  ``decoder(pad(encoder(x W)[:, :k]))`` (SAR's ``FeatureCompressorDecompressor``), both linear
  maps starting as the identity and trained by Adam with the model (no weight decay), frozen
  for ``truncate``, and the rows as they are once ``k = F``.
This file is also the MPI worker (one launch, several trainings).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import check_ok, initial_params, read_metrics, run_mpi  # noqa: E402

# the ranks' worker: test_compressed.py's (hpcgnn train with each schedule in turn, into OUT/NAME)
TRAIN_SCHEDULES = Path(__file__).resolve().with_name("test_compressed.py")
GRAPH = "csbm:nodes=3000,classes=4,degree=8,features=48,seed=3"
RUN = """
[model]
hidden = 16
layers = 2
[train]
epochs = 6
eval_every = 1
"""
VARCO = 'kind = "linear"\nmax_ratio = 16.0\nmin_ratio = 1.0\nslope = 1.0\n'   # k = 1,1,1,3,16,16
SCHEDULES = {
    "full": 'codec = "none"\nkind = "constant"\nratio = 1.0\n',
    "learned-ratio1": 'codec = "learned"\nkind = "constant"\nratio = 1.0\n',
    "truncate": 'codec = "truncate"\n' + VARCO,
    "learned": 'codec = "learned"\n' + VARCO,
}


def varco_losses(parts: torch.Tensor, init: dict, learned: bool, epochs: int = 6) -> list[float]:
    """RUN's 2-layer GCN (dropout 0.5, Adam lr 0.01, weight decay 5e-4) on the whole graph:
    layer 0 (48 -> 16 wide: it sends ``x W``) sends ``k = floor(16 / r(t))`` channels,
    ``r(t) = max(1, 16 - t * 15 / (T - 2))``, through the encoder and decoder where ``k < 16``
    (as ``truncate`` when not ``learned``); the last layer is not compressed."""
    from _pipegcn import adam_step, graph_ops, keep
    from hpcgnn.data.datasets import load_dataset
    g = load_dataset(GRAPH)
    op = graph_ops(g)[0]
    idx, val = op.indices(), op.values()
    cut = parts[idx[0]] != parts[idx[1]]                        # edges from another part
    a_own, a_cut = (torch.sparse_coo_tensor(idx[:, m], val[m], op.shape,
                                            check_invariants=True).coalesce() for m in (~cut, cut))
    x, y, train = (torch.from_numpy(a) for a in (g.dense_features(), g.labels, g.train_idx))
    p = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    pair = {k: v.requires_grad_(learned) for k, v in
            (("enc_w", torch.eye(16)), ("enc_b", torch.zeros(16)),
             ("dec_w", torch.eye(16)), ("dec_b", torch.zeros(16)))}
    groups = [{"params": list(p.values()), "weight_decay": 5e-4}]
    groups += [{"params": list(pair.values()), "weight_decay": 0.0}] if learned else []
    opt = torch.optim.Adam(groups, lr=0.01)
    losses = []
    for t in range(epochs):
        k = max(1, math.floor(16 / max(1.0, 16 - t * 15 / (epochs - 2))))
        h = x
        for layer in range(2):
            rows = (h * keep(g.num_nodes, h.shape[1], 0.5, 0, t, layer)) @ p[f"layers.{layer}.weight"]
            sent = rows
            if layer == 0 and k < 16:
                z = rows @ pair["enc_w"].T + pair["enc_b"]
                z = torch.cat([z[:, :k], torch.zeros(len(z), 16 - k)], dim=1)
                sent = z @ pair["dec_w"].T + pair["dec_b"]
            h = torch.sparse.mm(a_own, rows) + torch.sparse.mm(a_cut, sent) + p[f"layers.{layer}.bias"]
            h = torch.relu(h) if layer == 0 else h
        losses.append(adam_step(opt, F.cross_entropy(h[train], y[train])))
    return losses


@pytest.mark.mpi
def test_learned_pair_only_while_compressing(shards, tmp_path):
    (tmp_path / "run.toml").write_text(RUN)
    for name, text in SCHEDULES.items():
        (tmp_path / f"{name}.toml").write_text(text)
    shard_dir = shards(GRAPH, 2, "random")
    proc = run_mpi(2, [str(TRAIN_SCHEDULES), str(shard_dir), str(tmp_path), *SCHEDULES],
                   timeout=240)
    check_ok(proc)
    m = {name: read_metrics(tmp_path / name) for name in SCHEDULES}
    # against the whole-graph computation, from a 1-rank run's initial weights
    from hpcgnn.data.shard import read_shard
    init = initial_params(shards(GRAPH, 1), config=str(tmp_path / "run.toml"))
    parts = torch.zeros(3000, dtype=torch.int64)
    parts[torch.from_numpy(read_shard(shard_dir / "part-00001.h5").global_id)] = 1
    for name, learned in (("truncate", False), ("learned", True)):
        got = [r["loss"] for r in m[name]]
        assert len(got) == 6 and got == pytest.approx(varco_losses(parts, init, learned),
                                                      rel=2e-5), name
    assert [r["loss"] for r in m["learned"]][1:4] != pytest.approx(
        [r["loss"] for r in m["truncate"]][1:4], rel=1e-4)              # the pair changed it
    keys = ("loss", "train_acc", "val_acc", "test_acc", "bytes_sent")
    assert [[r[k] for k in keys] for r in m["learned-ratio1"]] == \
        [[r[k] for k in keys] for r in m["full"]]                      # bit for bit
    assert m["learned"][0]["loss"] == m["truncate"][0]["loss"]         # same start, same step 0
    assert m["learned"][0]["bytes_sent"] == m["truncate"][0]["bytes_sent"]
    state = torch.load(tmp_path / "learned" / "checkpoint.pt", weights_only=True)["model"]
    enc = state["layers.0.encoder.weight"]
    assert not torch.equal(enc, torch.eye(enc.shape[0]))               # it trained while k < F
    assert "layers.1.encoder.weight" not in state                       # last layer: none
