"""The methods beyond synchronous training on a directed graph: ``test_directed``'s one-way
lattice (messages flow ``i -> i+1 .. i+3``; METIS parts, not symmetrised, uneven) on 3 real
ranks, where a part receives halo rows from its predecessor only and sends its halo gradients
back the other way. Staleness 1 (GCN, SAGE with three layers, GAT with attention dropout and a
progress thread) and 2 (3-layer GCN with smoothing on the neighbourhood collective, 3-layer GAT
in rounds), dropout 0.5, against
the single-process PipeGCN of ``tests/_pipegcn.py`` on the npz's graph; Sylvie (staleness 1,
1-bit rows and gradients; GCN and GAT) against that PipeGCN fed what a numpy quantiser written in the tests
delivers; VARCO's ``learned`` codec, BNS-GCN's ``sample`` under SAGE's mean and
``sample+random`` under GCN, and ``sample+random`` (3-layer GCN) and ``truncate+quant`` (3-layer
SAGE, 4 bits) with a quantised ``[backward]`` table, against ``test_methods_exact``'s whole-graph computations; the last
evaluation of those runs against a dense stack of their checkpoint; three of the stale runs
stopped and resumed against the uninterrupted ones; RETEXO (GCN; SAGE on the neighbourhood
collective) against the 1-rank run (2, 4, 8 ranks: ``test_directed``); ``hpcgnn predict`` of
synchronous 3-layer GCN, SAGE and GAT runs, of the Sylvie run and of the RETEXO runs, on
3 ranks, against dense whole-graph stacks of their checkpoints (``test_retexo``'s stage-wise
one for RETEXO). Initial parameters: ``conftest.initial_params``. One ``mpiexec`` job
(``conftest.run_together``)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from conftest import check_ok, initial_params, read_metrics, run_together, train_here
from test_directed import RETEXO, assert_one_way, lattice_arrays, owners
from test_methods_exact import COMPRESSED, LEARNED
from test_methods_exact import SETS as EXACT_SETS

SAMPLE = 'codec = "sample"\nkind = "constant"\nratio = 2.0\ncompress_last_layer = true\n'

pytestmark = pytest.mark.mpi

RANKS, EPOCHS = 3, 8
STALE = {  # name -> (model --set list, staleness, smoothing, transport); dropout 0.5
    "gcn": (("model.arch=gcn", "model.hidden=8"), 1, 0.0, "alltoallv"),
    "sage3": (("model.arch=sage", "model.layers=3", "model.hidden=8"), 1, 0.0, "alltoallv"),
    # a progress thread moves the posted exchanges
    "gat": (("model.arch=gat", "model.heads=2", "model.hidden=8", "model.attn_dropout=0.3",
             "comm.progress=thread"), 1, 0.0, "alltoallv"),
    # the dist-graph communicator's in- and out-peers differ on a chain
    "gcn3-s2-smooth-neighbor": (("model.arch=gcn", "model.layers=3", "model.hidden=8"), 2, 0.5,
                                "neighbor"),
    # in rounds of 16 bytes a block (every exchange: 3 ranks x 16 = 48 bytes a call)
    "gat3-s2": (("model.arch=gat", "model.layers=3", "model.heads=2", "model.hidden=4",
                 "model.attn_dropout=0.3", "comm.max_message=48"), 2, 0.0, "alltoallv"),
}
# Sylvie: configs/sylvie.toml's staleness 1 and its schedule, 1-bit rows and gradients
SYLVIE = ("model.arch=gcn", "model.layers=3", "model.hidden=8", "model.dropout=0.5",
          f"train.epochs={EPOCHS}", "train.staleness=1")
# GAT under the same (its stale layers send their input, which attention reads on both sides)
SYLVIE_GAT = ("model.arch=gat", "model.heads=2", "model.hidden=4", "model.attn_dropout=0.3",
              *SYLVIE[3:])
SYLVIE_SCHEDULE = Path(__file__).resolve().parent.parent / "configs/schedules/quant1-all.toml"
# a selecting forward with its own, quantised backward ([backward]), on 3 layers: layer 1 sends
# 4 of its 8 transformed channels (a row of 1 or 2 values quantises exactly: its ends are levels)
SAMPLE_RANDOM_BACK2 = ('codec = "sample+random"\nkeep = 0.5\nkind = "constant"\nratio = 2.0\n'
                       'compress_last_layer = true\n[backward]\ncodec = "quant"\nbits = 2\n')
TRUNCATE4_BACK1 = ('codec = "truncate+quant"\nbits = 4\nkind = "constant"\nratio = 2.0\n'
                   'compress_last_layer = true\n[backward]\ncodec = "quant"\nbits = 1\n')
THREE = ("model.layers=3", "model.hidden=8", *EXACT_SETS[3:])
# name -> (--set list, schedule, keywords of test_methods_exact.compressed_reference or None for
# the learned codec): test_methods_exact's 2-layer model, its schedules
SELECTED = {"learned": (EXACT_SETS, LEARNED, None),
            # BNS-GCN's sample under SAGE's mean: 1 / the whole in-degree (not the out-degree)
            "sample-sage": (("model.arch=sage", *EXACT_SETS[1:]), SAMPLE,
                            {"channels": "all", "arch": "sage"}),
            "sample-random-gcn": (EXACT_SETS, COMPRESSED, {"channels": "random", "arch": "gcn"}),
            "sample-random-gcn3-back2": (("model.arch=gcn", *THREE), SAMPLE_RANDOM_BACK2,
                                         {"channels": "random", "arch": "gcn",
                                          "backward_bits": 2}),
            "truncate-quant4-sage3-back1": (("model.arch=sage", *THREE), TRUNCATE4_BACK1,
                                            {"channels": "truncate", "arch": "sage",
                                             "keep": 1.0, "forward_bits": 4,
                                             "backward_bits": 1})}
# synchronous runs whose predictions are checked against dense stacks (GCN, SAGE, GAT)
PREDICT = {"sync": ("model.arch=gcn", "model.layers=3", "model.hidden=6", "train.epochs=4"),
           "sync-sage": ("model.arch=sage", "model.layers=3", "model.hidden=6", "train.epochs=4"),
           "sync-gat": ("model.arch=gat", "model.layers=3", "model.heads=2", "model.hidden=4",
                        "model.attn_dropout=0.3", "train.epochs=4")}


# stale runs also stopped after that many epochs and resumed: the rows and gradients in flight
# (a rank file each) travel one way down the chain, the other way up it
RESUMED = {"stale-gcn3-s2-smooth-neighbor": 3, "stale-gat3-s2": 4, "sylvie": 3}


def stale_sets(name: str) -> tuple[str, ...]:
    return (*STALE[name][0], "model.dropout=0.5", f"train.epochs={EPOCHS}")


@pytest.fixture(scope="module")
def lattice_spec(tmp_path_factory) -> str:
    """The ``--dataset`` spec of the one-way lattice's npz."""
    path = tmp_path_factory.mktemp("lattice") / "lattice.npz"
    np.savez(path, **lattice_arrays())
    return f"npz:{path}"


@pytest.fixture(scope="module")
def lattice(shards, lattice_spec):
    """(arrays, graph, 1-part and 3-part shard dirs) of the one-way lattice, from its npz."""
    from hpcgnn.data.datasets import load_dataset
    return (lattice_arrays(), load_dataset(lattice_spec), shards(lattice_spec, 1),
            shards(lattice_spec, RANKS, "metis"))


@pytest.fixture(scope="module")
def runs(lattice, tmp_path_factory):
    """name -> run (or predictions) dir; the job's results all checked to have succeeded."""
    three = lattice[3]
    work = tmp_path_factory.mktemp("jobs")
    out = {}
    commands = []

    def add(name, argv):
        out[name] = work / name
        commands.append((argv + ["--out", out[name]], {}))
        if name in RESUMED:                      # the same run stopped, then resumed
            out[f"resumed-{name}"] = work / f"resumed-{name}"
            for more in (["--stop-after", str(RESUMED[name])], ["--resume"]):
                commands.append((argv + ["--out", out[f"resumed-{name}"], *more], {}))

    def train(name, sets):
        add(name, ["train", "--shards", three, *(a for s in sets for a in ("--set", s))])

    for name, (_, s, m, transport) in STALE.items():
        train(f"stale-{name}", (*stale_sets(name), f"train.staleness={s}",
                                f"train.smoothing={m}", f"comm.transport={transport}"))
    for arch, transport in (("gcn", "alltoallv"), ("sage", "neighbor")):
        train(f"retexo-{arch}", (*RETEXO, f"model.arch={arch}", f"comm.transport={transport}"))
    for name, sets in PREDICT.items():
        train(name, sets)
    for name in (*PREDICT, "retexo-gcn", "retexo-sage"):
        add(f"predict-{name}", ["predict", "--run", out[name], "--shards", three])
    add("sylvie", ["train", "--shards", three, "--schedule", SYLVIE_SCHEDULE,
                   *(a for s in SYLVIE for a in ("--set", s))])
    add("predict-sylvie", ["predict", "--run", out["sylvie"], "--shards", three])
    add("sylvie-gat", ["train", "--shards", three, "--schedule", SYLVIE_SCHEDULE,
                       *(a for s in SYLVIE_GAT for a in ("--set", s))])
    for name, (sets, text, _) in SELECTED.items():
        (work / f"{name}.toml").write_text(text)
        add(name, ["train", "--shards", three, "--schedule", work / f"{name}.toml",
                   *(a for s in sets for a in ("--set", s))])
    for proc in run_together(RANKS, commands, work / "batch"):
        check_ok(proc)
    return out


def test_the_parts_are_one_way_and_uneven(lattice):
    arrays, graph, _, three = lattice
    own = owners(three, RANKS, graph.num_nodes)
    assert_one_way(arrays, own, RANKS)
    assert len(set(np.bincount(own).tolist())) > 1


@pytest.mark.parametrize("name", list(STALE))
def test_stale_training_equals_pipegcn(name, lattice, runs, tmp_path):
    """Halo rows posted s epochs ago flow down the chain, their gradients up it s epochs
    later: the losses of PipeGCN's whole-graph computation over the same parts."""
    from _pipegcn import pipegcn_losses
    from test_methods_exact import reference_model
    _, graph, one, three = lattice
    init = initial_params(one, *stale_sets(name))    # (the lattice's first node has no in-edge)
    got = [r["loss"] for r in read_metrics(runs[f"stale-{name}"])]
    parts = owners(three, RANKS, graph.num_nodes)
    model_sets, s, m, transport = STALE[name]
    model = reference_model(model_sets)
    assert got == pytest.approx(pipegcn_losses(graph, parts, init, model, s, m, EPOCHS),
                                rel=2e-5), name
    sync = pipegcn_losses(graph, parts, init, model, 0, 0.0, EPOCHS)
    assert got[s:] != pytest.approx(sync[s:], rel=1e-4)    # staleness changed the trajectory
    summary = json.loads((runs[f"stale-{name}"] / "summary.json").read_text())
    assert summary["transport"] == transport
    assert_last_evaluation_is_dense(runs[f"stale-{name}"], model_sets, lattice[0])


def assert_last_evaluation_is_dense(run, sets, arrays) -> None:
    """The last epoch's evaluation (exchanges of the current rows, uncompressed: a stale or
    compressed run evaluates synchronously) gives the accuracies of the dense whole-graph
    stack of the final checkpoint."""
    state = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    pred = dense_stack(sets, state, arrays)[1].argmax(1)
    last = read_metrics(run)[-1]
    for split in ("train", "val", "test"):
        idx = arrays[f"{split}_idx"]
        assert last[f"{split}_acc"] == pytest.approx(float((pred[idx] == arrays["labels"][idx]).mean()),
                                                     abs=1e-9), (run.name, split)


@pytest.mark.parametrize("name", list(RESUMED))
def test_stopped_and_resumed_stale_runs_continue_exactly(name, runs):
    """``--stop-after`` then ``--resume`` of a stale run ends where the uninterrupted run does,
    bit for bit: metrics (timings aside), checkpoint tensors, summary's accuracies and bytes."""
    from test_resume_exact import same_runs
    same_runs(runs[name], runs[f"resumed-{name}"], EPOCHS)


@pytest.mark.parametrize("name", ["sylvie", "sylvie-gat"])
def test_sylvie_equals_pipegcn_with_one_bit_rows(name, lattice, runs):
    """Sylvie (configs/sylvie.toml's staleness 1 with quant1-all: every exchange's rows and
    gradients stochastically rounded to 1 bit) where halo rows flow down the chain and their
    gradients up it: PipeGCN over the same parts fed what the numpy quantiser of
    docs/compression.md (``test_codecs.ref_quant``, keys ``test_exchange_exact.mix``) gives,
    each sender's whole buffer quantised with its own key and each receiver's gradients with
    its own."""
    from _pipegcn import pipegcn_losses
    from test_methods_exact import quantised_rows, reference_model
    _, graph, one, three = lattice
    sets = {"sylvie": SYLVIE, "sylvie-gat": SYLVIE_GAT}[name]
    model_sets = sets[:-3]                                 # the model's keys, dropout aside
    init = initial_params(one, *sets)
    got = [r["loss"] for r in read_metrics(runs[name])]
    parts, model = owners(three, RANKS, graph.num_nodes), reference_model(model_sets)
    received, returned = quantised_rows(three, RANKS, 1)
    want = pipegcn_losses(graph, parts, init, model, 1, 0.0, EPOCHS, received=received,
                          returned=returned)
    assert len(got) == EPOCHS and got == pytest.approx(want, rel=2e-5)
    fp32 = pipegcn_losses(graph, parts, init, model, 1, 0.0, EPOCHS)
    assert got != pytest.approx(fp32, rel=1e-3)              # the 1-bit rows changed the run
    assert_last_evaluation_is_dense(runs[name], model_sets, lattice[0])


def test_learned_codec_equals_whole_graph_computation(lattice, lattice_spec, runs):
    """VARCO's learned encoder/decoder pair on the cut edges of the directed graph (its halo
    rows' gradients reach the pair through the backward's other peers): the losses of
    ``test_methods_exact.learned_reference``'s whole-graph GCN, and the checkpoint's pair is
    the one that computation trained."""
    from test_methods_exact import learned_reference
    _, _, one, three = lattice
    got = [r["loss"] for r in read_metrics(runs["learned"])]
    want, codec = learned_reference(three, RANKS, initial_params(one, *EXACT_SETS), lattice_spec)
    assert len(got) == EPOCHS and got == pytest.approx(want, rel=2e-5)
    state = torch.load(runs["learned"] / "checkpoint.pt", weights_only=True)["model"]
    for name, value in codec.items():
        assert not torch.equal(value.detach(), torch.eye(value.shape[0]) if value.ndim == 2
                               else torch.zeros_like(value)), name       # it trained
        torch.testing.assert_close(state[name], value.detach(), rtol=1e-3, atol=1e-4)
    assert_last_evaluation_is_dense(runs["learned"], EXACT_SETS, lattice[0])


@pytest.mark.parametrize("name", [k for k, v in SELECTED.items() if v[2]])
def test_row_selection_equals_whole_graph_computation(name, lattice, lattice_spec, runs):
    """BNS-GCN's ``sample`` (SAGE: the kept halo rows scaled, the sum over the whole
    in-degree), ``sample+random`` (GCN) and ``truncate+quant`` (SAGE, 4 bits) where a part
    receives from its predecessor only, the last two also with a ``[backward]`` table that
    quantises the halo gradients of the rows and channels sent (2 and 1 bits):
    ``test_methods_exact.compressed_reference``'s whole-graph model fed the documented
    selection and, backward, its adjoint through the numpy quantiser: the losses, and the
    checkpoint's parameters (which tell the backward's rounding apart more sharply)."""
    from test_methods_exact import compressed_reference
    sets, _, kw = SELECTED[name]
    _, _, one, three = lattice
    got = [r["loss"] for r in read_metrics(runs[name])]
    init, params = initial_params(one, *sets), {}
    want = compressed_reference(three, RANKS, init, lattice_spec, **kw, params=params)
    assert len(got) == EPOCHS and got == pytest.approx(want, rel=2e-5)
    state = torch.load(runs[name] / "checkpoint.pt", weights_only=True)["model"]
    for key, value in params.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5)
    if kw.get("backward_bits", 32) < 32:                # the quantised gradients changed the run
        fp32 = {}
        compressed_reference(three, RANKS, init, lattice_spec, **{**kw, "backward_bits": 32},
                             params=fp32)
        assert max((state[k] - v).abs().max().item() for k, v in fp32.items()) > 1e-3
    assert_last_evaluation_is_dense(runs[name], sets, lattice[0])


@pytest.mark.parametrize("arch", ["gcn", "sage"])
def test_retexo_equals_one_rank(arch, lattice, runs, tmp_path):
    """RETEXO's per-stage embeddings cross the cut one way: 3 ranks give the 1-rank losses and
    accuracies (the 3-rank GCN checkpoint against a dense stack: the predict test below)."""
    one = lattice[2]
    want = train_here(one, tmp_path / "one", *RETEXO, f"model.arch={arch}", config=None)
    got = read_metrics(runs[f"retexo-{arch}"])
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=2e-5)
    for key in ("val_acc", "test_acc"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], abs=1e-9)


def dense_stack(sets: tuple[str, ...], state: dict, arrays: dict):
    """(last hidden layer's output after its activation, logits) of the model of ``sets`` with
    ``state``'s weights on the whole graph of ``arrays``, in evaluation (no dropout of either
    kind): ``tests/_pipegcn.py``'s whole-graph layers (GCN, SAGE's mean over in-neighbours,
    GAT's dense softmax over in-neighbours and the node itself), not hpcgnn's."""
    from dataclasses import replace

    from _graphs import dense_gcn
    from _pipegcn import graph_ops, layer_fn
    from test_directed import as_graph
    from test_methods_exact import reference_model
    model = replace(reference_model(sets), dropout=0.0, attn_dropout=0.0)
    if model.arch == "gcn":
        return dense_gcn(arrays, state)                       # float64, Kipf & Welling's formula
    ops, h, hidden = graph_ops(as_graph(arrays)), torch.from_numpy(arrays["features"]), None
    act = torch.nn.functional.elu if model.arch == "gat" else torch.relu
    with torch.no_grad():
        for layer in range(model.layers):
            h = layer_fn(h, state, layer, model, ops, 0)
            if layer < model.layers - 1:
                h = hidden = act(h)
    return hidden.numpy(), h.numpy()


@pytest.mark.parametrize("name", [*PREDICT, "sylvie"])
def test_predict_equals_dense_stacks(name, lattice, runs):
    """``hpcgnn predict`` on 3 ranks of a synchronous run (and of the Sylvie run, whose
    features' halo rows training kept): its logits and last hidden rows are dense whole-graph
    products of the checkpoint's weights with the directed graph's operator, not its
    transpose's."""
    from hpcgnn.predict import read_predictions
    arrays, sets = lattice[0], {**PREDICT, "sylvie": SYLVIE[:3]}[name]
    state = torch.load(runs[name] / "checkpoint.pt", weights_only=True)["model"]
    hidden, logits = dense_stack(sets, state, arrays)
    got = read_predictions(runs[f"predict-{name}"])
    np.testing.assert_allclose(got["logits"], logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["embedding"], hidden, rtol=1e-4, atol=1e-5)
    transposed = dense_stack(sets, state, {**arrays, **transpose(arrays)})[1]
    assert not np.allclose(transposed, logits, rtol=1e-3, atol=1e-3)     # direction matters


@pytest.mark.parametrize("arch", ["gcn", "sage"])
def test_predict_of_retexo_equals_dense_stages(arch, lattice, lattice_spec, runs):
    """``hpcgnn predict`` of the 3-rank RETEXO runs: logits and embedding of
    ``test_retexo``'s stage-wise dense stack with the directed operator."""
    from hpcgnn.predict import read_predictions
    from test_retexo import dense_stage, operator
    arrays = lattice[0]
    state = torch.load(runs[f"retexo-{arch}"] / "checkpoint.pt", weights_only=True)["model"]
    op = operator(arch, lattice_spec)[0]
    x = torch.from_numpy(arrays["features"])
    with torch.no_grad():
        for s in range(2):
            x = dense_stage(arch, state, s, op, x)[1]
        logits = dense_stage(arch, state, 2, op, x)[0]
    got = read_predictions(runs[f"predict-retexo-{arch}"])
    np.testing.assert_allclose(got["embedding"], x.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["logits"], logits.numpy(), rtol=1e-4, atol=1e-5)


def transpose(arrays: dict) -> dict:
    """The CSR arrays of the reversed graph."""
    n = int(arrays["num_nodes"])
    a = sp.csr_matrix((np.ones(len(arrays["adj_indices"])), arrays["adj_indices"],
                       arrays["adj_indptr"]), shape=(n, n)).T.tocsr()
    a.sort_indices()
    return {"adj_indptr": a.indptr.astype(np.int64), "adj_indices": a.indices.astype(np.int64)}
