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
SAGE, 4 bits) with a quantised ``[backward]`` table, against ``test_methods_exact``'s
whole-graph computations; the last
evaluation of those runs against a dense stack of their checkpoint; evaluation through the
training codecs (``train.eval_codec = "train"``: truncate+quant, sample, sample+random, quant on
GCN, SAGE and GAT, the learned pair on GCN and GAT, ``kind = "auto"``'s bits on GCN and GAT,
two stale runs and two with ``train.keep_features``, one of each evaluating its first layer on
kept rows) against the
whole-graph model of the checkpoint fed what the numpy codecs of ``test_codecs`` deliver with
the last epoch's keys, and four of them trained bit for bit as when evaluated uncompressed; a
synchronous GCN, a stale SAGE, and a synchronous SAGE and GAT (attention
dropout) evaluating on kept feature rows, evaluated every 4 epochs, against
the whole-graph training evaluated after each step (which epochs, their figures, the best
validation's epoch and test accuracy in ``summary.json``), and a RETEXO SAGE evaluated every
2 rounds against ``test_retexo``'s stage-wise training keeping each stage's best evaluated
round, and RETEXO (GCN, SAGE) through a schedule against that training on what the numpy codecs
deliver at each stage's one exchange; three of the stale runs
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
    # a progress thread moves the posted exchanges; 2 x 20 channels, wider than the C pass of
    # dropout and product takes (32): the dropout, then the product, as on a GPU rank
    "gat": (("model.arch=gat", "model.heads=2", "model.hidden=20", "model.attn_dropout=0.3",
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


# evaluation through the training codecs (train.eval_codec = "train"), 3 epochs each: every
# codec family on each layer of GCN, SAGE and GAT (2 heads); the first layer exchanges the 6
# features, the second its transformed rows (3 wide: the classes)
EVAL_SCHEDULES = {
    "tq-sample": ('codec = "truncate+quant"\nbits = 4\nkind = "constant"\nratio = 2.0\n'
                  'compress_last_layer = true\n[layers.1]\ncodec = "sample"\nratio = 2.0\n'),
    "sr-quant": ('codec = "sample+random"\nkeep = 0.5\nkind = "constant"\nratio = 2.0\n'
                 'compress_last_layer = true\n[layers.1]\ncodec = "quant"\nbits = 2\n'),
    "learned": 'codec = "learned"\nkind = "constant"\nratio = 2.0\ncompress_last_layer = true\n',
    # quant at the bits it decides (the records say which, test_eval_codec.bits_in_force)
    "auto": 'kind = "auto"\nobjective = "bytes"\nevery = 2\n',
}
EVAL_ARCHS = {"gcn": ("model.arch=gcn", "model.hidden=8"),
              "sage": ("model.arch=sage", "model.hidden=8"),
              "gat": ("model.arch=gat", "model.heads=2", "model.hidden=4")}
EVAL_EPOCHS = 3
# per schedule and layer: (keep, channels, bits[, ratio, 2 if left out]); channels ``truncate``,
# ``random`` and ``learned`` keep k = max(1, floor(width / ratio)) channels
EVAL_CODECS = {"tq-sample": [(1.0, "truncate", 4), (0.5, "all", 32)],
               "sr-quant": [(0.5, "random", 32), (1.0, "all", 2)],
               "learned": [(1.0, "learned", 32)] * 2, "auto": None}


# name -> (arch, schedule, more --set, whether evaluation's first layer is on exact kept rows):
# the synchronous runs, and stale ones, whose evaluation exchanges synchronously through codecs
# made for the synchronous rows (3 wide where training sends layer 1's 8-wide input), its first
# layer's exchange too (``exchange``) or on the features' halo rows training keeps (``auto``)
EVAL_RUNS = {f"{arch}-{sched}": (arch, sched, (), False)
             for sched in EVAL_SCHEDULES for arch in EVAL_ARCHS
             if sched not in ("learned", "auto") or arch != "sage"}
EVAL_RUNS.update({
    "stale-gcn-sr-quant": ("gcn", "sr-quant", ("train.staleness=1", "train.eval_features=exchange"),
                           False),
    "stale-sage-sr-quant-kept": ("sage", "sr-quant", ("train.staleness=1",), True),
    # train.keep_features: training never exchanges the first layer; evaluation through the
    # codecs does where asked (exchange), or evaluates it on the kept rows (auto)
    "keep-gcn-sr-quant": ("gcn", "sr-quant", ("train.keep_features=true",
                                              "train.eval_features=exchange"), False),
    "keep-gat-tq-sample-kept": ("gat", "tq-sample", ("train.keep_features=true",), True)})


# runs trained again with train.eval_codec = "none": evaluation must leave training alone
EVAL_TWINS = ("gcn-sr-quant", "gat-tq-sample", "stale-gcn-sr-quant", "stale-sage-sr-quant-kept")


def eval_sets(arch: str) -> tuple[str, ...]:
    return (*EVAL_ARCHS[arch], "model.layers=2", "model.dropout=0.5",
            f"train.epochs={EVAL_EPOCHS}", "train.eval_codec=train")


# evaluated every 4 epochs (3, 7 and the last, 9): synchronous and stale, dropout 0.5; and
# synchronous runs evaluating their first layer on kept feature rows (train.eval_features)
EVERY = {"every-4": ("model.arch=gcn", "model.hidden=8"),
         "every-4-stale-sage": ("model.arch=sage", "model.hidden=8", "train.staleness=1"),
         "every-4-kept-sage": ("model.arch=sage", "model.hidden=8", "train.eval_features=kept"),
         "every-4-kept-gat": ("model.arch=gat", "model.heads=2", "model.hidden=4",
                              "model.attn_dropout=0.3", "train.eval_features=kept")}
EVERY_SETS = ("model.dropout=0.5", "train.epochs=10", "train.eval_every=4", "train.lr=0.05")


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
    train("retexo-sage-every-2", (*RETEXO, "model.arch=sage", "train.eval_every=2"))
    (work / "retexo-sr-quant.toml").write_text(EVAL_SCHEDULES["sr-quant"])
    for arch in ("gcn", "sage"):
        add(f"retexo-{arch}-sr-quant", ["train", "--shards", three, "--schedule",
                                        work / "retexo-sr-quant.toml",
                                        *(a for s in (*RETEXO, f"model.arch={arch}")
                                          for a in ("--set", s))])
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
    for sched, text in EVAL_SCHEDULES.items():
        (work / f"eval-{sched}.toml").write_text(text)
    for name, (arch, sched, more, _) in EVAL_RUNS.items():
        add(f"eval-{name}", ["train", "--shards", three, "--schedule", work / f"eval-{sched}.toml",
                             *(a for s in (*eval_sets(arch), *more) for a in ("--set", s))])
        if name in EVAL_TWINS:               # the same training, evaluated uncompressed
            add(f"eval-{name}-none", ["train", "--shards", three, "--schedule",
                                      work / f"eval-{sched}.toml",
                                      *(a for s in (*eval_sets(arch), *more,
                                                    "train.eval_codec=none")
                                        for a in ("--set", s))])
    for name, sets in EVERY.items():
        train(name, (*sets, *EVERY_SETS))
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


def received_view(shards: list, q: int, layer: int, epoch: int, rows: np.ndarray,
                  codec: tuple, scaled: bool, pair: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(view, kept)``: ``rows`` ``(N, w)`` float32 (what every node's owner sends in this
    exchange) as part ``q`` sees them, each of its halo rows replaced by what the documented
    codec delivers (docs/compression.md), and ``kept`` (N,) False for a halo row its block's
    sample left out. Each sender ``p`` gathers, block by block in peer order, the kept rows of
    its send buffer ``rows[global_id[send_index]]`` and their channels (the first ``k``,
    ``test_codecs.ref_channels``' draw from the block's channel key, or all), quantises that
    whole buffer with the noise key ``mix(seed 0, epoch, layer, 0, p)`` (``ref_quant``), and the
    receiver puts each row back, scaled by ``rows / kept`` where ``scaled``. ``learned``
    (VARCO): the first ``k`` channels of the encoder's output ``E(row)``, the decoder's
    ``D([code, 0])`` back (``pair``: the checkpoint's ``layers.L.encoder/decoder``, nn.Linear)."""
    from test_codecs import ref_channels, ref_kept_rows, ref_quant
    from test_exchange_exact import mix
    from test_methods_exact import _block_keys
    keep, channels, bits, ratio = (*codec, 2)[:4]
    n, width = rows.shape
    k = max(1, int(width // ratio))                         # floor(F / ratio) channels
    view, kept = rows.astype(np.float64).copy(), np.ones(n, dtype=bool)
    if channels == "learned":                           # the encoder runs before the wire
        rows = (rows @ pair[f"layers.{layer}.encoder.weight"].T
                + pair[f"layers.{layer}.encoder.bias"]).astype(np.float32)
    start = 0
    for p, count in enumerate(shards[q].recv_counts.tolist()):
        if not count:
            continue
        sp_ = shards[p]
        sent, offset, ours = [], 0, None
        for dst, block in enumerate(sp_.send_counts.tolist()):
            if not block:
                continue
            row_key, chan_key = _block_keys(0, layer, p, dst, epoch)
            pick = ref_kept_rows(row_key, block, keep) if keep < 1 else list(range(block))
            chans = {"all": list(range(width)), "truncate": list(range(k)),
                     "learned": list(range(k)),
                     "random": ref_channels(chan_key, width, k) if channels == "random" else []
                     }[channels]
            index = sp_.global_id[sp_.send_index[offset:offset + block]]
            if dst == q:
                ours = (len(sent), pick, chans, index)
            sent += [rows[index[r]][chans] for r in pick]
            offset += block
        buf = np.asarray(sent, dtype=np.float32)
        if bits != 32:
            buf = ref_quant(buf, bits, mix(0, epoch, layer, 0, p))
        at, pick, chans, index = ours
        gid = shards[q].halo_global_id[start:start + count]
        assert np.array_equal(np.sort(index), np.sort(gid))        # the same block both ways
        view[gid] = 0.0
        kept[gid] = False
        scale = count / len(pick) if scaled else 1.0
        for j, r in enumerate(pick):
            view[index[r], chans] = buf[at + j] * scale
            kept[index[r]] = True
        if channels == "learned":
            view[gid] = (view[gid] @ pair[f"layers.{layer}.decoder.weight"].T
                         + pair[f"layers.{layer}.decoder.bias"])
        start += count
    return view, kept


def eval_through_codecs(arch: str, codecs: list, state: dict, arrays: dict, shard_dir,
                        epoch: int) -> np.ndarray:
    """Logits ``(N, C)`` of the evaluation of ``epoch`` of a run with ``train.eval_codec =
    "train"``: every part's owned rows of the whole-graph model with ``state``'s weights (no
    dropout), its halo rows as ``received_view`` delivers them through each layer's codec
    (``codecs``: ``EVAL_CODECS``' form, optionally with the ratio fourth (2 otherwise), None for
    exact rows) at ``epoch``'s keys. A layer exchanges its transformed rows ``h W`` (SAGE: ``h
    W_n``) where twice their width is at most its input's (layer 0, whose input needs no
    gradient: at most the input width; the lattice's 6 features are exchanged, GAT's receiver
    transforms them), else its input; GCN's ``D^-1/2 (A + I) D^-1/2``,
    SAGE's mean over the whole in-degree, GAT's softmax over the kept in-neighbours and the
    node itself (BNS-GCN's sampled graph: unscaled rows), heads concatenated, then averaged."""
    from hpcgnn.data.shard import read_shard
    from test_directed import as_graph
    from test_methods_exact import _gcn_operator, _mean_operator
    parts = len(list(Path(shard_dir).glob("part-*.h5")))
    shards = [read_shard(Path(shard_dir) / f"part-{p:05d}.h5") for p in range(parts)]
    g = as_graph(arrays)
    n = g.num_nodes
    adj = np.zeros((n, n), dtype=bool)
    adj[np.repeat(np.arange(n), np.diff(g.indptr)), g.indices] = True
    op = {"gcn": _gcn_operator, "sage": _mean_operator}.get(arch, lambda _: None)(g)
    w = {k: v.double().numpy() for k, v in state.items()}
    x32 = arrays["features"].astype(np.float32)

    def gat(layer: int, h: np.ndarray, kept: np.ndarray, owned: np.ndarray) -> np.ndarray:
        hh = h.reshape(n, w[f"layers.{layer}.att_src"].shape[0], -1)
        s = (hh * w[f"layers.{layer}.att_src"]).sum(-1)
        d = (hh * w[f"layers.{layer}.att_dst"]).sum(-1)
        out = np.zeros((len(owned), *hh.shape[1:]))
        for row, i in enumerate(owned):
            nbr = np.append(np.flatnonzero(adj[i] & kept), i)
            e = d[i] + s[nbr]
            e = np.where(e > 0, e, 0.2 * e)
            a = np.exp(e - e.max(0))
            out[row] = np.einsum("jh,jhc->hc", a / a.sum(0), hh[nbr])
        return out.reshape(len(owned), -1) if layer == 0 else out.mean(1)

    def layer(i: int, x: np.ndarray, q: int, owned: np.ndarray) -> np.ndarray:
        wt, b = w[f"layers.{i}.weight"], w[f"layers.{i}.bias"]
        out = wt.shape[1] // 2 if arch == "sage" else wt.shape[1]
        transform = 2 * out <= wt.shape[0] * (2 if i else 1)        # hpcgnn's choose_order
        sent = (x @ wt[:, out:] if arch == "sage" else x @ wt) if transform else x
        view, kept = (sent, np.ones(n, dtype=bool)) if codecs[i] is None else \
            received_view(shards, q, i, epoch, sent.astype(np.float32), codecs[i],
                          scaled=arch != "gat", pair=w)
        if arch == "gcn":
            agg = op[owned] @ view
            return (agg if transform else agg @ wt) + b
        if arch == "sage":
            agg = op[owned] @ view
            return x[owned] @ wt[:, :out] + (agg if transform else agg @ wt[:, out:]) + b
        return gat(i, view if transform else view @ wt, kept, owned) + b

    hidden = np.zeros((n, w["layers.0.bias"].shape[0]))
    for q, sq in enumerate(shards):
        h = layer(0, x32.astype(np.float64), q, sq.global_id)
        hidden[sq.global_id] = np.where(h > 0, h, np.expm1(np.minimum(h, 0))) if arch == "gat" \
            else np.maximum(h, 0.0)
    logits = np.zeros((n, w["layers.1.bias"].shape[0]))
    for q, sq in enumerate(shards):
        logits[sq.global_id] = layer(1, hidden, q, sq.global_id)
    return logits


def split_figures(logits: np.ndarray, arrays: dict) -> dict:
    """Accuracies of every split and the mean validation cross-entropy of ``logits``."""
    labels, out = arrays["labels"], {}
    for split in ("train", "val", "test"):
        idx = arrays[f"{split}_idx"]
        out[f"{split}_acc"] = float((logits[idx].argmax(1) == labels[idx]).mean())
    idx = arrays["val_idx"]
    z = logits[idx] - logits[idx].max(1, keepdims=True)
    out["val_loss"] = float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(idx)), labels[idx]]))
    return out


@pytest.mark.parametrize("name", list(EVAL_RUNS))
def test_evaluation_through_the_training_codecs_equals_whole_graph(name, lattice, runs):
    """``train.eval_codec = "train"`` on the one-way lattice's uneven parts, synchronous and
    stale: the last evaluation's accuracies and validation loss are those of the whole-graph
    model with the checkpoint's weights whose halo rows are what the documented codecs deliver
    with the last epoch's keys (``eval_through_codecs``, numpy), and not those of the
    uncompressed model."""
    from test_eval_codec import bits_in_force
    arrays, three = lattice[0], lattice[3]
    arch, sched, _, kept_first = EVAL_RUNS[name]
    run = runs[f"eval-{name}"]
    state = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    metrics = read_metrics(run)
    last = metrics[-1]
    assert last["epoch"] == EVAL_EPOCHS - 1
    codecs = EVAL_CODECS[sched]
    if sched == "auto":                       # the forward bits in force at the last epoch
        bits = list(bits_in_force(metrics))[-1][1]
        codecs = [(1.0, "all", bits.get(f"{i}/forward", 32)) for i in range(2)]
        assert any(c[2] != 32 for c in codecs), bits
    if kept_first:
        codecs = [None, *codecs[1:]]
    want = split_figures(eval_through_codecs(arch, codecs, state, arrays, three, last["epoch"]),
                         arrays)
    for split in ("train", "val", "test"):
        assert last[f"{split}_acc"] == pytest.approx(want[f"{split}_acc"], abs=1e-9), split
    plain = split_figures(dense_stack(eval_sets(arch)[:-3], state, arrays)[1], arrays)
    assert last["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    # the codecs count: a few halo rows cross the lattice's cuts, 2-bit rows move the loss 1e-5
    assert last["val_loss"] != pytest.approx(plain["val_loss"], rel=5e-6)


@pytest.mark.parametrize("name", list(EVERY))
def test_evaluated_every_4_epochs_selects_the_best_evaluation(name, lattice, runs):
    """``train.eval_every = 4`` over 10 epochs: the ranks evaluate after the steps of epochs 3,
    7 and 9 (the last) only, each evaluation (its first layer on exchanged or kept feature
    rows) giving the accuracies and validation loss of the whole-graph model
    (``tests/_pipegcn.py``, synchronous or PipeGCN's staleness 1, trained here) after that
    epoch's step, without dropout of either kind; ``summary.json``'s ``best_epoch``,
    ``best_val_acc`` and ``test_acc`` are those of the first evaluated epoch of the highest
    validation accuracy, ``final_test_acc`` the last one's."""
    from _pipegcn import pipegcn_losses
    from test_methods_exact import reference_model
    arrays, graph, one, three = lattice
    sets = (*EVERY[name], *EVERY_SETS)
    model_sets = tuple(s for s in sets if s.startswith("model.") and "model.dropout" not in s)
    s = int(dict(x.split("=") for x in sets).get("train.staleness", 0))
    figures = {}

    def evaluate(epoch, params):
        figures[epoch] = split_figures(dense_stack(model_sets, params, arrays)[1], arrays)
    init = initial_params(one, *sets)
    losses = pipegcn_losses(graph, owners(three, RANKS, graph.num_nodes), init,
                            reference_model(model_sets), s, 0.0, 10, lr=0.05, after_step=evaluate)
    lines = read_metrics(runs[name])
    assert [r["loss"] for r in lines] == pytest.approx(losses, rel=2e-5)
    evaluated = [r for r in lines if "val_acc" in r]
    assert [r["epoch"] for r in evaluated] == [3, 7, 9]
    for r in evaluated:
        want = figures[r["epoch"]]
        for key in ("train_acc", "val_acc", "test_acc"):
            assert r[key] == pytest.approx(want[key], abs=1e-9), (r["epoch"], key)
        assert r["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5), r["epoch"]
    best = max((3, 7, 9), key=lambda e: (figures[e]["val_acc"], -e))
    summary = json.loads((runs[name] / "summary.json").read_text())
    assert (summary["best_epoch"], summary["best_val_acc"], summary["test_acc"],
            summary["final_test_acc"]) == (best, pytest.approx(figures[best]["val_acc"]),
                                           pytest.approx(figures[best]["test_acc"]),
                                           pytest.approx(figures[9]["test_acc"]))


def test_retexo_evaluated_every_2_rounds_keeps_each_stages_best_evaluation(lattice, lattice_spec,
                                                                           runs):
    """RETEXO with ``train.eval_every = 2`` (3 stages of 3 rounds: rounds 1, 2, 3, 5, 7 and 8
    evaluated, every stage's last among them): ``test_retexo.dense_retexo``'s stage-wise
    whole-graph training, each stage's state the best among its evaluated rounds only: the
    losses, the validation accuracies where evaluated, the final checkpoint's stages."""
    from test_retexo import dense_retexo
    one = lattice[2]
    sets = (*RETEXO, "model.arch=sage")
    losses, vals, final = dense_retexo("sage", initial_params(one, *sets), spec=lattice_spec,
                                       every=2)
    got = read_metrics(runs["retexo-sage-every-2"])
    assert [r["loss"] for r in got] == pytest.approx(losses, rel=2e-5)
    assert [e for e, v in enumerate(vals) if v is not None] == [1, 2, 3, 5, 7, 8]
    assert [r.get("val_acc") for r in got] == [None if v is None else pytest.approx(v, abs=1e-6)
                                               for v in vals]
    state = torch.load(runs["retexo-sage-every-2"] / "checkpoint.pt", weights_only=True)["model"]
    for k, v in final.items():
        torch.testing.assert_close(state[k], v.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", EVAL_TWINS)
def test_evaluation_through_the_codecs_leaves_training_alone(name, runs):
    """The same run evaluated uncompressed trains bit for bit alike (losses, bytes, final
    weights): evaluation's exchanges through the codecs, between a stale layer's posted
    exchange and its wait too, touch nothing training sends or keeps; only ``eval_bytes`` and
    the evaluated figures differ."""
    through, plain = read_metrics(runs[f"eval-{name}"]), read_metrics(runs[f"eval-{name}-none"])
    for key in ("loss", "bytes_sent", "bytes_full"):
        assert [r[key] for r in through] == [r[key] for r in plain], key
    assert [r["eval_bytes"] for r in through] != [r["eval_bytes"] for r in plain]
    a, b = (torch.load(runs[n] / "checkpoint.pt", weights_only=True)["model"]
            for n in (f"eval-{name}", f"eval-{name}-none"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("arch", ["gcn", "sage"])
def test_retexo_through_a_schedule_equals_stagewise_training_on_what_the_codecs_deliver(
        arch, lattice, lattice_spec, runs):
    """RETEXO (3 stages of 3 rounds) with a schedule: stage ``s``'s one exchange of its input
    goes through the schedule's codec at ``(epoch 3 s, layer s)`` (``sample+random``, 2-bit
    ``quant``, ``sample+random``), and its rounds train and are evaluated on those rows:
    ``test_retexo.dense_retexo``'s stage-wise training whose aggregate of every part's owned
    rows takes the halo rows ``received_view`` delivers (numpy codecs): the losses, the
    validation accuracies every round evaluates, the final checkpoint (each stage's best)."""
    from hpcgnn.data.shard import read_shard
    from test_retexo import ROUNDS, dense_retexo, operator
    one, three = lattice[2], lattice[3]
    shards = [read_shard(three / f"part-{p:05d}.h5") for p in range(RANKS)]
    op = operator(arch, lattice_spec)[0]
    codecs = [EVAL_CODECS["sr-quant"][0], EVAL_CODECS["sr-quant"][1], EVAL_CODECS["sr-quant"][0]]

    def aggregate(s, x):
        agg, rows = torch.zeros_like(x), x.detach().numpy().astype(np.float32)
        for q, sq in enumerate(shards):
            view = received_view(shards, q, s, s * ROUNDS, rows, codecs[s], True, {})[0]
            agg[sq.global_id] = op[sq.global_id] @ torch.from_numpy(view).float()
        return agg
    init = initial_params(one, *RETEXO, f"model.arch={arch}")
    losses, vals, final = dense_retexo(arch, init, spec=lattice_spec, aggregate=aggregate)
    got = read_metrics(runs[f"retexo-{arch}-sr-quant"])
    assert [r["loss"] for r in got] == pytest.approx(losses, rel=2e-5)
    assert [r["val_acc"] for r in got] == pytest.approx(vals, abs=1e-6)
    state = torch.load(runs[f"retexo-{arch}-sr-quant"] / "checkpoint.pt", weights_only=True)["model"]
    for k, v in final.items():
        torch.testing.assert_close(state[k], v.detach(), rtol=1e-4, atol=1e-5)
    plain = dense_retexo(arch, init, spec=lattice_spec)[0]
    assert losses != pytest.approx(plain, rel=1e-4)             # the codecs changed the run
