"""The model pieces without MPI: counter-based dropout, the local operators, and the whole
1-rank training checked against a plain full-graph torch implementation written here from
the dataset (not the shards), so the 1-rank run the oracle compares with is itself right."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from conftest import initial_params, train_here
from hpcgnn.nn.dropout import counter_dropout, keep_mask

EPOCHS = 5


def test_dropout_mask_depends_only_on_global_id():
    gid = torch.arange(0, 4000, 3)
    full = keep_mask(gid, 37, 0.5, seed=1, epoch=2, layer=1)
    perm = torch.randperm(gid.numel())[:500]
    assert torch.equal(keep_mask(gid[perm], 37, 0.5, 1, 2, 1), full[perm])
    assert abs(full.float().mean().item() - 0.5) < 0.01
    assert abs(keep_mask(gid, 37, 0.2, 1, 2, 1).float().mean().item() - 0.8) < 0.01
    for other in (keep_mask(gid, 37, 0.5, 2, 2, 1), keep_mask(gid, 37, 0.5, 1, 3, 1),
                  keep_mask(gid, 37, 0.5, 1, 2, 0)):
        assert 0.4 < (other == full).float().mean().item() < 0.6    # independent draws


def test_dropout_sparse_and_dense_paths_agree():
    gid = torch.arange(300) * 11
    dense = torch.rand(300, 40) + 0.1
    sparse = dense * (torch.rand(300, 40) < 0.1)
    for x in (dense, sparse):
        want = x * keep_mask(gid, 40, 0.3, 5, 6, 7) / 0.7
        assert torch.allclose(counter_dropout(x, gid, 0.3, 5, 6, 7, True), want, rtol=0, atol=1e-6)
    assert counter_dropout(dense, gid, 0.3, 5, 6, 7, training=False) is dense


def _lowbias32(x: np.ndarray) -> np.ndarray:
    """The 32-bit hash the dropout masks are defined with (lowbias32), in numpy uint64."""
    m = np.uint64(0xFFFFFFFF)
    x = x & m
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & m
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & m
    return x ^ (x >> np.uint64(16))


@pytest.mark.parametrize("native", (True, False))
@pytest.mark.parametrize("width, p", ((128, 0.5), (37, 0.2), (1, 0.9), (300, 0.5)))
def test_dropout_bits_values_and_gradients_follow_the_hash(native, width, p, monkeypatch):
    """The C path of CPU ranks and the torch path both give the bits of the definition
    (element (v, c) kept iff h(h(h(v) ^ key) ^ h(c * golden)) >= p 2^32, written here in numpy)
    and y = x * keep / (1 - p), dx = g * keep / (1 - p), NaN and inf inputs included."""
    from hpcgnn.hashing import M32, mix
    if not native:
        monkeypatch.setenv("HPCGNN_NATIVE", "0")
    gid = torch.randint(0, 2**40, (500,))
    key = np.uint64(mix(3, 4, 5, 0xD209) & M32)
    rows = _lowbias32(_lowbias32(gid.numpy().astype(np.uint64)) ^ key)
    cols = _lowbias32(np.arange(width, dtype=np.uint64) * np.uint64(0x9E3779B1))
    want = _lowbias32(rows[:, None] ^ cols[None, :]) >= np.uint64(int(p * 2**32))
    assert np.array_equal(keep_mask(gid, width, p, 3, 4, 5).numpy(), want)
    x = torch.randn(500, width)
    x[0, 0], x[1, -1] = float("inf"), float("nan")
    x.requires_grad_(True)
    y = counter_dropout(x, gid, p, 3, 4, 5, True)
    scale = torch.from_numpy(want).float() / (1.0 - p)
    assert torch.equal(y.detach().nan_to_num(), (x.detach() * scale).nan_to_num())
    g = torch.randn(500, width)
    y.backward(g)
    assert torch.equal(x.grad, g * scale)


@pytest.mark.parametrize("native", (True, False))
@pytest.mark.parametrize("n, k, m", ((13, 64, 8), (7, 300, 3), (9, 37, 16), (6, 5, 32), (1, 64, 17)))
def test_dropout_matmul_is_dropout_then_product_summed_in_order(native, n, k, m, monkeypatch):
    """``dropout_matmul`` (one C pass on CPU ranks, or the two torch steps): the masks of the
    definition (numpy, as above), and on the C path each sum in its documented order in
    float32 without fused multiply-adds, bit for bit, computed here with numpy's float32
    elementwise operations: ``y[r, j] = ((0 + a_0 w_0j) + a_1 w_1j) + ...`` over channels,
    ``dx[r, c] = (((0 + g_0 w_c0) + g_1 w_c1) + ...) * keep * scale`` over outputs, ``dw[c, j] =
    ((0 + a_0c g_0j) + a_1c g_1j) + ...`` over rows. Row counts that are not a multiple of the
    kernel's four, input widths past its 256-channel block, output widths padded to 8/16/32."""
    from hpcgnn.hashing import M32, mix
    from hpcgnn.nn.dropout import dropout_matmul, fuses_matmul
    if not native:
        monkeypatch.setenv("HPCGNN_NATIVE", "0")
    p, f32 = 0.3, np.float32
    gid = torch.randint(0, 2**40, (n,))
    key = np.uint64(mix(3, 4, 5, 0xD209) & M32)
    rows = _lowbias32(_lowbias32(gid.numpy().astype(np.uint64)) ^ key)
    cols = _lowbias32(np.arange(k, dtype=np.uint64) * np.uint64(0x9E3779B1))
    s = (_lowbias32(rows[:, None] ^ cols[None, :]) >= np.uint64(int(p * 2**32))).astype(f32) \
        * f32(1.0 / (1.0 - p))
    x = torch.randn(n, k, requires_grad=True)
    w = torch.randn(k, m, requires_grad=True)
    g = torch.randn(n, m)
    y = dropout_matmul(x, gid, p, 3, 4, 5, True, w)
    y.backward(g)
    xn, wn, gn = x.detach().numpy(), w.detach().numpy(), g.numpy()
    a = xn * s
    assert fuses_matmul(x, m, p, True) == native
    if not native:                                   # torch's product: its own order
        np.testing.assert_allclose(y.detach().numpy(), a.astype(np.float64) @ wn, rtol=1e-4, atol=1e-4)
        return
    want_y = np.zeros((n, m), f32)
    for c in range(k):
        want_y = want_y + a[:, c:c + 1] * wn[c][None, :]
    acc = np.zeros((n, k), f32)
    for j in range(m):
        acc = acc + gn[:, j:j + 1] * wn[:, j][None, :]
    want_dw = np.zeros((k, m), f32)
    for r in range(n):
        want_dw = want_dw + a[r][:, None] * gn[r][None, :]
    assert np.array_equal(y.detach().numpy(), want_y)
    assert np.array_equal(x.grad.numpy(), acc * s)
    assert np.array_equal(w.grad.numpy(), want_dw)


@pytest.mark.parametrize("n, k, m, density", ((40, 300, 16, 0.02), (13, 64, 8, 0.09), (9, 37, 64, 0.0)))
@pytest.mark.parametrize("training", (True, False))
def test_sparse_dropout_matmul_is_the_masked_product(n, k, m, density, training):
    """Sparse features' product (``sparse_dropout_matmul``: the kept non-zeros as a CSR matrix
    times ``W``): the masks of the definition (numpy, as above) on the non-zeros, the product
    and ``dW = (x * s)^T g`` in float64 within float32 rounding; no mask in evaluation; empty
    rows and columns, and an all-zero input."""
    from hpcgnn.hashing import M32, mix
    from hpcgnn.nn.dropout import SparseRows, sparse_dropout_matmul, sparse_product
    p, f32 = 0.3, np.float32
    gen = torch.Generator().manual_seed(n * k + m)
    x = torch.rand(n, k, generator=gen) * (torch.rand(n, k, generator=gen) < density)
    x[1] = 0.0                                                     # an empty row
    gid = torch.randint(0, 2**40, (n,), generator=gen)
    w = torch.randn(k, m, generator=gen, requires_grad=True)
    g = torch.randn(n, m, generator=gen)
    nz = x.nonzero(as_tuple=True)
    assert sparse_product(x, nz)
    y = sparse_dropout_matmul(SparseRows.of(x, nz), gid, p, 3, 4, 5, training, w)
    y.backward(g)
    key = np.uint64(mix(3, 4, 5, 0xD209) & M32)
    rows = _lowbias32(_lowbias32(gid.numpy().astype(np.uint64)) ^ key)
    cols = _lowbias32(np.arange(k, dtype=np.uint64) * np.uint64(0x9E3779B1))
    s = (_lowbias32(rows[:, None] ^ cols[None, :]) >= np.uint64(int(p * 2**32))).astype(f32) \
        * f32(1.0 / (1.0 - p))
    a = (x.numpy() * s if training else x.numpy()).astype(np.float64)
    wn = w.detach().numpy().astype(np.float64)
    np.testing.assert_allclose(y.detach().numpy(), a @ wn, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), a.T @ g.numpy(), rtol=1e-5, atol=1e-5)
    if training and density:
        assert 0 < np.count_nonzero(x.numpy() * s) < np.count_nonzero(x.numpy())   # some dropped


class _NoExchange:
    """The propagation of a rank whose halo rows are given (``with_halo``, a kept-features or
    stale step) or arrive as zeros (the synchronous step): nothing exchanged."""

    exchanges_input, eval_kept = False, False

    def __init__(self, n_halo: int):
        self.n_halo = n_halo

    def halo_rows(self, src, settings, local, modules=(None, None)):
        return local(), src.new_zeros(self.n_halo, src.shape[1])

    @staticmethod
    def point(x):
        return x

    @staticmethod
    def aggregate_halo(graph, x, x_halo):
        return graph.aggregate(x, x_halo)

    def aggregate(self, graph, src, settings, modules=(None, None)):
        return graph.owned @ src

    @staticmethod
    def received_rows(settings, width):        # no row-sampling stage: every halo row counts
        return None


def _local_graph(n: int, n_halo: int, seed: int):
    from hpcgnn.nn.graph import LocalGraph, SparseOp
    rng = np.random.default_rng(seed)
    a = sp.random(n, n + n_halo, density=0.3, random_state=rng, dtype=np.float32).tocsr()
    return LocalGraph(owned=SparseOp.from_scipy(a[:, :n], torch.device("cpu")),
                      halo=SparseOp.from_scipy(a[:, n:], torch.device("cpu")), n_owned=n,
                      n_halo=n_halo, node_ids=torch.from_numpy(rng.permutation(10 * (n + n_halo))[:n + n_halo]))


@pytest.mark.parametrize("arch", ("gcn", "sage", "gat"))
def test_sparse_features_take_the_sparse_product_and_give_the_dense_layer(arch):
    """A first layer (GCN, SAGE, GAT with attention dropout) over sparse features
    (``sparse_input``) multiplies them as a CSR matrix (``product`` says so, in training and
    evaluation), and both it and the same layer on dense input (the fused C pass where the
    weight is narrow) give the layer's definition computed unfused (``counter_dropout``, then
    ``forward_owned`` or ``with_halo``), forward and ``dW``, to rounding: synchronously and on
    given halo rows (kept features, in training and evaluation). Denser features (over
    ``SPARSE_PRODUCT_DENSITY``) do not take it."""
    from hpcgnn.comm.exchange import ExchangeSettings
    from hpcgnn.nn.dropout import SPARSE_PRODUCT_DENSITY
    from hpcgnn.nn.gat import GATLayer
    from hpcgnn.nn.layers import GCNLayer, SAGELayer
    from hpcgnn.nn.step import LayerStep
    cls = {"gcn": GCNLayer, "sage": SAGELayer, "gat": GATLayer}[arch]
    extra = {"heads": 2, "attn_dropout": 0.3} if arch == "gat" else {}
    graph, prop = _local_graph(12, 5, seed=3), _NoExchange(5)
    gen = torch.Generator().manual_seed(0)
    x, halo = (torch.rand(r, 200, generator=gen) * (torch.rand(r, 200, generator=gen) < 0.03)
               for r in (12, 5))
    sparse = cls(200, 8, graph, prop, input_needs_grad=False, dropout=0.5, sparse_input=True, **extra)
    dense = cls(200, 8, graph, prop, input_needs_grad=False, dropout=0.5, **extra)
    dense.load_state_dict(sparse.state_dict())
    for training in (True, False):
        step = LayerStep(epoch=2, training=training, seed=1, layer=0, exchange=ExchangeSettings(2))
        assert sparse.product(x, step, 8) == {"density": float((x != 0).sum()) / x.numel()}
        assert dense.product(x, step, 8) != sparse.product(x, step, 8)
        # the definitions, unfused: dropout (counter_dropout), then the layer on dropped rows
        want = {"sync": lambda: dense.forward_owned(dense.dropped(x, step, "owned"), step),
                "given halo": lambda: dense.with_halo(dense.dropped(x, step, "owned"),
                                                      dense.dropped(halo, step, "halo"), step)}
        got = {"sync": lambda m: m(x, step),          # in evaluation: the kept rows' path too
               "given halo": lambda m: m.stale_forward(x, halo, step)}
        for name, ref in want.items():
            y_ref = ref()
            g = torch.randn(y_ref.shape, generator=gen)
            (g_ref,) = torch.autograd.grad(y_ref, dense.weight, g)
            for layer in (sparse, dense):
                y = got[name](layer)
                torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(torch.autograd.grad(y, layer.weight, g)[0], g_ref,
                                           rtol=1e-5, atol=1e-6)
    thick = torch.rand(12, 200, generator=gen) * (torch.rand(12, 200, generator=gen) < 2 * SPARSE_PRODUCT_DENSITY)
    assert sparse.product(thick, step, 8) is None


@pytest.mark.parametrize("threads", (2, 3))
def test_dropout_matmul_is_the_same_on_any_thread_count(threads):
    """On several threads the rows are split between them, and ``dw`` is summed in blocks of
    ``MATMUL_CHUNK`` rows (in order within a block, the blocks' sums added in order), whatever
    the thread count: the same bits as on one thread, and that order checked against numpy's
    float32 sums."""
    from hpcgnn.codecs import native
    from hpcgnn.nn.dropout import dropout_matmul
    if native.lib() is None:
        pytest.skip("no C kernels (no compiler)")
    n, k, m, chunk = 2 * native.MATMUL_CHUNK + 301, 24, 5, native.MATMUL_CHUNK
    gid = torch.randint(0, 2**40, (n,))
    x0, w0, g = torch.randn(n, k), torch.randn(k, m), torch.randn(n, m)
    out = []
    for t in (1, threads):
        with _torch_threads(t):
            x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
            y = dropout_matmul(x, gid, 0.5, 1, 2, 3, True, w)
            y.backward(g)
            out.append((y.detach(), x.grad, w.grad))
    for one, many in zip(*out):
        assert torch.equal(one, many)
    dx = out[0][1].numpy()
    a = (dx != 0).astype(np.float32) * 2.0 * x0.numpy()     # the dropped x (scale 2), where kept
    gn, f32 = g.numpy(), np.float32
    want = None
    for lo in range(0, n, chunk):
        part = np.zeros((k, m), f32)
        for r in range(lo, min(n, lo + chunk)):
            part = part + a[r][:, None] * gn[r][None, :]
        want = part if want is None else want + part
    assert np.array_equal(out[0][2].numpy(), want)


@pytest.mark.parametrize("arch", ["gcn", "sage"])
def test_local_operator_matches_dense_formula(arch, shards):
    from hpcgnn.data.datasets import load_dataset
    from hpcgnn.data.shard import read_shard
    from hpcgnn.nn.graph import LocalGraph
    g = load_dataset("cora")
    shard = read_shard(shards("cora", 1) / "part-00000.h5")
    op = LocalGraph.from_shard(shard, arch)
    x = torch.randn(g.num_nodes, 6)
    got = op.aggregate(x, torch.zeros(0, 6))
    assert torch.allclose(got, torch.from_numpy(_dense_operator(g, arch) @ x.double().numpy()).float(),
                          atol=1e-5)


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("width", (1, 8, 37, 128))
def test_aggregate_in_one_pass_equals_the_two_products_bit_for_bit(width, threads, shards,
                                                                    monkeypatch):
    """``LocalGraph.aggregate`` on CPU ranks (one C pass, ``native.spmm_sum2``) gives the bits of
    ``owned @ x + halo @ x_halo`` (two products, then the add), forward and backward, on a
    rank's part of 4 random parts of the cSBM (empty rows among the halo operator's); on 2
    threads every product is split between them."""
    from conftest import CSBM
    from hpcgnn.codecs import native
    monkeypatch.setattr(native, "_SPMM_SPLIT", 0)
    from hpcgnn.data.shard import read_shard
    from hpcgnn.nn.graph import LocalGraph, SpMMSum
    shard = read_shard(shards(CSBM, 4, "random") / "part-00001.h5")
    g = LocalGraph.from_shard(shard, "gcn")
    assert (g.halo.mat.crow_indices().diff() == 0).any()
    torch.manual_seed(width)
    x0, h0 = torch.randn(g.n_owned, width), torch.randn(g.n_halo, width)
    grad = torch.randn(g.n_owned, width)
    got = []
    with _torch_threads(threads):
        for merged in (True, False):
            x, h = x0.clone().requires_grad_(True), h0.clone().requires_grad_(True)
            y = SpMMSum.apply(x, h, g.owned, g.halo) if merged else (g.owned @ x) + (g.halo @ h)
            y.backward(grad)
            got.append((y.detach(), x.grad, h.grad))
    for one, two in zip(*got):
        assert torch.equal(one, two)
    assert torch.equal(g.aggregate(x0, h0), got[1][0])      # the path aggregate takes


def test_aggregate_in_one_pass_is_the_operators_product_on_a_directed_graph(shards, tmp_path):
    """The one-pass aggregation against scipy in float64 on a part of a one-way lattice
    (``tests/test_directed.py``'s graph, no --symmetrize: the halo operator is not the
    transpose of anything the forward uses): forward ``A x + B h``, backward ``A^T g``,
    ``B^T g`` with the transposes taken here."""
    from test_directed import lattice_arrays
    from hpcgnn.data.shard import read_shard
    from hpcgnn.nn.graph import LocalGraph
    np.savez(tmp_path / "lattice.npz", **lattice_arrays())
    parts = shards(f"npz:{tmp_path / 'lattice.npz'}", 3)
    g = max((LocalGraph.from_shard(read_shard(parts / f"part-0000{k}.h5"), "gcn") for k in range(3)),
            key=lambda op: op.n_halo)               # a part that receives halo rows
    assert g.n_halo > 0

    def scipy_op(op):
        m = op.mat
        return sp.csr_matrix((m.values().double().numpy(), m.col_indices().numpy(),
                              m.crow_indices().numpy()), shape=op.shape)
    a, b = scipy_op(g.owned), scipy_op(g.halo)
    torch.manual_seed(0)
    x, h = torch.randn(g.n_owned, 7, requires_grad=True), torch.randn(g.n_halo, 7, requires_grad=True)
    grad = torch.randn(g.n_owned, 7)
    y = g.aggregate(x, h)
    y.backward(grad)
    xd, hd, gd = (t.detach().double().numpy() for t in (x, h, grad))
    np.testing.assert_allclose(y.detach().numpy(), a @ xd + b @ hd, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), a.T @ gd, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h.grad.numpy(), b.T @ gd, rtol=1e-5, atol=1e-6)


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch's intra-op thread count set to ``n`` for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _dense_operator(g, arch: str) -> np.ndarray:
    a = sp.csr_matrix((np.ones(g.num_edges), g.indices, g.indptr), shape=(g.num_nodes,) * 2).toarray()
    deg = a.sum(1)
    if arch == "gcn":
        a = a + np.eye(g.num_nodes)
        d = 1.0 / np.sqrt(deg + 1.0)
        return d[:, None] * a * d[None, :]
    return a / np.maximum(deg, 1)[:, None]


def _reference_losses(arch: str, init: dict, layers: int, p: float, seed: int, g=None,
                      normalize: bool = True, epochs: int = EPOCHS) -> list[float]:
    """Plain full-graph training: dense features, a COO adjacency, torch's Adam. ``g``: the
    graph (``num_nodes``, ``num_edges``, CSR ``indptr``/``indices`` where row ``i`` lists the
    nodes whose messages reach ``i``, ``dense_features()``, ``labels``, ``train_idx``); Cora
    when not given, its features row-normalised unless ``normalize`` is false."""
    from _pipegcn import adam_step
    if g is None:
        from hpcgnn.data.datasets import load_dataset
        g = load_dataset("cora")
    x = torch.from_numpy(g.dense_features())
    if normalize:
        x = x / x.sum(1, keepdim=True).clamp_min(1e-30) * (x.sum(1, keepdim=True) > 0)
    adj = torch.from_numpy(_dense_operator(g, arch)).float().to_sparse()
    y, train = torch.from_numpy(g.labels), torch.from_numpy(g.train_idx)
    gid = torch.arange(g.num_nodes)
    params = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = torch.optim.Adam(params.values(), lr=0.01, weight_decay=5e-4)
    losses = []
    for epoch in range(epochs):
        h = x
        for i in range(layers):
            h = h * keep_mask(gid, h.shape[1], p, seed, epoch, i) / (1 - p)
            w, b = params[f"layers.{i}.weight"], params[f"layers.{i}.bias"]
            if arch == "gcn":
                h = torch.sparse.mm(adj, h @ w) + b
            else:
                out = w.shape[1] // 2
                h = h @ w[:, :out] + torch.sparse.mm(adj, h) @ w[:, out:] + b
            h = torch.relu(h) if i < layers - 1 else h
        losses.append(adam_step(opt, F.cross_entropy(h[train], y[train])))
    return losses


@pytest.mark.parametrize("arch", ["gcn", "sage"])
def test_one_rank_training_matches_plain_torch(arch, shards, tmp_path):
    sets = (f"model.arch={arch}", "model.layers=2", "model.hidden=16")
    init = initial_params(shards("cora", 1), *sets, config="configs/cora.toml")
    got = train_here(shards("cora", 1), tmp_path / "run", *sets, f"train.epochs={EPOCHS}")
    want = _reference_losses(arch, init, layers=2, p=0.5, seed=0)
    assert [r["loss"] for r in got] == pytest.approx(want, rel=1e-5)


def test_training_steps_free_their_autograd_graphs(shards, tmp_path):
    """No reference cycle through the exchange's autograd functions: after a step nothing of
    its graph (the in-flight exchange records it holds) stays alive."""
    import gc

    from hpcgnn.comm.context import CommContext
    from hpcgnn.comm.exchange import InFlight
    from hpcgnn.config import load_config
    from hpcgnn.train.build import prepare_trainer
    trainer = prepare_trainer(CommContext.from_world("cpu"),
                              load_config("configs/cora.toml", ["train.epochs=3"]),
                              shards("cora", 1), tmp_path)
    trainer.n_train = 140
    for epoch in range(3):
        trainer.train_step(epoch)
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is InFlight]
