"""GAT (``model.arch = "gat"``): the layer against a dense attention matrix written here (and
PyG's ``GATConv`` when installed), on both paths of the attention sums; training on 2, 3 and 4
ranks (uneven METIS parts, dropout and attention dropout on) against 1 rank; a
``truncate``-compressed and a 2-bit ``quant`` run against whole-graph computations written here
(each part sees its halo rows truncated, or as the numpy quantiser of ``test_codecs`` rounds
them), and a ``truncate``, a ``sample`` and a 4-bit ``quant`` forward under a 2-bit ``[backward]`` table
(halo gradients as that quantiser rounds them); ``sample`` with staleness against the dense GAT
keeping its own stale buffer (and a resumed run against the uninterrupted one); ``hpcgnn
predict`` of a GAT run against the dense GAT. Staleness with GAT without ``sample`` is tested in
``test_methods_exact.py`` (against ``_pipegcn.py``). This file is also the MPI
worker (several variants per launch).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from conftest import check_ok, initial_params, read_metrics, run_mpi, train_here

CSBM = "csbm:nodes=799,classes=4,degree=8,features=24,seed=3"   # small (dense references); odd: uneven parts
EPOCHS = 6
NO_DROPOUT = ("model.arch=gat", "model.dropout=0.0", f"train.epochs={EPOCHS}")
TWO_HEADS = (*NO_DROPOUT, "model.heads=2", "model.hidden=4")   # the codec cases' widths
SAMPLE = 'codec = "sample"\nkind = "constant"\nratio = 2.0\ncompress_last_layer = true\n'
VARIANTS = {   # name -> (--set list, schedule text or None)
    "gat": (("model.arch=gat", "model.heads=2", "model.hidden=8", "model.attn_dropout=0.5",
             f"train.epochs={EPOCHS}"), None),
    "gat-deep": (("model.arch=gat", "model.layers=3", "model.heads=3", "model.hidden=6",
                  "model.out_heads=2", "model.attn_dropout=0.3", "train.overlap=true",
                  f"train.epochs={EPOCHS}"), None),
    # layer 0: 24 -> 2 x 4 (exchanges h, width 8: k = 4); layer 1: 8 -> 4 (h, width 4: k = 2)
    "truncate": (TWO_HEADS,
                 'codec = "truncate"\nkind = "constant"\nratio = 2.0\ncompress_last_layer = true\n'),
    # the same widths, every forward row 2-bit (AdaQP's quantiser), gradients fp32
    "quant": (TWO_HEADS,
              'codec = "quant"\nbits = 2\ncompress_last_layer = true\ncompress_backward = false\n'),
    # BNS-GCN: half of every peer block's rows an epoch (the same rows in both layers), the
    # others' edges out of the softmax, no rows/kept scale; attention dropout on
    "sample": ((*TWO_HEADS, "model.attn_dropout=0.5"), SAMPLE),
    "sample-truncate": ((*TWO_HEADS, "model.attn_dropout=0.5"),
                        'codec = "sample+truncate"\nkeep = 0.5\nkind = "constant"\nratio = 2.0\n'
                        'compress_last_layer = true\n'),
    # the kept rows 2-bit (each sender quantises its buffer of kept rows), gradients fp32
    "sample-quant": ((*TWO_HEADS, "model.attn_dropout=0.3"),
                     'codec = "sample+quant"\nbits = 2\nkind = "constant"\nratio = 2.0\n'
                     'compress_last_layer = true\ncompress_backward = false\n'),
    # a channel-selecting forward with a quantised [backward]: the halo gradients of the
    # channels sent go back 2-bit (the receiver's buffer of them, its own key); attention dropout
    "truncate-back2": ((*TWO_HEADS, "model.attn_dropout=0.5"),
                       'codec = "truncate"\nkind = "constant"\nratio = 2.0\n'
                       'compress_last_layer = true\n[backward]\ncodec = "quant"\nbits = 2\n'),
    # a row-selecting forward (BNS-GCN's sample, the rows unscaled) likewise: the kept rows'
    # gradients 2-bit
    "sample-back2": ((*TWO_HEADS, "model.attn_dropout=0.5"),
                     'codec = "sample"\nkind = "constant"\nratio = 2.0\n'
                     'compress_last_layer = true\n[backward]\ncodec = "quant"\nbits = 2\n'),
    # BNS-GCN's sample with PipeGCN's staleness: the stale layer (layer 1) attends over the
    # halo rows of the epoch they were sent at (t - s; t in the warm-up), that epoch's sample
    "stale-sample": ((*TWO_HEADS, "model.attn_dropout=0.5", "train.staleness=1"), SAMPLE),
    "stale-sample-s2": ((*TWO_HEADS, "model.attn_dropout=0.3", "train.staleness=2"), SAMPLE),
    # plain quant: rows 4-bit, their gradients 2-bit ([backward]'s bits)
    "quant4-back2": ((*TWO_HEADS, "model.attn_dropout=0.5"),
                     'codec = "quant"\nbits = 4\ncompress_last_layer = true\n'
                     '[backward]\nbits = 2\n'),
}
RESUME_AT = 3       # "resume:V": V stopped after RESUME_AT epochs (checkpoint), then resumed
LAUNCHES = [(2, ("gat", "truncate", "quant", "sample", "sample-truncate", "quant4-back2",
                 "sample-back2", "stale-sample", "predict:gat")),
            (3, ("gat", "gat-deep", "sample-quant", "truncate-back2", "stale-sample-s2",
                 "resume:stale-sample-s2")), (4, ("gat",))]


# -- an independent GAT: dense attention over the whole graph --------------------------------

def dense_attention(h_dst, h_src, adj, att_src, att_dst):
    """``(N_dst, H, C)``: softmax over the sources of ``LeakyReLU(a_d.h_i + a_s.h_j)``, with
    -inf where ``adj`` (``N_dst x N_src`` bool, self-loops included) has no edge."""
    s = (h_src * att_src).sum(-1)                                  # (N_src, H)
    d = (h_dst * att_dst).sum(-1)                                  # (N_dst, H)
    e = F.leaky_relu(d[:, None, :] + s[None, :, :], 0.2)           # (N_dst, N_src, H)
    alpha = torch.softmax(e.masked_fill(~adj[:, :, None], float("-inf")), dim=1)
    return alpha, torch.einsum("ijh,jhc->ihc", alpha, h_src)


def graph_of(spec: str):
    from hpcgnn.data.datasets import load_dataset
    g = load_dataset(spec)
    a = sp.csr_matrix((np.ones(g.num_edges), g.indices, g.indptr), shape=(g.num_nodes,) * 2)
    adj = torch.from_numpy(a.toarray() > 0) | torch.eye(g.num_nodes, dtype=torch.bool)
    return g, adj


# -- the layer on one process ------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(shards):
    """(graph, dense adjacency with self-loops, a 1-part shard) of a small cSBM graph."""
    from hpcgnn.data.shard import read_shard
    spec = "csbm:nodes=300,classes=3,degree=5,features=10,seed=4"
    g, adj = graph_of(spec)
    return g, adj, read_shard(shards(spec, 1) / "part-00000.h5")


@pytest.fixture(scope="module")
def directed(shards, tmp_path_factory):
    """(npz spec, graph, dense adjacency with self-loops, a 1-part shard) of a directed graph:
    the one-way lattice of ``test_directed.py`` (row ``j`` receives from ``j-1 .. j-3``)."""
    from hpcgnn.data.shard import read_shard
    from test_directed import lattice_arrays
    path = tmp_path_factory.mktemp("directed") / "lattice.npz"
    np.savez(path, **lattice_arrays())
    spec = f"npz:{path}"
    g, adj = graph_of(spec)
    assert not torch.equal(adj, adj.T)
    return spec, g, adj, read_shard(shards(spec, 1) / "part-00000.h5")


def one_rank_layer(shard, in_dim, out_dim, heads, concat, attn_dropout=0.0, epoch=0):
    from hpcgnn.comm.context import CommContext
    from hpcgnn.comm.exchange import ExchangeStats, HaloExchanger
    from hpcgnn.comm.plan import HaloPlan
    from hpcgnn.nn.gat import GATLayer
    from hpcgnn.nn.graph import LocalGraph
    ctx = CommContext.from_world("cpu")
    from hpcgnn.comm.exchange import ExchangeSettings
    from hpcgnn.nn.propagation import HaloPropagation
    from hpcgnn.nn.step import LayerStep
    ex = HaloExchanger(ctx, HaloPlan.from_shard(shard), layer=1, seed=7, stats=ExchangeStats())
    torch.manual_seed(0)
    layer = GATLayer(in_dim, out_dim, LocalGraph.from_shard(shard, "gat"), HaloPropagation(ex),
                     heads=heads, concat=concat, attn_dropout=attn_dropout).double()
    layer.step = LayerStep(epoch, True, 7, 1, ExchangeSettings(epoch))   # seed 7, layer 1
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def grads_of(out, tensors):
    torch.manual_seed(1)
    return torch.autograd.grad((out * torch.randn_like(out)).sum(), tensors)


@pytest.mark.parametrize("graph", ["csbm", "directed"])
@pytest.mark.parametrize("path", ["messages", "spmm"])
@pytest.mark.parametrize("heads,concat,p", [(3, True, 0.0), (2, False, 0.0), (3, True, 0.5)])
def test_layer_equals_dense_attention(graph, heads, concat, p, path, monkeypatch, request):
    """Forward and every gradient; with attention dropout the kept coefficients are those of
    the documented hash of (seed, epoch, layer, dst id, src id, head), scaled by 1/(1-p). Both
    paths of the attention sums: sparse products (the default) and per-edge messages; a
    symmetric graph and a directed one."""
    from hpcgnn.nn.dropout import edge_keep_mask
    monkeypatch.setenv("HPCGNN_GAT_SPMM", "1" if path == "spmm" else "0")
    g, adj, shard = (request.getfixturevalue("small") if graph == "csbm"
                     else request.getfixturevalue("directed")[1:])
    layer = one_rank_layer(shard, g.feature_dim, 5, heads, concat, attn_dropout=p, epoch=3)
    assert (layer.pattern is not None) == (path == "spmm")
    x = torch.from_numpy(g.dense_features()).double().requires_grad_(True)
    params = [x, layer.weight, layer.att_src, layer.att_dst, layer.bias]
    got = layer(x, layer.step)
    n = g.num_nodes
    h = (x @ layer.weight).view(n, heads, 5)
    alpha, _ = dense_attention(h, h, adj, layer.att_src, layer.att_dst)
    if p:
        i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        keep = edge_keep_mask(i.reshape(-1), j.reshape(-1), heads, p, 7, 3, 1).view(n, n, heads)
        alpha = alpha * keep / (1 - p)
    out = torch.einsum("ijh,jhc->ihc", alpha, h)
    want = (out.reshape(n, -1) if concat else out.mean(1)) + layer.bias
    assert got.shape == want.shape == (n, heads * 5 if concat else 5)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads_of(got, params), grads_of(want, params)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("heads,concat", [(3, True), (2, False)])
def test_layer_equals_pyg_gatconv(small, heads, concat):
    pyg = pytest.importorskip("torch_geometric.nn")
    g, _, shard = small
    layer = one_rank_layer(shard, g.feature_dim, 4, heads, concat)
    conv = pyg.GATConv(g.feature_dim, 4, heads=heads, concat=concat, negative_slope=0.2,
                       dropout=0.0, add_self_loops=True).double()
    with torch.no_grad():
        conv.lin.weight.copy_(layer.weight.T)
        conv.att_src.copy_(layer.att_src[None])
        conv.att_dst.copy_(layer.att_dst[None])
        conv.bias.copy_(layer.bias)
    edge_index = torch.from_numpy(np.stack([g.indices, np.repeat(np.arange(g.num_nodes),
                                                                 np.diff(g.indptr))]))
    x = torch.from_numpy(g.dense_features()).double().requires_grad_(True)
    got, want = layer(x, layer.step), conv(x, edge_index)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    ours = grads_of(got, [x, layer.weight, layer.att_src, layer.att_dst, layer.bias])
    theirs = grads_of(want, [x, conv.lin.weight, conv.att_src, conv.att_dst, conv.bias])
    for a, b in zip(ours, [theirs[0], theirs[1].T, theirs[2][0], theirs[3][0], theirs[4]]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attention_sums_on_cuda_equal_the_messages(dtype):
    """``AttentionSum`` on CUDA (cuSPARSE SpMM and SDDMM) against ``sum_j alpha_ij h_j`` over
    materialised messages, written here, forward and both gradients; a random graph with rows
    of no in-edge but their self-loop, more source rows than destinations (halo columns)."""
    from hpcgnn.nn.gat import AttentionPattern, AttentionSum
    gen = torch.Generator().manual_seed(5)
    n, m, heads, c = 600, 900, 3, 5
    a = sp.random(n, m, density=0.01, format="csr", random_state=5) + sp.eye(n, m, format="csr")
    a = a.tocoo()
    key = np.lexsort((a.col, a.row))                         # CSR order: by dst, then src
    dst, src = (torch.from_numpy(v[key].astype(np.int64)) for v in (a.row, a.col))
    alpha = torch.rand(dst.shape[0], heads, generator=gen, dtype=torch.float64)
    h = torch.randn(m, heads, c, generator=gen, dtype=torch.float64)
    g = torch.randn(n, heads, c, generator=gen, dtype=torch.float64)
    want_alpha, want_h = alpha.clone().requires_grad_(True), h.clone().requires_grad_(True)
    want = torch.zeros(n, heads, c, dtype=torch.float64).index_add_(
        0, dst, want_alpha[:, :, None] * want_h[src])
    want.backward(g)
    cuda = torch.device("cuda")
    got_alpha = alpha.to(cuda, dtype).requires_grad_(True)
    got_h = h.to(cuda, dtype).requires_grad_(True)
    got = AttentionSum.apply(got_alpha, got_h, AttentionPattern(dst.to(cuda), src.to(cuda), n, m))
    got.backward(g.to(cuda, dtype))
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    for a_, b_ in ((got, want), (got_alpha.grad, want_alpha.grad), (got_h.grad, want_h.grad)):
        torch.testing.assert_close(a_.cpu().double(), b_.detach(), **tol)


def test_edge_mask_depends_only_on_ids():
    from hpcgnn.nn.dropout import edge_keep_mask
    dst, src = torch.randint(0, 10**6, (20000,)), torch.randint(0, 10**6, (20000,))
    full = edge_keep_mask(dst, src, 4, 0.6, seed=1, epoch=2, layer=0)
    perm = torch.randperm(20000)[:3000]
    assert torch.equal(edge_keep_mask(dst[perm], src[perm], 4, 0.6, 1, 2, 0), full[perm])
    assert abs(full.float().mean().item() - 0.4) < 0.01
    swapped = edge_keep_mask(src, dst, 4, 0.6, 1, 2, 0)              # j -> i is another edge
    for other in (swapped, edge_keep_mask(dst, src, 4, 0.6, 1, 3, 0), full[:, [1, 2, 3, 0]]):
        assert 0.45 < (other == full).float().mean().item() < 0.59  # independent: 0.4^2 + 0.6^2


def test_resume_check_takes_keys_added_since_as_defaults():
    """A checkpoint written before ``model.heads`` existed resumes a GCN run (same config)."""
    from hpcgnn.config import load_config
    from hpcgnn.train.records import differences
    now = {"config": load_config(None).to_dict(), "schedule": None, "meta_sha256": "x"}
    old = {**now, "config": {**now["config"], "model": {"arch": "gcn", "hidden": 16, "layers": 2,
                                                        "dropout": 0.5}}}
    assert differences(old, now) == []
    gat = {**now, "config": load_config(None, ["model.arch=gat", "model.heads=4"]).to_dict()}
    assert differences(old, gat) == ["model.arch: checkpoint 'gcn', now 'gat'",
                                     "model.heads: checkpoint 1, now 4"]


def test_sample_codec_with_smoothed_staleness_is_refused(shards, tmp_path):
    """``sample`` with staleness and smoothing is refused at start-up, before any exchange (a
    smoothed halo row averages several epochs' samples); with staleness alone, and without
    staleness, it builds."""
    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.schedule import load_schedule
    from hpcgnn.train.build import prepare_trainer
    sched = load_schedule("configs/schedules/sample-all.toml")
    with pytest.raises(ValueError, match="codec = 'sample' is not allowed; layer 1: the "
                                         "schedule's 'sample' stage .*train.staleness = 1 .*"
                                         "train.smoothing = 0.5 averages .*"
                                         "Use train.smoothing = 0 with sample"):
        prepare_trainer(CommContext.from_world("cpu"),
                        load_config(None, ["model.arch=gat", "train.staleness=1",
                                           "train.smoothing=0.5"]),
                        shards(CSBM, 1), tmp_path / "smooth", sched)
    for sets, out in ((["model.arch=gat", "train.staleness=1"], "stale"),
                      (["model.arch=gat"], "sync")):
        prepare_trainer(CommContext.from_world("cpu"), load_config(None, sets),
                        shards(CSBM, 1), tmp_path / out, sched)


def test_config_checks():
    from hpcgnn.config import ConfigError, load_config
    cfg = load_config("configs/cora-gat.toml")
    assert (cfg.model.arch, cfg.model.heads, cfg.model.hidden, cfg.model.attn_dropout) == ("gat", 8, 8, 0.6)
    with pytest.raises(ConfigError, match=r"model.heads = 4 .*'gat' only"):
        load_config(None, ["model.heads=4"])
    with pytest.raises(ConfigError, match=r"parallel.algorithm = '1.5d'.*fixed adjacency.*'halo'"):
        load_config("configs/cora-gat.toml", ["parallel.algorithm=1.5d", "parallel.replication=2"])
    with pytest.raises(ConfigError, match=r"model.attn_dropout = 1.0"):
        load_config(None, ["model.arch=gat", "model.attn_dropout=1.0"])
    # one layer is the last: its heads are out_heads, and model.heads would change nothing
    with pytest.raises(ConfigError, match=r"model.heads = 8 .*model.layers = 1.*model.out_heads"):
        load_config(None, ["model.arch=gat", "model.layers=1", "model.heads=8"])
    assert load_config(None, ["model.arch=gat", "model.layers=1", "model.out_heads=8"]).model.out_heads == 8


# -- real ranks against 1 rank and against whole-graph computations ---------------------------

@pytest.fixture(scope="module")
def one_rank(shards, tmp_path_factory):
    """Per variant: the 1-rank metrics (trained in this process) and initial parameters."""
    cache: dict = {}

    def get(variant: str):
        if variant not in cache:
            sets, sched = VARIANTS[variant]
            state = initial_params(shards(CSBM, 1), *sets)
            out = tmp_path_factory.mktemp("ref")
            metrics = train_here(shards(CSBM, 1), out, *sets, config=None)   # 1 rank: no halo
            cache[variant] = (metrics, state)
        return cache[variant]

    return get


def part_of(shard_dir: Path, ranks: int) -> torch.Tensor:
    from hpcgnn.data.shard import read_meta, read_shard
    parts = np.zeros(read_meta(shard_dir)["num_nodes"], dtype=np.int64)
    for r in range(ranks):
        parts[read_shard(shard_dir / f"part-{r:05d}.h5").global_id] = r
    return torch.from_numpy(parts)


def whole_graph_losses(init: dict, parts: torch.Tensor, heads: int, hidden: int, seen,
                       spec: str = CSBM, attn_dropout: float = 0.0,
                       params: dict | None = None) -> list[float]:
    """2-layer GAT, no input dropout, Adam (lr 0.01, wd 5e-4), mean CE on the training nodes.
    ``seen(layer, h, q, t)``: the source rows ``(N, H, C)`` the rows of part ``q`` attend to at
    epoch ``t`` (those of other parts are halo rows); ``seen.sources(q, t, layer)``, where
    defined: bool ``(N,)``, the nodes whose edges into part ``q`` exist at epoch ``t`` (the
    others' are removed from the graph); ``seen.inputs(layer, h_in, q, t)``, where defined: the
    layer's input rows ``(N, F)`` part ``q`` transforms (its own rows are ``h_in``'s; a stale
    layer's halo rows), else ``h_in``; ``after(t)`` runs after backward. ``attn_dropout``: the attention
    coefficients dropped with the mask of the layer test above (seed 0). ``params``: a dict to
    fill with the trained parameters."""
    from hpcgnn.nn.dropout import edge_keep_mask
    g, adj = graph_of(spec)
    x, y = torch.from_numpy(g.dense_features()), torch.from_numpy(g.labels)
    p = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = torch.optim.Adam(p.values(), lr=0.01, weight_decay=5e-4)
    shapes = [(heads, hidden), (1, int(g.labels.max()) + 1)]
    sources, inputs = getattr(seen, "sources", None), getattr(seen, "inputs", None)
    ids = torch.arange(g.num_nodes)
    losses = []
    for t in range(EPOCHS):
        h_in = x
        for i, (nh, c) in enumerate(shapes):
            w = p[f"layers.{i}.weight"]
            h = (h_in @ w).view(-1, nh, c)
            out = torch.zeros(g.num_nodes, nh, c)
            for q in range(int(parts.max()) + 1):
                rows = parts == q
                a = adj[rows] if sources is None else adj[rows] & sources(q, t, i)[None, :]
                if inputs is not None:
                    h = (inputs(i, h_in, q, t) @ w).view(-1, nh, c)
                src = seen(i, h, q, t)
                alpha, _ = dense_attention(h[rows], src, a, p[f"layers.{i}.att_src"],
                                           p[f"layers.{i}.att_dst"])
                if attn_dropout:
                    dst, j = torch.meshgrid(ids[rows], ids, indexing="ij")
                    keep = edge_keep_mask(dst.reshape(-1), j.reshape(-1), nh, attn_dropout, 0, t, i)
                    alpha = alpha * keep.view(*a.shape, nh) / (1 - attn_dropout)
                out[rows] = torch.einsum("ijh,jhc->ihc", alpha, src)
            h_in = (out.flatten(1) if i == 0 else out.mean(1)) + p[f"layers.{i}.bias"]
            h_in = F.elu(h_in) if i == 0 else h_in
        loss = F.cross_entropy(h_in[g.train_idx], y[g.train_idx])
        opt.zero_grad()
        loss.backward()
        seen.after(t)
        opt.step()
        losses.append(loss.item())
    if params is not None:
        params.update({k: v.detach() for k, v in p.items()})
    return losses


class Truncated:
    """Halo rows of ``h`` keep their first ``k = width // 2`` channels (truncate, ratio 2); the
    adjoint backward follows from autograd of exactly this forward."""

    def __init__(self, parts):
        self.parts = parts

    def __call__(self, layer, h, q, t):
        k = h.shape[1] * h.shape[2] // 2
        flat = h.flatten(1)
        cut = torch.cat([flat[:, :k], torch.zeros_like(flat[:, k:])], dim=1).view_as(h)
        return torch.where((self.parts == q)[:, None, None], h, cut)

    def after(self, t):
        pass


class Quantised:
    """Halo rows of ``h`` as the documented quantiser delivers them (``test_codecs.ref_quant``
    on each sender's send buffer, ``test_methods_exact.quantised_rows``): the attention logit
    and the message of a halo source both from the decoded row. The backward takes the rounding
    as the identity (fp32 gradients, ``compress_backward = false``)."""

    def __init__(self, parts, shard_dir, ranks, bits: int = 2):
        from test_methods_exact import quantised_rows
        self.parts, self.received = parts, quantised_rows(shard_dir, ranks, bits)[0]

    def __call__(self, layer, h, q, t):
        flat = h.flatten(1)
        return flat.add((self.received(layer, t, flat, q) - flat).detach()).view_as(h)

    def after(self, t):
        pass


class BackQuantised:
    """A synchronous forward ``seen`` (``Truncated``, ``Quantised``, ``Sampled``) under a
    quantised ``[backward]`` table: part ``q``'s halo rows arrive as ``seen`` delivers them
    (``Sampled``: its ``sources`` too), and the gradient of the halo rows sent (every one, or
    ``seen.sent(q, t)``'s kept rows, unscaled) of the ``k = max(1, floor(H C / ratio))``
    channels sent goes back to their owners rounded by ``test_codecs.ref_quant`` as ``q``'s one
    buffer of them (halo blocks in order, a block's rows ascending) with the noise key
    ``mix(0, t, layer, 1, q)``, the other rows' and channels' gradients nothing: what the numpy
    codec returns, not autograd of the forward."""

    def __init__(self, seen, parts, shard_dir, ranks, bits: int, ratio: float = 1.0):
        from hpcgnn.data.shard import read_shard
        self.seen, self.parts, self.bits, self.ratio = seen, parts, bits, ratio
        self.halo = [read_shard(shard_dir / f"part-{r:05d}.h5").halo_global_id
                     for r in range(ranks)]
        if hasattr(seen, "sources"):
            self.sources = seen.sources

    def returned(self, layer: int, t: int, grad: torch.Tensor, q: int) -> torch.Tensor:
        from test_codecs import ref_quant
        from test_exchange_exact import mix
        sent = getattr(self.seen, "sent", None)
        gid = torch.from_numpy(sent(q, t) if sent else self.halo[q])
        k = max(1, int(grad.shape[1] / self.ratio + 1e-9))
        out = torch.zeros_like(grad)
        if len(gid):
            out[gid, :k] = torch.from_numpy(ref_quant(grad[gid, :k].numpy(), self.bits,
                                                      mix(0, t, layer, 1, q)))
        return out

    def __call__(self, layer, h, q, t):
        from _pipegcn import Sent
        flat = h.flatten(1)
        rows = self.seen(layer, h.detach(), q, t).flatten(1)
        sent = Sent.apply(flat, rows, lambda grad: self.returned(layer, t, grad, q))
        return torch.where((self.parts == q)[:, None], flat, sent).view_as(h)

    def after(self, t):
        pass


class Sampled:
    """BNS-GCN's boundary sampling as GAT runs it (its reference code runs GAT on the epoch's
    sampled graph): at epoch ``t`` part ``q`` receives, of each peer ``p``'s block, the
    ``ceil(rows / 2)`` rows of smallest score under the block's row key (the documented hash,
    in numpy: ``test_methods_exact._block_keys``, ``test_codecs.ref_kept_rows``), the same in
    both layers; the edges from the other halo nodes into ``q`` are removed (``sources``), and
    the kept rows arrive as they are (no ``rows / kept`` scale). ``truncate``: they keep their
    first half of the channels; ``bits``: each sender quantises its buffer of kept rows (its
    blocks in peer order) with the noise key ``mix(0, t, layer, 0, p)``, the gradient taking
    the rounding as the identity. Autograd of this forward is the backward: only the kept rows'
    gradients reach their owners."""

    def __init__(self, parts, shard_dir, ranks, truncate: bool = False, bits: int = 0):
        from hpcgnn.data.shard import read_shard
        from test_methods_exact import _block_keys
        from test_codecs import ref_kept_rows
        self.parts, self.truncate, self.bits = parts, truncate, bits
        self.shards = [read_shard(shard_dir / f"part-{r:05d}.h5") for r in range(ranks)]
        self.kept: dict[tuple, list[int]] = {}      # (src, dst, t) -> kept rows of the block
        for t in range(EPOCHS):
            for q, sq in enumerate(self.shards):
                for src, rows in enumerate(sq.recv_counts.tolist()):
                    self.kept[src, q, t] = ref_kept_rows(_block_keys(0, 0, src, q, t)[0], rows, 0.5)

    def _halo(self, q: int, src: int) -> np.ndarray:
        """Global ids of part ``q``'s halo block from ``src``, in order."""
        counts = self.shards[q].recv_counts
        start = int(counts[:src].sum())
        return self.shards[q].halo_global_id[start:start + int(counts[src])]

    def sent(self, q: int, t: int) -> np.ndarray:
        """Global ids of the halo rows part ``q`` is sent at epoch ``t``: its blocks in order,
        each block's kept rows ascending."""
        return np.concatenate([self._halo(q, src)[self.kept[src, q, t]]
                               for src in range(len(self.shards))])

    def sources(self, q: int, t: int, layer: int = 0) -> torch.Tensor:
        ok = (self.parts == q).clone()
        ok[torch.from_numpy(self.sent(q, t))] = True
        return ok

    def __call__(self, layer, h, q, t):
        flat = h.flatten(1)
        rows = flat.clone()
        if self.bits:
            from test_codecs import ref_quant
            from test_exchange_exact import mix
            for src, sp_ in enumerate(self.shards):
                if src == q or not sp_.send_counts[q]:
                    continue
                # sender src's buffer: the kept rows of its blocks, peer by peer
                picks = [self._halo(d, src)[self.kept[src, d, t]] for d in range(len(self.shards))]
                buf = flat.detach()[torch.from_numpy(np.concatenate(picks))].numpy()
                deq = torch.from_numpy(ref_quant(buf, self.bits, mix(0, t, layer, 0, src)))
                off = sum(len(k) for k in picks[:q])
                gid = torch.from_numpy(picks[q])
                rows[gid] = flat[gid] + (deq[off:off + len(gid)] - flat[gid]).detach()
        if self.truncate:
            k = flat.shape[1] // 2
            halo = (self.parts != q)[:, None] & (torch.arange(flat.shape[1]) >= k)[None, :]
            rows = rows.masked_fill(halo, 0.0)
        return rows.view_as(h)

    def after(self, t):
        pass


class StaleSampled(Sampled):
    """BNS-GCN's ``sample`` under PipeGCN's staleness ``s``, as GAT composes them: the first
    layer runs on the features' halo rows, fetched once and kept (every edge, nothing
    sampled); layer 1 of part ``q`` at epoch ``t`` transforms, with the current weights, the
    halo rows of its input posted at ``t - s`` (at ``t < s``, those of ``t``, synchronously),
    and attends only over the halo rows that epoch's sample sent (``sent_at(t)``; a test
    passes another epoch to see it fail), unscaled. The gradient of part ``q``'s stale halo
    rows at ``t``, of the rows sent alone, is added into their owners' input gradient at
    ``t + s``: PipeGCN's buffers, kept here."""

    def __init__(self, parts, shard_dir, ranks, s: int, sent_at=None):
        super().__init__(parts, shard_dir, ranks)
        self.s = s
        self.sent_at = sent_at or (lambda t: t if t < s else t - s)
        self.posted: dict[int, torch.Tensor] = {}     # epoch -> layer 1's input it posted
        self.late: dict[int, torch.Tensor] = {}       # epoch -> halo gradients it posted
        self.leaves: dict[int, torch.Tensor] = {}     # part -> its stale halo rows this epoch

    def sources(self, q: int, t: int, layer: int = 0) -> torch.Tensor:
        if layer == 0:
            return torch.ones_like(self.parts, dtype=torch.bool)
        return super().sources(q, self.sent_at(t))

    def inputs(self, layer, h_in, q, t):
        if layer == 0:
            return h_in
        if q == 0:                                        # the epoch's posts and late gradients
            self.posted[t], self.leaves = h_in.detach().clone(), {}
            back = self.late.pop(t - self.s, None)
            if back is not None:
                h_in.register_hook(lambda grad: grad + back)
        if t < self.s:
            return h_in
        self.leaves[q] = leaf = self.posted[t - self.s].clone().requires_grad_(True)
        return torch.where((self.parts == q)[:, None], h_in, leaf)

    def after(self, t):
        late = 0
        for q, leaf in self.leaves.items():
            sent = torch.zeros_like(self.parts, dtype=torch.bool)
            sent[torch.from_numpy(self.sent(q, t - self.s))] = True
            late = late + leaf.grad * sent[:, None]
        if self.leaves:
            self.late[t] = late


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,variants", LAUNCHES, ids=[f"{r}-ranks" for r, _ in LAUNCHES])
def test_gat_on_ranks(ranks, variants, shards, one_rank, tmp_path):
    """Uneven METIS parts: uncompressed training equals 1 rank; ``truncate`` equals the
    whole-graph computation with truncated halo rows (and every codec variant its own, above);
    ``resume:V`` equals ``V``; ``hpcgnn predict`` equals the dense GAT.
    (Staleness with GAT: ``tests/test_methods_exact.py``, against ``_pipegcn.py``.)"""
    shard_dir = shards(CSBM, ranks, "metis")
    proc = run_mpi(ranks, [__file__, str(shard_dir), str(tmp_path), *variants], timeout=240)
    check_ok(proc)
    parts = part_of(shard_dir, ranks)
    assert len(set(torch.bincount(parts).tolist())) > 1                 # uneven parts
    for variant in variants:
        if variant.startswith("predict:"):
            check_predictions(tmp_path / variant, tmp_path / variant.split(":")[1])
            continue
        if variant.startswith("resume:"):      # the same losses as the run not interrupted
            assert f"stopped after {RESUME_AT} epochs" in proc.stderr, proc.stderr
            assert [r["loss"] for r in read_metrics(tmp_path / variant)] == \
                [r["loss"] for r in read_metrics(tmp_path / variant.split(":")[1])]
            continue
        got = read_metrics(tmp_path / variant)
        want, init = one_rank(variant)
        losses = [r["loss"] for r in got]
        assert len(losses) == EPOCHS and losses[-1] < losses[0], variant
        if variant == "truncate":
            assert losses == pytest.approx(whole_graph_losses(init, parts, 2, 4, Truncated(parts)),
                                           rel=2e-5)
            assert all(r["bytes_sent"] * 2 == r["bytes_full"] > 0 for r in got)
            assert losses[1:] != pytest.approx([r["loss"] for r in want][1:], rel=1e-4)
        elif variant == "quant":
            assert losses == pytest.approx(whole_graph_losses(
                init, parts, 2, 4, Quantised(parts, shard_dir, ranks)), rel=2e-5)
            assert losses[1:] != pytest.approx([r["loss"] for r in want][1:], rel=1e-4)
        elif variant.endswith("-back2"):
            check_back_quantised(variant, got, init, parts, shard_dir, ranks, tmp_path / variant)
        elif variant.startswith("sample"):
            check_sampled(variant, got, want, init, parts, shard_dir, ranks)
        elif variant.startswith("stale-sample"):
            check_stale_sampled(variant, got, init, parts, shard_dir, ranks)
        else:
            assert losses == pytest.approx([r["loss"] for r in want], rel=1e-5), variant
            assert [r["val_acc"] for r in got] == pytest.approx([r["val_acc"] for r in want], abs=2e-3)
            assert all(r["bytes_sent"] == r["bytes_full"] > 0 for r in got)


def check_sampled(variant: str, got: list[dict], want: list[dict], init: dict, parts, shard_dir,
                  ranks: int, spec: str = CSBM) -> None:
    """A ``sample`` variant's losses equal the whole-graph GAT on each epoch's sampled graph
    (``Sampled``), and not the uncompressed run's; the bytes are the kept rows' alone."""
    sets = dict(s.split("=") for s in VARIANTS[variant][0])
    ref = Sampled(parts, shard_dir, ranks, truncate="truncate" in variant,
                  bits=2 if "quant" in variant else 0)
    losses = [r["loss"] for r in got]
    assert losses == pytest.approx(whole_graph_losses(
        init, parts, 2, 4, ref, spec, float(sets["model.attn_dropout"])), rel=1e-5), variant
    assert losses[1:] != pytest.approx([r["loss"] for r in want][1:], rel=1e-4)
    assert all(0 < r["bytes_sent"] < r["bytes_full"] for r in got), variant


def check_stale_sampled(variant: str, got: list[dict], init: dict, parts, shard_dir, ranks: int,
                        spec: str = CSBM) -> None:
    """A ``sample`` run with staleness: its losses equal the whole-graph GAT that keeps its own
    stale buffer and attends over each epoch's rows with the sample they were sent with
    (``StaleSampled``), and not the one masking them with the current epoch's sample (the
    epochs from ``s`` on, where the two differ)."""
    sets = dict(s.split("=") for s in VARIANTS[variant][0])
    s, attn = int(sets["train.staleness"]), float(sets["model.attn_dropout"])
    losses = [r["loss"] for r in got]
    assert losses == pytest.approx(whole_graph_losses(
        init, parts, 2, 4, StaleSampled(parts, shard_dir, ranks, s), spec, attn), rel=1e-5), variant
    wrong = whole_graph_losses(init, parts, 2, 4, StaleSampled(parts, shard_dir, ranks, s,
                                                               sent_at=lambda t: t), spec, attn)
    assert losses[s:] != pytest.approx(wrong[s:], rel=1e-4), variant
    assert all(0 < r["bytes_sent"] < r["bytes_full"] for r in got[1:]), variant


def check_back_quantised(variant: str, got: list[dict], init: dict, parts, shard_dir,
                         ranks: int, run_dir: Path) -> None:
    """A run with a quantised ``[backward]`` table: its losses and final parameters equal the
    whole-graph GAT whose halo rows are the forward codec's and whose halo gradients the numpy
    quantiser rounds (``BackQuantised``); the parameters differ from those of fp32 gradients."""
    sets = dict(s.split("=") for s in VARIANTS[variant][0])
    truncate = variant.startswith("truncate")

    def forward():
        if variant.startswith("sample"):
            return Sampled(parts, shard_dir, ranks)
        return Truncated(parts) if truncate else Quantised(parts, shard_dir, ranks, bits=4)
    ref = BackQuantised(forward(), parts, shard_dir, ranks, 2, ratio=2.0 if truncate else 1.0)
    want, fp32 = {}, {}
    losses = [r["loss"] for r in got]
    attn = float(sets["model.attn_dropout"])
    assert losses == pytest.approx(whole_graph_losses(init, parts, 2, 4, ref, CSBM, attn,
                                                      params=want), rel=1e-5), variant
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5)
    whole_graph_losses(init, parts, 2, 4, forward(), CSBM, attn, params=fp32)
    assert max((state[k] - v).abs().max().item() for k, v in fp32.items()) > 1e-3, variant
    assert all(0 < r["bytes_sent"] < r["bytes_full"] for r in got), variant


@pytest.mark.mpi
def test_gat_on_a_directed_graph_equals_one_rank(directed, shards, tmp_path):
    """The one-way lattice on 3 ranks (METIS parts, not symmetrised: a part receives halo rows
    from a peer it sends nothing to) gives the 1-rank losses, dropout and attention dropout on;
    with BNS-GCN's ``sample`` (the backward's peers are not the forward's), the whole-graph GAT
    on each epoch's sampled graph, and with staleness 2 as well, ``StaleSampled``."""
    from hpcgnn.train.checkpoint import CHECKPOINT_NAME
    from test_directed import assert_one_way, lattice_arrays, owners
    spec = directed[0]
    assert_one_way(lattice_arrays(), owners(shards(spec, 3), 3, directed[1].num_nodes), 3)
    check_ok(run_mpi(3, [__file__, str(shards(spec, 3)), str(tmp_path), "gat", "sample",
                         "stale-sample-s2"], timeout=240))
    want = train_here(shards(spec, 1), tmp_path / "one", *VARIANTS["gat"][0], config=None)
    got = read_metrics(tmp_path / "gat")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    assert all(r["bytes_sent"] == r["bytes_full"] > 0 for r in got)
    sets = VARIANTS["sample"][0]
    train_here(shards(spec, 1), tmp_path / "init", *sets, "train.epochs=1", "train.lr=1e-30",
               config=None)
    init = torch.load(tmp_path / "init" / CHECKPOINT_NAME, weights_only=True)["model"]
    want = train_here(shards(spec, 1), tmp_path / "one-sample", *sets, config=None)
    parts = part_of(shards(spec, 3), 3)
    check_sampled("sample", read_metrics(tmp_path / "sample"), want, init, parts, shards(spec, 3),
                  3, spec)
    check_stale_sampled("stale-sample-s2", read_metrics(tmp_path / "stale-sample-s2"), init,
                        parts, shards(spec, 3), 3, spec)


def check_predictions(pred_dir: Path, run_dir: Path) -> None:
    """``hpcgnn predict`` of a GAT run: logits and embedding (the ELU output of layer 0) equal
    the dense whole-graph GAT with the checkpoint's weights, no dropout."""
    from hpcgnn.predict import read_predictions
    got = read_predictions(pred_dir)
    p = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    g, adj = graph_of(CSBM)
    x = torch.from_numpy(g.dense_features())                # (no data.normalize_features)
    h = (x @ p["layers.0.weight"]).view(g.num_nodes, 2, 8)
    hidden = F.elu(dense_attention(h, h, adj, p["layers.0.att_src"], p["layers.0.att_dst"])[1]
                   .flatten(1) + p["layers.0.bias"])
    h = (hidden @ p["layers.1.weight"]).view(g.num_nodes, 1, -1)
    logits = dense_attention(h, h, adj, p["layers.1.att_src"], p["layers.1.att_dst"])[1].mean(1) \
        + p["layers.1.bias"]
    assert got["embedding"].shape == (g.num_nodes, 16) and got["embedding"].min() > -1
    np.testing.assert_allclose(got["embedding"], hidden.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["logits"], logits.numpy(), rtol=1e-4, atol=1e-5)


def _worker(shard_dir: str, out: str, variants: list[str]) -> None:
    """Run on every rank: train each variant in turn into OUT/<variant>."""
    from hpcgnn.codecs.base import FULL_PRECISION
    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.log import setup_logging
    from hpcgnn.schedule import load_schedule
    from hpcgnn.train.build import prepare_trainer
    ctx = CommContext.from_world("cpu")
    setup_logging(ctx.rank, ctx.size)
    for variant in variants:
        if variant.startswith("predict:"):                 # hpcgnn predict of a run above
            from argparse import Namespace

            from hpcgnn.predict import build_predictor
            run = Path(out) / variant.split(":")[1]
            build_predictor(ctx, Namespace(run=run, shards=shard_dir, out=Path(out) / variant)).run()
            continue
        name = variant.split(":")[-1]             # resume:V -> V stopped, then resumed
        sets, sched = VARIANTS[name]
        policy = FULL_PRECISION
        if sched is not None:
            path = Path(out) / f"{name}.toml"
            if ctx.is_root:
                path.write_text(sched)
            ctx.comm.Barrier()
            policy = load_schedule(path)
        parts = ([{"stop_after": RESUME_AT}, {"resume": True}] if variant.startswith("resume:")
                 else [{}])
        for options in parts:
            trainer = prepare_trainer(ctx, load_config(None, list(sets)), shard_dir,
                                      Path(out) / variant, policy, **options)
            trainer.start()
            trainer.run()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3:])
