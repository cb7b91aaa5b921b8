"""hpcgnn's layers against the published ones: PyTorch Geometric's ``GCNConv``, ``SAGEConv``
(mean) and ``GATConv`` with the same weights, on a small directed graph with uneven in-degrees
(a hub), self-loops and duplicate edges in the input, nodes that only send, and isolated
nodes. The whole-graph model (the trainer's own build, one rank) gives PyG's logits in
evaluation and PyG's gradients of the mean training loss, with and without dropout (the
dropout masks are the documented counter-based ones, applied to PyG's inputs and, for GAT,
to its attention coefficients); training on 1 and 3 real ranks gives the per-epoch losses and
accuracies of a PyG model trained here with torch's Adam. Skipped where torch_geometric is
not installed (it is in the ``test`` extra). This file is also the MPI worker.

Where hpcgnn differs from PyG on the raw edge list, by design (docs/formats.md): the input's
self-loops and duplicate edges are dropped on the way in. GCN and GAT add one self-loop per node
themselves, as ``GCNConv`` and ``GATConv`` do, so for them only the duplicates matter; SAGE's
mean is over the in-neighbours other than the node itself, which ``SAGEConv`` on an edge list
holding ``i -> i`` is not (checked below).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pyg = pytest.importorskip("torch_geometric.nn")

from conftest import check_ok, read_metrics, run_mpi, train_here  # noqa: E402

N, FEATURES, CLASSES = 47, 20, 3
LOOPS = (2, 5, 9, 30)            # self-loops in the input
ISOLATED = (43, 44, 45, 46)      # no edge in or out (43 and 45 are training nodes)
SOURCES = (0, 1)                 # send only: in-degree 0
HUB = 3                          # receives from most nodes
EPOCHS = 5


def graph_arrays() -> dict:
    """The npz arrays (row ``i`` of the CSR lists the nodes whose messages reach ``i``)."""
    rng = np.random.default_rng(11)
    dst, src = [], []
    for i in range(2, 43):                    # uneven in-degrees: 1 .. 6, the hub 30
        k = 30 if i == HUB else 1 + (i * 7) % 6
        cand = np.setdiff1d(np.arange(43), [i])
        for j in rng.choice(cand, size=k, replace=False):
            dst.append(i)
            src.append(int(j))
    dst += list(LOOPS) + [7, 7]               # the loops, and 8 -> 7 twice at least: a duplicate
    src += list(LOOPS) + [8, 8]
    dst, src = np.array(dst), np.array(src)
    order = np.lexsort((src, dst))
    dst, src = dst[order], src[order]
    labels = (np.arange(N) * 5 // 3 % CLASSES).astype(np.int64)
    labels[[20, 33]] = -1                     # unlabelled, in the validation and test splits
    idx = rng.permutation([v for v in range(N) if v not in (20, 33)])
    train = np.unique(np.r_[idx[:20], 43, 45])
    rest = np.setdiff1d(idx, train)
    return {"num_nodes": np.int64(N),
            "adj_indptr": np.r_[0, np.cumsum(np.bincount(dst, minlength=N))].astype(np.int64),
            "adj_indices": src.astype(np.int64),
            # 30 % non-zero: the first layer's dropout runs on the non-zeros (other inputs: below)
            "features": (rng.standard_normal((N, FEATURES))
                         * (rng.random((N, FEATURES)) < 0.3)).astype(np.float32),
            "labels": labels, "train_idx": train.astype(np.int64),
            "val_idx": np.sort(np.r_[rest[:10], 20]).astype(np.int64),
            "test_idx": np.sort(np.r_[rest[10:], 33]).astype(np.int64)}


def edge_index(arrays: dict, loops: bool = True) -> torch.Tensor:
    """PyG's ``edge_index`` (row 0 the sources, row 1 the targets: messages flow source ->
    target) of the input's distinct edges, its self-loops kept unless ``loops`` is false."""
    a = arrays
    dst = np.repeat(np.arange(N), np.diff(a["adj_indptr"]))
    keys = np.unique(dst * N + a["adj_indices"])
    dst, src = keys // N, keys % N
    keep = loops | (dst != src)
    return torch.from_numpy(np.stack([src[keep], dst[keep]]))


@pytest.fixture(scope="module")
def graph(tmp_path_factory, shards):
    """(arrays, npz spec, 1-part and 3-part shard sets)."""
    path = tmp_path_factory.mktemp("pyg") / "directed.npz"
    arrays = graph_arrays()
    np.savez(path, **arrays)
    spec = f"npz:{path}"
    ei = edge_index(arrays)
    deg_in = torch.bincount(ei[1], minlength=N)
    deg_out = torch.bincount(ei[0], minlength=N)
    assert all(deg_in[v] == deg_out[v] == 0 for v in ISOLATED)
    assert all(deg_in[v] == 0 < deg_out[v] for v in SOURCES)
    assert deg_in[HUB] > 5 * deg_in.float().median()
    assert not torch.equal(torch.sort(ei[0] * N + ei[1]).values,
                           torch.sort(ei[1] * N + ei[0]).values)             # directed
    return arrays, spec, shards(spec, 1), shards(spec, 3)


# -- the published model, with hpcgnn's parameters ---------------------------------------------

def pyg_layers(arch: str, state: dict, layers: int, heads: int = 1) -> list:
    """PyG convolutions holding ``state`` (an hpcgnn model's ``state_dict``), float32."""
    convs = []
    for i in range(layers):
        w, b = state[f"layers.{i}.weight"], state[f"layers.{i}.bias"]
        last = i == layers - 1
        if arch == "gcn":
            conv = pyg.GCNConv(w.shape[0], w.shape[1])
            conv.lin.weight.data.copy_(w.T)
        elif arch == "sage":
            out = w.shape[1] // 2
            conv = pyg.SAGEConv(w.shape[0], out, aggr="mean", root_weight=True)
            conv.lin_r.weight.data.copy_(w[:, :out].T)            # root (self) weight, no bias
            conv.lin_l.weight.data.copy_(w[:, out:].T)            # neighbours' weight, the bias
            conv.lin_l.bias.data.copy_(b)
            convs.append(conv)
            continue
        else:
            h, c = state[f"layers.{i}.att_src"].shape
            conv = pyg.GATConv(w.shape[0], c, heads=h, concat=not last, negative_slope=0.2,
                               add_self_loops=True)
            gat_lin(conv).weight.data.copy_(w.T)
            conv.att_src.data.copy_(state[f"layers.{i}.att_src"][None])
            conv.att_dst.data.copy_(state[f"layers.{i}.att_dst"][None])
        conv.bias.data.copy_(b)
        convs.append(conv)
    return convs


def gat_lin(conv):
    """``GATConv``'s one linear map: ``lin``; older PyG releases call it ``lin_src`` (the same
    module as ``lin_dst`` for one input)."""
    return conv.lin if hasattr(conv, "lin") else conv.lin_src


def pyg_params(arch: str, convs: list) -> list[list[torch.Tensor]]:
    """Per layer, the gradients' tensors in the order of ``hpcgnn_grads``, PyG's layout."""
    if arch == "gcn":
        return [[c.lin.weight, c.bias] for c in convs]
    if arch == "sage":
        return [[c.lin_r.weight, c.lin_l.weight, c.lin_l.bias] for c in convs]
    return [[gat_lin(c).weight, c.att_src, c.att_dst, c.bias] for c in convs]


def as_hpcgnn(arch: str, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """PyG's gradients of one layer (``pyg_params``'s order) in hpcgnn's layout."""
    if arch == "gcn":
        return [grads[0].T, grads[1]]
    if arch == "sage":
        return [torch.cat([grads[0].T, grads[1].T], dim=1), grads[2]]
    return [grads[0].T, grads[1][0], grads[2][0], grads[3]]


def hpcgnn_names(arch: str, layers: int) -> list[str]:
    per = {"gcn": ("weight", "bias"), "sage": ("weight", "bias"),
           "gat": ("weight", "att_src", "att_dst", "bias")}[arch]
    return [f"layers.{i}.{p}" for i in range(layers) for p in per]


def pyg_forward(arch: str, convs: list, x: torch.Tensor, ei: torch.Tensor, p: float = 0.0,
                seed: int = 0, epoch: int = 0, attn_p: float = 0.0) -> torch.Tensor:
    """The model's logits: every layer's input dropped out with hpcgnn's documented mask
    (counter-based, keyed by seed, epoch, layer, global id, channel; scaled by 1 / (1 - p)),
    ReLU (GAT: ELU) between layers; GAT's attention coefficients dropped with the documented
    edge mask (``attn_p``) through ``GATConv``'s own ``F.dropout`` call."""
    from hpcgnn.nn.dropout import edge_keep_mask, keep_mask
    gid = torch.arange(N)
    h = x
    for i, conv in enumerate(convs):
        if p:
            h = h * keep_mask(gid, h.shape[1], p, seed, epoch, i) / (1 - p)
        if attn_p:
            with attention_mask(conv, ei, edge_keep_mask, attn_p, seed, epoch, i):
                h = conv(h, ei)
        else:
            h = conv(h, ei)
        if i < len(convs) - 1:
            h = F.elu(h) if arch == "gat" else torch.relu(h)
    return h


class attention_mask:
    """``GATConv``'s attention dropout with hpcgnn's edge mask: PyG calls ``F.dropout(alpha)``
    on ``alpha`` ``(E', H)`` for its edges, the input's without self-loops and then one loop
    per node (``remove_self_loops``, ``add_self_loops``); the keep mask of those (dst, src)
    pairs replaces torch's draw."""

    def __init__(self, conv, ei, edge_keep_mask, p, seed, epoch, layer):
        from torch_geometric.utils import add_self_loops, remove_self_loops
        ei, _ = add_self_loops(remove_self_loops(ei)[0], num_nodes=N)
        self.keep = edge_keep_mask(ei[1], ei[0], conv.heads, p, seed, epoch, layer)
        self.p, self.conv = p, conv

    def __enter__(self):
        import torch_geometric.nn.conv.gat_conv as mod
        self.mod, self.saved = mod, mod.F
        keep, p = self.keep, self.p

        class Patched:
            def __getattr__(self, name):
                return getattr(F, name)

            @staticmethod
            def dropout(alpha, p=0.5, training=True):
                assert alpha.shape == keep.shape and p == Patched.p and training
                return alpha * keep / (1 - p)
        Patched.p = p
        mod.F = Patched()
        self.conv.dropout = p

    def __exit__(self, *exc):
        self.mod.F = self.saved
        self.conv.dropout = 0.0


# -- one layer, one process ---------------------------------------------------------------------

SETS = {"gcn": ("model.arch=gcn", "model.hidden=8"),
        "sage": ("model.arch=sage", "model.hidden=8"),
        "gat": ("model.arch=gat", "model.hidden=4", "model.heads=3", "model.out_heads=2")}


def build(shard_dir: Path, run_dir: Path, *sets: str):
    """The trainer of ``hpcgnn train`` on one rank (the pytest process), not started."""
    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.train.build import prepare_trainer
    return prepare_trainer(CommContext.from_world("cpu"), load_config(None, list(sets)),
                           shard_dir, run_dir)


@pytest.mark.parametrize("arch", ["gcn", "sage", "gat"])
@pytest.mark.parametrize("dropout", [0.0, 0.4])
@pytest.mark.parametrize("features", ["sparse", "sparser", "dense"])
def test_model_equals_pyg_forward_and_gradients(arch, dropout, features, graph, tmp_path):
    """Evaluation logits (no dropout) and, in training (dropout on every layer's input, and on
    GAT's attention), the logits and every parameter's gradient of the mean cross-entropy over
    the training nodes. The input's features (30 % non-zero: the dropout runs on the
    non-zeros), a sparser copy (at most ``SPARSE_PRODUCT_DENSITY``: the first layer's CSR
    product) and a dense one (the dense or the fused C product)."""
    from hpcgnn.nn.dropout import SPARSE_PRODUCT_DENSITY
    from hpcgnn.nn.step import Step
    arrays, _, one, _ = graph
    attn = ("model.attn_dropout=0.3",) if arch == "gat" and dropout else ()
    trainer = build(one, tmp_path, *SETS[arch], f"model.dropout={dropout}", *attn,
                    "train.seed=3")
    model, data = trainer.model, trainer.data
    assert torch.equal(data.global_id, torch.arange(N))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    convs = pyg_layers(arch, state, 2)
    ei = edge_index(arrays, loops=arch != "sage")      # SAGE: the documented difference, below
    x = torch.from_numpy(arrays["features"])
    if features == "dense":
        x = x + 0.25
    elif features == "sparser":
        x = x * (torch.arange(N)[:, None] * FEATURES + torch.arange(FEATURES) < 400) * (x.abs() > 1)
    density = float(torch.count_nonzero(x)) / x.numel()
    assert {"sparse": 0.1 < density < 0.5, "dense": density == 1,
            "sparser": 0 < density <= SPARSE_PRODUCT_DENSITY}[features]
    # evaluation
    model.eval()
    for c in convs:
        c.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x, Step(4, False, 3)), pyg_forward(arch, convs, x, ei),
                                   rtol=1e-5, atol=1e-5)
    # training: logits and gradients
    model.train()
    for c in convs:
        c.train()
    train = torch.from_numpy(arrays["train_idx"])
    y = torch.from_numpy(arrays["labels"])
    got = model(x, Step(4, True, 3))
    want = pyg_forward(arch, convs, x, ei, dropout, 3, 4, 0.3 if attn else 0.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    params = dict(model.named_parameters())
    ours = torch.autograd.grad(F.cross_entropy(got[train], y[train]),
                               [params[k] for k in hpcgnn_names(arch, 2)])
    flat = [t for layer in pyg_params(arch, convs) for t in layer]
    theirs = torch.autograd.grad(F.cross_entropy(want[train], y[train]), flat)
    k = len(flat) // 2
    theirs = as_hpcgnn(arch, list(theirs[:k])) + as_hpcgnn(arch, list(theirs[k:]))
    for name, a, b in zip(hpcgnn_names(arch, 2), ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_sage_mean_leaves_out_the_inputs_self_loops(graph, tmp_path):
    """The documented difference: the input's ``i -> i`` is dropped on the way in, so SAGE's
    mean is ``SAGEConv``'s on the edges without self-loops; on the raw edge list (loops kept)
    PyG's mean also takes ``x_i``, and differs exactly at the looped nodes."""
    arrays, _, one, _ = graph
    trainer = build(one, tmp_path, *SETS["sage"], "model.layers=1", "model.dropout=0")
    from hpcgnn.nn.step import Step
    trainer.model.eval()
    state = trainer.model.state_dict()
    conv = pyg_layers("sage", state, 1)[0]
    x = torch.from_numpy(arrays["features"])
    with torch.no_grad():
        got = trainer.model(trainer.data.x, Step(0, False))
        plain = conv(x, edge_index(arrays, loops=False))
        looped = conv(x, edge_index(arrays, loops=True))
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
    differs = (looped - got).abs().amax(dim=1) > 1e-4
    assert differs.nonzero().flatten().tolist() == list(LOOPS)


# -- training on real ranks against a PyG model trained here ------------------------------------

TRAIN_SETS = ("train.lr=0.05", "train.weight_decay=0.01", f"train.epochs={EPOCHS}", "train.seed=5")
RUNS = {   # name -> (arch, --set list, input dropout, attention dropout)
    "gcn": ("gcn", (*SETS["gcn"], "model.dropout=0.3"), 0.3, 0.0),
    "sage": ("sage", (*SETS["sage"], "model.dropout=0.3"), 0.3, 0.0),
    "gat": ("gat", (*SETS["gat"], "model.dropout=0.3", "model.attn_dropout=0.4"), 0.3, 0.4),
    # three layers; the features' halo rows fetched once and kept (receiver-side dropout)
    "gcn-kept": ("gcn", (*SETS["gcn"], "model.layers=3", "model.dropout=0.3",
                         "train.keep_features=true"), 0.3, 0.0),
    "sage-overlap": ("sage", (*SETS["sage"], "model.dropout=0.3", "train.overlap=true"), 0.3, 0.0),
    "gat-kept": ("gat", (*SETS["gat"], "model.dropout=0.3", "model.attn_dropout=0.4",
                         "train.keep_features=true"), 0.3, 0.4),
}


def pyg_training(arch: str, init: dict, arrays: dict, p: float, attn_p: float) -> list[dict]:
    """Per epoch: the loss (mean cross-entropy over the training nodes, before the step) and,
    after the Adam step (weight decay on every parameter), the accuracies over the labelled
    nodes of each split."""
    convs = pyg_layers(arch, init, sum(k.endswith(".bias") for k in init))
    flat = [t for layer in pyg_params(arch, convs) for t in layer]
    opt = torch.optim.Adam(flat, lr=0.05, weight_decay=0.01)
    x, ei = torch.from_numpy(arrays["features"]), edge_index(arrays, loops=arch != "sage")
    y = torch.from_numpy(arrays["labels"])
    splits = {s: torch.from_numpy(arrays[f"{s}_idx"]) for s in ("train", "val", "test")}
    records = []
    for epoch in range(EPOCHS):
        for c in convs:
            c.train()
        tr = splits["train"]
        loss = F.cross_entropy(pyg_forward(arch, convs, x, ei, p, 5, epoch, attn_p)[tr], y[tr])
        opt.zero_grad()
        loss.backward()
        opt.step()
        for c in convs:
            c.eval()
        with torch.no_grad():
            pred = pyg_forward(arch, convs, x, ei).argmax(1)
        rec = {"loss": loss.item()}
        for s, idx in splits.items():
            idx = idx[y[idx] >= 0]
            rec[f"{s}_acc"] = float((pred[idx] == y[idx]).sum()) / len(idx)
        records.append(rec)
    return records


@pytest.mark.mpi
def test_training_on_ranks_equals_pyg(graph, tmp_path):
    """1 rank and 3 real ranks (METIS parts of the directed graph) train the
    PyG model's losses and accuracies, epoch by epoch, for GCN, SAGE and GAT with dropout; GCN
    with three layers and the features' halo rows kept, SAGE with the exchange overlapped."""
    from conftest import initial_params
    arrays, _, one, three = graph
    check_ok(run_mpi(3, [__file__, str(three), str(tmp_path), *RUNS], timeout=300))
    for name, (arch, sets, p, attn_p) in RUNS.items():
        init = initial_params(one, *sets, *TRAIN_SETS)          # a fresh model's parameters
        want = pyg_training(arch, init, arrays, p, attn_p)
        got1 = train_here(one, tmp_path / f"one-{name}", *sets, *TRAIN_SETS, config=None)
        got3 = read_metrics(tmp_path / name)
        for got in (got1, got3):
            assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=2e-5), name
            for s in ("train", "val", "test"):
                assert [r[f"{s}_acc"] for r in got] == pytest.approx(
                    [r[f"{s}_acc"] for r in want], abs=1e-9), (name, s)
        assert all(r["bytes_sent"] > 0 for r in got3)


def worker(shard_dir: str, out: str, *names: str) -> None:
    """One MPI rank: train each named run of ``RUNS``, one after the other."""
    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.train.build import prepare_trainer
    ctx = CommContext.from_world("cpu")
    for name in names:
        trainer = prepare_trainer(ctx, load_config(None, [*RUNS[name][1], *TRAIN_SETS]),
                                  shard_dir, Path(out) / name)
        trainer.start()
        trainer.run()


if __name__ == "__main__":
    worker(*sys.argv[1:])
