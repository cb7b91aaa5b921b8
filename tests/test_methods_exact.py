"""Training methods on real ranks against single-process computations of the same methods
written here. Bounded staleness (PipeGCN, ``tests/_pipegcn.py``): each layer's input rows of
epoch t - s stand in for the halo, dropped out and multiplied by the current weights at the
receiver, halo gradients reach their owners s epochs later, the first s epochs are
synchronous, and smoothing averages both; Sylvie (quantised stale rows and gradients) is the
same PipeGCN fed what the numpy quantiser of ``test_codecs`` gives, and BNS-GCN's ``sample`` on
stale layers the same PipeGCN fed the sample of the epoch the rows were sent at (their gradients
back through that selection), and smoothing under a lossy codec the same PipeGCN with smoothing
fed the codec's rows and gradients; resume with staleness on
equals the uninterrupted run, and a stale 1-bit run still learns. Compression: a sampled,
random-channel schedule (and ``sample`` alone on a one-way directed graph) trains exactly as the
whole-graph model whose halo rows are what the documented selection delivers (and, with a
quantised ``[backward]``, whose halo gradients go back through the numpy quantiser), and VARCO's learned codec as the whole-graph model whose halo
rows pass a trained encoder, the first k channels and a trained decoder while k < F."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from _pipegcn import torch_sparse
from conftest import CSBM, check_ok, initial_params, read_metrics, together, train, train_together
from test_codecs import np_hash32, ref_channels, ref_kept_rows

EPOCHS = 8
SETS = ("model.arch=gcn", "model.layers=2", "model.hidden=16", "model.dropout=0.0",
        f"train.epochs={EPOCHS}")


def _gcn_operator(g) -> np.ndarray:
    a = sp.csr_matrix((np.ones(g.num_edges), g.indices, g.indptr), shape=(g.num_nodes,) * 2).toarray()
    d = 1.0 / np.sqrt(a.sum(1) + 1.0)
    return d[:, None] * (a + np.eye(g.num_nodes)) * d[None, :]


@pytest.fixture(scope="module")
def init_params(shards):
    return initial_params(shards(CSBM, 1), *SETS[:4])


def _parts(shard_dir, ranks: int) -> np.ndarray:
    from hpcgnn.data.shard import read_meta, read_shard
    part_of = np.zeros(read_meta(shard_dir)["num_nodes"], dtype=np.int64)
    for r in range(ranks):
        part_of[read_shard(shard_dir / f"part-{r:05d}.h5").global_id] = r
    return part_of


# (dataset, ranks, partitioner, --set list, staleness, smoothing, progress): every way of
# progressing the exchange in flight (tests between the stale layers, ``fine`` tests inside the
# layers' work, a thread) trains exactly this model
GAT_GRAPH = "csbm:nodes=799,classes=4,degree=8,features=24,seed=3"   # dense attention reference
STALE_CASES = {
    # 3 layers 24 -> 16 -> 16 -> 4, dense features: on CPU ranks every layer transforms first
    # with the dropout fused into the product (weights <= 32 wide)
    "gcn3-2ranks-s1-fine": (CSBM, 2, "random", ("model.arch=gcn", "model.layers=3"), 1, 0.0,
                            "fine"),
    # 24 -> 64 -> 64 -> 4: the first two layers aggregate first (unfused), the last is fused
    # (and the progress thread)
    "gcn3-wide-2ranks-s1-thread": (CSBM, 2, "random", ("model.arch=gcn", "model.layers=3",
                                                       "model.hidden=64"), 1, 0.0, "thread"),
    "sage3-3ranks-s2-smooth-fine": (CSBM, 3, "metis", ("model.arch=sage", "model.layers=3",
                                                       "model.hidden=8"), 2, 0.5, "fine"),
    "sage-4ranks-s1": (CSBM, 4, "random", ("model.arch=sage", "model.hidden=32"), 1, 0.0, "thread"),
    # sparse (bag-of-words) first-layer input, uneven METIS parts
    "gcn-cora-3ranks-s1-smooth": ("cora", 3, "metis", ("model.arch=gcn",), 1, 0.5, "test"),
    "gat-2ranks-s1-attn-dropout-fine": (GAT_GRAPH, 2, "metis", ("model.arch=gat", "model.heads=2",
                                                                "model.hidden=8",
                                                                "model.attn_dropout=0.3"),
                                        1, 0.0, "fine"),
}


def reference_model(model_sets: tuple[str, ...]):
    """The reference's model for a case's ``--set`` list (``tests/_pipegcn.py``)."""
    from _pipegcn import Model
    cfg = dict(s.split("=") for s in model_sets)
    layers = int(cfg.get("model.layers", 2))
    heads = (int(cfg.get("model.heads", 1)),) * (layers - 1) + (1,)
    return Model(cfg["model.arch"], layers, dropout=0.5,
                 attn_dropout=float(cfg.get("model.attn_dropout", 0.0)), heads=heads)


@pytest.fixture(scope="module")
def init_of(shards):
    """``init_of(spec, sets)``: the initial parameters of that model (a fresh model's)."""
    cache = {}

    def get(spec, sets):
        if (spec, sets) not in cache:
            cache[spec, sets] = initial_params(shards(spec, 1), *sets)
        return cache[spec, sets]

    return get


def stale_sets(case: str) -> tuple[str, ...]:
    model_sets = STALE_CASES[case][3]
    return (*model_sets, "model.dropout=0.5", f"train.epochs={EPOCHS}")


@pytest.fixture(scope="module")
def stale_runs(shards, tmp_path_factory):
    """The runs of STALE_CASES, those of one rank count in one job (``conftest.together``)."""
    return together(tmp_path_factory, {
        case: (ranks, shards(spec, ranks, partitioner),
               (*stale_sets(case), f"train.staleness={s}", f"train.smoothing={m}"),
               {"HPCGNN_PROGRESS": progress})
        for case, (spec, ranks, partitioner, _, s, m, progress) in STALE_CASES.items()})


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(STALE_CASES))
def test_stale_training_equals_pipegcn(case, shards, init_of, stale_runs):
    """PipeGCN as its paper and code define it (``tests/_pipegcn.py``): each layer's input is
    exchanged before dropout, the receiver drops it out with the current epoch's mask and
    applies its current weights, and a halo gradient is added into its owner's boundary rows
    s epochs later; dropout 0.5 everywhere (GAT's attention dropout too). Every way of
    progressing the exchange in flight (``[comm] progress``)."""
    from _pipegcn import pipegcn_losses
    from hpcgnn.data.datasets import load_dataset
    spec, ranks, partitioner, model_sets, s, m, _ = STALE_CASES[case]
    sets, shard_dir = stale_sets(case), shards(spec, ranks, partitioner)
    proc, run = stale_runs(case)
    check_ok(proc)
    got = [r["loss"] for r in read_metrics(run)]
    model = reference_model(model_sets)
    g, parts, init = load_dataset(spec), _parts(shard_dir, ranks), init_of(spec, sets)
    if partitioner == "metis":
        assert len(set(np.bincount(parts).tolist())) > 1                  # uneven parts
    assert got == pytest.approx(pipegcn_losses(g, parts, init, model, s, m, EPOCHS), rel=2e-5)
    sync = pipegcn_losses(g, parts, init, model, 0, 0.0, EPOCHS)
    assert got[s:] != pytest.approx(sync[s:], rel=1e-4)    # staleness changed the trajectory


@pytest.mark.mpi
def test_resume_with_staleness_is_exact(shards, tmp_path):
    shard_dir = shards(CSBM, 2, "random")
    sets = (*SETS[:4], "model.dropout=0.5", "train.staleness=2", "train.smoothing=0.5")
    sched = tmp_path / "q.toml"
    sched.write_text('codec = "sample+quant"\nbits = 2\nkind = "constant"\nratio = 2.0\n'
                     'compress_last_layer = true\n')
    extra, sets = ("--schedule", str(sched)), (*sets, "train.epochs=8")
    # 3 epochs (checkpoint and stop), then resume to 8 with the same config; one job
    done = train_together(2, [(shard_dir, tmp_path / "full", sets, {}, extra),
                              (shard_dir, tmp_path / "part", sets, {}, (*extra, "--stop-after", "3")),
                              (shard_dir, tmp_path / "part", sets, {}, (*extra, "--resume"))],
                          tmp_path)
    for proc in done:
        check_ok(proc)
    assert "stopped after 3 epochs" in done[1].stderr, done[1].stderr
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


def _block_keys(seed: int, layer: int, src: int, dst: int, epoch: int) -> tuple[int, int]:
    """(row key, channel key) of the block src -> dst: the rows of an epoch's sample are the
    same in every layer (no layer in the row key, as BNS-GCN), the channels a draw per layer."""
    from test_exchange_exact import mix

    def key(pair: int) -> int:
        return int(np_hash32(np.uint64(pair & 0xFFFFFFFF) ^ np_hash32(epoch)))
    return key(mix(seed, src, dst)), key(mix(seed, layer, src, dst))


def _mean_operator(g) -> np.ndarray:
    """GraphSAGE's mean over the in-neighbours in the whole graph: ``1 / in_degree(i)`` on every
    in-edge of ``i`` (BNS-GCN's ``in_norm``: the whole graph's in-degree, sampled or not)."""
    a = sp.csr_matrix((np.ones(g.num_edges), g.indices, g.indptr), shape=(g.num_nodes,) * 2).toarray()
    deg = a.sum(1)
    return a / np.where(deg > 0, deg, 1.0)[:, None]


def _split_operator(shard_dir, ranks: int, spec: str = CSBM, operator=_gcn_operator):
    """The whole graph and its ``operator`` (GCN's) split into the part-local entries
    (``a_loc``) and, per receiving part ``q``, the entries whose column is another part's node
    (``a_halo[q]``)."""
    from hpcgnn.data.datasets import load_dataset
    g = load_dataset(spec)
    part_of = _parts(shard_dir, ranks)
    a = sp.coo_matrix(operator(g))
    same = part_of[a.row] == part_of[a.col]
    a_loc = torch_sparse(sp.coo_matrix((a.data * same, (a.row, a.col)), shape=a.shape))
    a_halo = [torch_sparse(sp.coo_matrix((a.data * (~same & (part_of[a.row] == q)),
                                          (a.row, a.col)), shape=a.shape)) for q in range(ranks)]
    return g, a_loc, a_halo


def _transforms_first(layer: int, f_in: int, f_out: int) -> bool:
    """Whether the ranks exchange a layer's transformed rows (``x W``) rather than its input:
    the narrower rows per step, forward and backward, the first layer's input needing no
    backward (``hpcgnn/nn/layers.py``); a tie transforms first."""
    return 2 * f_out <= f_in * (1 if layer == 0 else 2)


def _train(g, p: dict, opt, propagate, arch: str = "gcn") -> list[float]:
    """EPOCHS full-batch steps of the GCN (``A x W + b``) or, with ``arch = "sage"``, the
    GraphSAGE-mean (``x W_s + mean(x) W_n + b``, ``weight = [W_s | W_n]``) of ``p``'s layers,
    ReLU between them, its operator ``propagate(e, layer, epoch)``; the losses. Each layer
    propagates its input or its transformed rows as the ranks pick (``_transforms_first``): a
    channel selection commutes with neither ``W`` nor ``W_n``."""
    x, y = torch.from_numpy(g.dense_features()), torch.from_numpy(g.labels)
    train_idx = torch.from_numpy(g.train_idx)
    layers = 0
    while f"layers.{layers}.weight" in p:
        layers += 1

    def layer(h, i, t):
        w, b = p[f"layers.{i}.weight"], p[f"layers.{i}.bias"]
        out = w.shape[1] // 2 if arch == "sage" else w.shape[1]
        w_self, w_neigh = (w[:, :out], w[:, out:]) if arch == "sage" else (None, w)
        neigh = (propagate(h @ w_neigh, i, t) if _transforms_first(i, w.shape[0], out)
                 else propagate(h, i, t) @ w_neigh)
        return (neigh if w_self is None else h @ w_self + neigh) + b
    losses = []
    for t in range(EPOCHS):
        h = x
        for i in range(layers):
            h = layer(h, i, t)
            h = torch.relu(h) if i < layers - 1 else h
        loss = F.cross_entropy(h[train_idx], y[train_idx])
        opt.zero_grad(set_to_none=False)      # a parameter this step leaves alone still steps
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def compressed_reference(shard_dir, ranks: int, init: dict, spec: str = CSBM,
                         channels: str = "random", arch: str = "gcn", seed: int = 0,
                         keep: float = 0.5, ratio: float = 2.0, forward_bits: int = 32,
                         backward_bits: int = 32, params: dict | None = None) -> list[float]:
    """The GCN (or with ``arch = "sage"`` GraphSAGE-mean) of ``init``'s layers on the whole
    graph (``_train``), each part's halo rows of every layer replaced by what the documented
    selection delivers: ``keep`` of each block's rows (the same rows in every layer of an
    epoch, scaled by rows/kept; 1: every row) and ``k = max(1, floor(F / ratio))`` channels,
    drawn per block and layer (``channels = "random"``), the first ``k`` (``"truncate"``) or
    every channel (``"all"``: ``sample`` alone), with the blocks' keys of the run's
    ``train.seed`` (``seed``), in fp32 or, with ``forward_bits < 32``, through a ``quant``
    stage (``delivered``). The halo gradients go back through the adjoint of that selection:
    exactly the rows and channels sent, scaled by the sender (the halo's part), in fp32, or
    with ``backward_bits < 32`` the ``[backward]`` table's ``quant``: the part's whole buffer
    of them (its halo blocks in order, each block's kept rows ascending, its channels
    ascending) stochastically rounded as ``test_codecs.ref_quant`` does with the key
    ``mix(seed, epoch, layer, 1, part)``. ``params``: a dict to fill with the trained
    parameters."""
    from _pipegcn import Sent
    from hpcgnn.data.shard import read_shard
    from test_codecs import ref_quant
    from test_exchange_exact import mix
    operator = _gcn_operator if arch == "gcn" else _mean_operator
    g, a_loc, a_halo = _split_operator(shard_dir, ranks, spec, operator)
    shards = [read_shard(shard_dir / f"part-{p:05d}.h5") for p in range(ranks)]
    p = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = torch.optim.Adam(p.values(), lr=0.01, weight_decay=5e-4)

    def selection(q: int, layer: int, width: int, epoch: int) -> list[tuple]:
        """Part ``q``'s halo blocks in order: (source part, kept rows' global ids, channels,
        scale)."""
        out, start = [], 0
        k = max(1, int(width / ratio + 1e-9))
        for src, rows in enumerate(shards[q].recv_counts.tolist()):
            gid = shards[q].halo_global_id[start:start + rows]
            start += rows
            if not rows:
                continue
            row_key, chan_key = _block_keys(seed, layer, src, q, epoch)
            kept = ref_kept_rows(row_key, rows, keep)
            chans = {"random": lambda: ref_channels(chan_key, width, k),
                     "truncate": lambda: list(range(k)), "all": lambda: list(range(width))}
            out.append((src, gid[kept], chans[channels](), rows / len(kept)))
        return out

    def rounded(blocks: list[np.ndarray], bits: int, key: int) -> list[np.ndarray]:
        """One buffer of ``blocks`` (rows of the channels sent), quantised as a whole."""
        if bits == 32 or not blocks:
            return blocks
        buf, out = ref_quant(np.concatenate(blocks), bits, key), []
        for b in blocks:
            out.append(buf[:len(b)])
            buf = buf[len(b):]
        return out

    def delivered(x: torch.Tensor, sel: list[list[tuple]], layer: int, epoch: int) -> list:
        """Per part ``q``, ``(N, F)``: the values its halo rows arrive with. Each sender
        quantises the rows and channels it sends, unscaled, as one buffer (its blocks by
        destination, in order) with ``mix(seed, epoch, layer, 0, sender)``; the receiver scales
        the kept rows."""
        out = [torch.zeros_like(x) for _ in range(ranks)]
        for src in range(ranks):
            blocks = [(q, b) for q in range(ranks) for b in sel[q] if b[0] == src]
            vals = rounded([x[torch.from_numpy(gid)][:, chans].numpy() for _, (_, gid, chans, _) in blocks],
                           forward_bits, mix(seed, epoch, layer, 0, src))
            for (q, (_, gid, chans, scale)), v in zip(blocks, vals):
                out[q][np.ix_(gid, chans)] = torch.from_numpy(np.ascontiguousarray(v)) * scale
        return out

    def adjoint(q: int, layer: int, epoch: int, blocks: list[tuple], grad: torch.Tensor):
        """What the owners get of ``grad`` (``(N, F)``), the gradient of part ``q``'s halo."""
        vals = rounded([(grad[torch.from_numpy(gid)] * scale)[:, chans].numpy()
                        for _, gid, chans, scale in blocks],
                       backward_bits, mix(seed, epoch, layer, 1, q))
        out = torch.zeros_like(grad)
        for (_, gid, chans, _), v in zip(blocks, vals):
            out[np.ix_(gid, chans)] = torch.from_numpy(np.ascontiguousarray(v))
        return out

    def propagate(e: torch.Tensor, layer: int, epoch: int) -> torch.Tensor:
        out = torch.sparse.mm(a_loc, e)
        sel = [selection(q, layer, e.shape[1], epoch) for q in range(ranks)]
        for q, rows in enumerate(delivered(e.detach(), sel, layer, epoch)):
            sent = Sent.apply(e, rows, lambda grad, q=q: adjoint(q, layer, epoch, sel[q], grad))
            out = out + torch.sparse.mm(a_halo[q], sent)
        return out

    losses = _train(g, p, opt, propagate, arch)
    if params is not None:
        params.update({k: v.detach() for k, v in p.items()})
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


@pytest.fixture(scope="module")
def lattice_spec(tmp_path_factory) -> str:
    """``test_directed``'s one-way lattice (messages flow i -> i+1..i+3) as an npz spec."""
    from test_directed import lattice_arrays
    path = tmp_path_factory.mktemp("lattice") / "lattice.npz"
    np.savez(path, **lattice_arrays())
    return f"npz:{path}"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_boundary_sampling_on_a_directed_graph_equals_single_process_computation(
        ranks, shards, init_of, lattice_spec, tmp_path):
    """BNS-GCN's ``sample`` where parts receive from their predecessors only: the backward's
    peers are not the forward's, and a block's sample must still be the same rows both ways."""
    shard_dir = shards(lattice_spec, ranks, "metis")
    (tmp_path / "s.toml").write_text('codec = "sample"\nkind = "constant"\nratio = 2.0\n'
                                     'compress_last_layer = true\n')
    check_ok(train(ranks, shard_dir, tmp_path / "run", *SETS,
                   extra=("--schedule", str(tmp_path / "s.toml")), timeout=180))
    got = [r["loss"] for r in read_metrics(tmp_path / "run")]
    init = init_of(lattice_spec, SETS[:4])
    assert got == pytest.approx(compressed_reference(shard_dir, ranks, init, lattice_spec,
                                                     channels="all"), rel=2e-5)


@pytest.mark.mpi
def test_sampled_sage_mean_equals_single_process_computation(shards, init_of, tmp_path):
    """BNS-GCN's ``sample`` under GraphSAGE's mean: the kept halo rows scaled by rows/kept and
    the sum divided by the whole in-degree (BNS-GCN's ``in_norm``), the dropped rows counted in
    it: an unbiased estimate of the mean, not a mean over the kept neighbours. With
    ``train.seed = 3``: the blocks' keys are drawn from the run's seed."""
    sets = ("model.arch=sage", *SETS[1:], "train.seed=3")
    shard_dir = shards(CSBM, 2, "random")
    (tmp_path / "s.toml").write_text('codec = "sample"\nkind = "constant"\nratio = 2.0\n'
                                     'compress_last_layer = true\n')
    check_ok(train(2, shard_dir, tmp_path / "run", *sets,
                   extra=("--schedule", str(tmp_path / "s.toml")), timeout=180))
    got = [r["loss"] for r in read_metrics(tmp_path / "run")]
    init = init_of(CSBM, (*sets[:4], "train.seed=3"))
    assert got == pytest.approx(compressed_reference(shard_dir, 2, init, channels="all",
                                                     arch="sage", seed=3), rel=2e-5)


# -- Sylvie: bounded staleness with quantised rows, against PipeGCN fed the quantiser's output --

SYLVIE = 'codec = "quant"\nbits = 2\ncompress_last_layer = true\n'    # backward: 2 bits too


def quantised_rows(shard_dir, ranks: int, bits: int, seed: int = 0, ratio: float = 1.0):
    """``(received, returned)`` of ``tests/_pipegcn.py`` as the documented quantiser
    (``test_codecs.ref_quant``, numpy) delivers rows and gradients. Rows: each sender ``p``
    quantises its whole send buffer ``h[global_id[send_index]]`` (grouped by destination) with
    the noise key ``mix(seed, epoch, layer, 0, p)``, and ``q``'s block of it is ``q``'s halo
    block from ``p``, in order. Gradients: part ``q`` quantises those of all its halo rows, in
    halo order, with ``mix(seed, epoch, layer, 1, q)`` (``epoch``: the one the rows were used
    at), and each owner takes its block. ``ratio > 1``: ``truncate+quant``, whose rate stage
    keeps the first ``k = max(1, floor(F / ratio))`` channels of every row before the rounding
    (the others arrive as zeros) and sends back the gradients of those channels alone."""
    from hpcgnn.data.shard import read_shard
    from test_codecs import ref_quant
    from test_exchange_exact import mix
    shards = [read_shard(shard_dir / f"part-{p:05d}.h5") for p in range(ranks)]

    def width(h: torch.Tensor) -> int:
        return max(1, int(h.shape[1] / ratio + 1e-9))

    def returned(layer: int, epoch: int, grad: torch.Tensor, q: int) -> torch.Tensor:
        gid, k = torch.from_numpy(shards[q].halo_global_id), width(grad)
        out = torch.zeros_like(grad)
        if len(gid):                        # a part without halo rows (a chain's first) sends none
            out[gid, :k] = torch.from_numpy(ref_quant(grad[gid, :k].numpy(), bits,
                                                      mix(seed, epoch, layer, 1, q)))
        return out

    def received(layer: int, epoch: int, h: torch.Tensor, q: int) -> torch.Tensor:
        out, start, k = h.detach().clone(), 0, width(h)
        for p, rows in enumerate(shards[q].recv_counts.tolist()):
            if rows:
                sp_ = shards[p]
                buf = h.detach()[torch.from_numpy(sp_.global_id[sp_.send_index]), :k].numpy()
                deq = ref_quant(buf, bits, mix(seed, epoch, layer, 0, p))
                off = int(sp_.send_counts[:q].sum())
                gid = torch.from_numpy(shards[q].halo_global_id[start:start + rows])
                out[gid] = 0.0
                out[gid, :k] = torch.from_numpy(deq[off:off + rows])
            start += rows
        return out

    return received, returned


def sampled_rows(shard_dir, ranks: int, keep: float, s: int, seed: int = 0):
    """``(received, returned)`` of ``tests/_pipegcn.py`` as BNS-GCN's ``sample`` delivers rows
    and takes their gradients back under staleness ``s``: of part ``q``'s halo block from
    ``p``, the rows ``ref_kept_rows`` draws from the block's row key of the epoch the rows were
    SENT at (no layer in it), scaled by rows/kept, the others zeros; their gradients go back
    through that same selection and scale (the adjoint), nothing for the dropped rows. A stale
    layer's rows used at ``t`` were sent at ``t - s``; the synchronous warm-up's at ``t``."""
    from hpcgnn.data.shard import read_shard
    shards = [read_shard(shard_dir / f"part-{p:05d}.h5") for p in range(ranks)]

    def blocks(q: int, epoch: int):
        start = 0
        for p, rows in enumerate(shards[q].recv_counts.tolist()):
            gid = shards[q].halo_global_id[start:start + rows]
            start += rows
            if rows:
                kept = ref_kept_rows(_block_keys(seed, 0, p, q, epoch)[0], rows, keep)
                yield (torch.from_numpy(gid), torch.from_numpy(gid[kept]),
                       rows / len(kept) if kept else 0.0)

    def received(layer: int, epoch: int, h: torch.Tensor, q: int) -> torch.Tensor:
        out = h.detach().clone()
        for gid, kept, scale in blocks(q, epoch):
            out[gid] = 0.0
            out[kept] = h.detach()[kept] * scale
        return out

    def returned(layer: int, epoch: int, grad: torch.Tensor, q: int) -> torch.Tensor:
        out = torch.zeros_like(grad)
        for _, kept, scale in blocks(q, epoch if epoch < s else epoch - s):
            out[kept] = grad[kept] * scale
        return out

    return received, returned


# Sylvie, and BNS-GCN's sample under PipeGCN's staleness, and PipeGCN's smoothing of what a
# lossy codec delivers: (schedule, staleness, smoothing), one 3-rank job
SAMPLE_HALF = 'codec = "sample"\nkind = "constant"\nratio = 2.0\ncompress_last_layer = true\n'
TRUNCATE_QUANT = ('codec = "truncate+quant"\nbits = 2\nkind = "constant"\nratio = 2.0\n'
                  'compress_last_layer = true\n')
STALE_CODECS = {"sylvie": (SYLVIE, 1, 0.0),
                "sample-s2": (SAMPLE_HALF, 2, 0.0),
                "sylvie-smooth": (SYLVIE, 1, 0.5),
                "truncate-quant-s2-smooth": (TRUNCATE_QUANT, 2, 0.5),
                "sample-s1-smooth": (SAMPLE_HALF, 1, 0.5),
                "sample-sage-s2-smooth": (SAMPLE_HALF, 2, 0.5)}
STALE_CODEC_MODEL = ("model.arch=gcn", "model.layers=3")
STALE_CODEC_SETS = (*STALE_CODEC_MODEL, "model.dropout=0.5", f"train.epochs={EPOCHS}")


def stale_codec_model(name: str) -> tuple[str, ...]:
    """A STALE_CODECS run's model: the 3-layer GCN, or (``-sage-``) the same GraphSAGE-mean."""
    return ("model.arch=sage", *STALE_CODEC_MODEL[1:]) if "-sage-" in name else STALE_CODEC_MODEL


@pytest.fixture(scope="module")
def stale_codec_runs(shards, tmp_path_factory):
    """name -> run dir of STALE_CODECS: 3 uneven METIS parts, a 3-layer GCN with dropout."""
    work = tmp_path_factory.mktemp("stale-codecs")
    runs = []
    for name, (schedule, s, m) in STALE_CODECS.items():
        (work / f"{name}.toml").write_text(schedule)
        runs.append((shards(CSBM, 3, "metis"), work / name,
                     (*stale_codec_model(name), *STALE_CODEC_SETS[2:], f"train.staleness={s}",
                      f"train.smoothing={m}"), {},
                     ("--schedule", str(work / f"{name}.toml"))))
    for proc in train_together(3, runs, work):
        check_ok(proc)
    return {name: work / name for name in STALE_CODECS}


@pytest.mark.mpi
def test_stale_quantised_training_equals_sylvie(shards, init_of, stale_codec_runs):
    """Sylvie (staleness 1, every stale layer's rows and their gradients stochastically rounded
    to 2 bits) on 3 uneven METIS parts, a 3-layer GCN with dropout: the single-process PipeGCN
    whose halo rows and returned gradients are what the numpy quantiser gives, with the keys of
    the epoch each was sent for (epoch 0 synchronous, quantised too; the first layer's features
    cross once, exactly)."""
    from _pipegcn import pipegcn_losses
    from hpcgnn.data.datasets import load_dataset
    ranks, shard_dir = 3, shards(CSBM, 3, "metis")
    got = [r["loss"] for r in read_metrics(stale_codec_runs["sylvie"])]
    g, parts, init = load_dataset(CSBM), _parts(shard_dir, ranks), init_of(CSBM, STALE_CODEC_SETS)
    model = reference_model(STALE_CODEC_MODEL)
    received, returned = quantised_rows(shard_dir, ranks, 2)
    want = pipegcn_losses(g, parts, init, model, 1, 0.0, EPOCHS, received=received,
                          returned=returned)
    assert len(got) == EPOCHS and got == pytest.approx(want, rel=2e-5)
    fp32 = pipegcn_losses(g, parts, init, model, 1, 0.0, EPOCHS)
    assert got != pytest.approx(fp32, rel=1e-4)            # the quantisation changed the run


@pytest.mark.mpi
def test_stale_sampled_training_equals_pipegcn_of_the_sample(shards, init_of, stale_codec_runs):
    """BNS-GCN's ``sample`` (keep 1/2) on stale layers (staleness 2): the rows used at epoch
    ``t`` are the sample of ``t - 2``, and their gradients must go back through THAT epoch's
    selection (the adjoint of what was sent), not the current one's: the single-process PipeGCN
    fed ``sampled_rows``, on 3 uneven METIS parts, a 3-layer GCN with dropout 0.5."""
    from _pipegcn import pipegcn_losses
    from hpcgnn.data.datasets import load_dataset
    ranks, shard_dir, s = 3, shards(CSBM, 3, "metis"), 2
    got = [r["loss"] for r in read_metrics(stale_codec_runs["sample-s2"])]
    g, parts, init = load_dataset(CSBM), _parts(shard_dir, ranks), init_of(CSBM, STALE_CODEC_SETS)
    model = reference_model(STALE_CODEC_MODEL)
    received, returned = sampled_rows(shard_dir, ranks, 0.5, s)
    want = pipegcn_losses(g, parts, init, model, s, 0.0, EPOCHS, received=received,
                          returned=returned)
    assert len(got) == EPOCHS and got == pytest.approx(want, rel=2e-5)
    fp32 = pipegcn_losses(g, parts, init, model, s, 0.0, EPOCHS)
    assert got != pytest.approx(fp32, rel=1e-4)            # the sample changed the run


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["sylvie-smooth", "truncate-quant-s2-smooth",
                                  "sample-s1-smooth", "sample-sage-s2-smooth"])
def test_smoothed_stale_codec_training_equals_pipegcn(name, shards, init_of, stale_codec_runs):
    """PipeGCN's smoothing (0.5) of stale rows and gradients under a lossy codec: 2-bit rows
    and gradients at staleness 1, the first half of the channels in 2 bits at staleness 2, and
    BNS-GCN's ``sample`` (keep 1/2) at staleness 1 and (GraphSAGE-mean) 2, on 3 uneven METIS
    parts, a 3-layer GCN (or SAGE) with dropout 0.5. What is averaged is what the codec delivered (the decoded rows, a row not sent
    as zeros and a row sent scaled by rows/kept; the decoded gradients summed into their
    owners' rows), the average starting at its first value; the layer drops out the averaged
    rows: the single-process PipeGCN with smoothing fed the numpy codec's rows and gradients."""
    from _pipegcn import pipegcn_losses
    from hpcgnn.data.datasets import load_dataset
    ranks, shard_dir = 3, shards(CSBM, 3, "metis")
    _, s, m = STALE_CODECS[name]
    got = [r["loss"] for r in read_metrics(stale_codec_runs[name])]
    sets = (*stale_codec_model(name), *STALE_CODEC_SETS[2:])
    g, parts, init = load_dataset(CSBM), _parts(shard_dir, ranks), init_of(CSBM, sets)
    assert len(set(np.bincount(parts).tolist())) > 1                      # uneven parts
    model = reference_model(stale_codec_model(name))
    received, returned = (sampled_rows(shard_dir, ranks, 0.5, s) if name.startswith("sample")
                          else quantised_rows(shard_dir, ranks, 2,
                                              ratio=2.0 if "truncate" in name else 1.0))
    params, unsmoothed = {}, {}
    want = pipegcn_losses(g, parts, init, model, s, m, EPOCHS, received=received,
                          returned=returned, params=params)
    assert len(got) == EPOCHS and got == pytest.approx(want, rel=2e-5)
    state = torch.load(stale_codec_runs[name] / "checkpoint.pt", weights_only=True)["model"]
    for key, value in params.items():                 # sharper than the losses' late epochs
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5)
    pipegcn_losses(g, parts, init, model, s, 0.0, EPOCHS, received=received, returned=returned,
                   params=unsmoothed)
    assert max((state[k] - v).abs().max().item() for k, v in unsmoothed.items()) > 1e-3
    fp32 = pipegcn_losses(g, parts, init, model, s, m, EPOCHS)
    assert got != pytest.approx(fp32, rel=1e-4)            # the codec changed the run


# -- VARCO's learned codec against a single-process computation ----------------------------

LEARNED = ('codec = "learned"\nkind = "linear"\nmax_ratio = 4.0\nmin_ratio = 1.0\nslope = 1.0\n'
           'compress_last_layer = true\n')


def learned_reference(shard_dir, ranks: int, init: dict, spec: str = CSBM) -> list[float]:
    """The same GCN on the whole graph, every halo row of layer ``l`` at epoch ``t`` replaced by
    ``D_l([E_l(row)[:k], 0])``: ``E_l``, ``D_l`` linear maps ``F -> F`` that start as the
    identity and train with the model (Adam, no weight decay: train.weight_decay_codec is
    false), ``k = floor(F / r_t)`` with VARCO's ``r_t = max(1, 4 - t * 3 / (EPOCHS - 2))``; no
    map at all where ``k = F`` (ratio 1). Owned rows never pass through the maps. ``spec``: the
    graph of ``shard_dir`` (layer 1 sends ``H W1``, as wide as its classes)."""
    g, a_loc, a_halo = _split_operator(shard_dir, ranks, spec)
    a_cross = sum(a_halo[1:], a_halo[0]).coalesce()
    p = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    codec = {}
    for layer, width in enumerate((g.dense_features().shape[1], int(g.labels.max()) + 1)):
        for name in ("encoder", "decoder"):
            codec[f"layers.{layer}.{name}.weight"] = torch.eye(width).requires_grad_(True)
            codec[f"layers.{layer}.{name}.bias"] = torch.zeros(width).requires_grad_(True)
    opt = torch.optim.Adam([{"params": list(p.values()), "weight_decay": 5e-4},
                            {"params": list(codec.values()), "weight_decay": 0.0}], lr=0.01)

    def propagate(e: torch.Tensor, layer: int, epoch: int) -> torch.Tensor:
        width = e.shape[1]
        ratio = max(1.0, 4.0 - epoch * 3.0 / (EPOCHS - 2))
        k = max(1, min(width, int(width / ratio + 1e-9)))
        sent = e
        if k < width:
            code = (e @ codec[f"layers.{layer}.encoder.weight"].T
                    + codec[f"layers.{layer}.encoder.bias"])[:, :k]
            padded = torch.cat([code, torch.zeros(e.shape[0], width - k)], dim=1)
            sent = (padded @ codec[f"layers.{layer}.decoder.weight"].T
                    + codec[f"layers.{layer}.decoder.bias"])
        return torch.sparse.mm(a_loc, e) + torch.sparse.mm(a_cross, sent)

    return _train(g, p, opt, propagate), codec


@pytest.mark.mpi
def test_learned_training_equals_single_process_computation(shards, init_params, tmp_path):
    """The encoder/decoder pair on real ranks (k = 6, 6, 8, 9, 12, 16 of 24 input channels,
    then ratio 1; 1-2 of 4 in the last layer): the losses of the whole-graph computation above,
    and the checkpoint's trained pair is that computation's."""
    shard_dir = shards(CSBM, 2, "random")
    (tmp_path / "s.toml").write_text(LEARNED)
    check_ok(train(2, shard_dir, tmp_path / "run", *SETS,
                   extra=("--schedule", str(tmp_path / "s.toml")), timeout=180))
    got = [r["loss"] for r in read_metrics(tmp_path / "run")]
    want, codec = learned_reference(shard_dir, 2, init_params)
    assert got == pytest.approx(want, rel=2e-5)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["model"]
    for name, value in codec.items():
        assert not torch.equal(value.detach(), torch.eye(value.shape[0]) if value.ndim == 2
                               else torch.zeros_like(value)), name       # it trained
        torch.testing.assert_close(state[name], value.detach(), rtol=1e-3, atol=1e-4)  # lr 0.01
