"""The methods beyond synchronous training on a directed graph: ``test_directed``'s one-way
lattice (messages flow ``i -> i+1 .. i+3``; METIS parts, not symmetrised, uneven) on 3 real
ranks, where a part receives halo rows from its predecessor only and sends its halo gradients
back the other way. Staleness 1 (GCN, SAGE with three layers, GAT with attention dropout) and 2
with smoothing (3-layer GCN on the neighbourhood collective), dropout 0.5, against the
single-process PipeGCN of ``tests/_pipegcn.py`` on the npz's graph; RETEXO (GCN; SAGE on the
neighbourhood collective) against the 1-rank run; ``hpcgnn predict`` of a synchronous 3-layer
GCN run and of the RETEXO GCN run, on 3 ranks, against dense whole-graph stacks of their
checkpoints (``test_retexo``'s stage-wise one for RETEXO). One ``mpiexec`` job
(``conftest.run_together``)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from conftest import check_ok, read_metrics, run_together, train_here
from test_directed import assert_one_way, lattice_arrays, owners

pytestmark = pytest.mark.mpi

RANKS, EPOCHS = 3, 8
STALE = {  # name -> (model --set list, staleness, smoothing, transport); dropout 0.5
    "gcn": (("model.arch=gcn", "model.hidden=8"), 1, 0.0, "alltoallv"),
    "sage3": (("model.arch=sage", "model.layers=3", "model.hidden=8"), 1, 0.0, "alltoallv"),
    "gat": (("model.arch=gat", "model.heads=2", "model.hidden=8", "model.attn_dropout=0.3"), 1,
            0.0, "alltoallv"),
    # the dist-graph communicator's in- and out-peers differ on a chain
    "gcn3-s2-smooth-neighbor": (("model.arch=gcn", "model.layers=3", "model.hidden=8"), 2, 0.5,
                                "neighbor"),
}
RETEXO = ("train.method=retexo", "model.layers=3", "model.hidden=8", "train.rounds_per_layer=3",
          "train.epochs=9", "train.lr=0.05", "model.dropout=0.0")
SYNC = ("model.arch=gcn", "model.layers=3", "model.hidden=6", "train.epochs=4")


def stale_sets(name: str) -> tuple[str, ...]:
    return (*STALE[name][0], "model.dropout=0.5", f"train.epochs={EPOCHS}")


@pytest.fixture(scope="module")
def lattice(shards, tmp_path_factory):
    """(arrays, graph, 1-part and 3-part shard dirs) of the one-way lattice, from its npz."""
    from hpcgnn.data.datasets import load_dataset
    path = tmp_path_factory.mktemp("lattice") / "lattice.npz"
    np.savez(path, **lattice_arrays())
    return (lattice_arrays(), load_dataset(f"npz:{path}"), shards(f"npz:{path}", 1),
            shards(f"npz:{path}", RANKS, "metis"))


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

    def train(name, sets):
        add(name, ["train", "--shards", three, *(a for s in sets for a in ("--set", s))])

    for name, (_, s, m, transport) in STALE.items():
        train(f"stale-{name}", (*stale_sets(name), f"train.staleness={s}",
                                f"train.smoothing={m}", f"comm.transport={transport}"))
    for arch, transport in (("gcn", "alltoallv"), ("sage", "neighbor")):
        train(f"retexo-{arch}", (*RETEXO, f"model.arch={arch}", f"comm.transport={transport}"))
    train("sync", SYNC)
    for name in ("sync", "retexo-gcn"):
        add(f"predict-{name}", ["predict", "--run", out[name], "--shards", three])
    for proc in run_together(RANKS, commands, work / "batch"):
        check_ok(proc)
    return out


def test_the_parts_are_one_way_and_uneven(lattice):
    arrays, graph, _, three = lattice
    own = owners(three, RANKS, graph.num_nodes)
    assert_one_way(arrays, own, RANKS)
    assert len(set(np.bincount(own).tolist())) > 1


def initial(shard_dir, tmp_path, sets) -> dict:
    """A fresh model's parameters: a 1-rank run's after one epoch at lr 1e-30, its layers'
    biases put back to the zeros they start at. The step moves them to +-1e-30, which is
    ReLU's derivative 1 instead of 0 on a row whose dropped-out, aggregated input is all zero
    (the lattice's first node has no in-edge): 5e-5 apart by epoch 5 at 1 rank already."""
    from hpcgnn.train.checkpoint import CHECKPOINT_NAME
    train_here(shard_dir, tmp_path / "init", *sets, "train.epochs=1", "train.lr=1e-30",
               "train.weight_decay=0", config=None)
    state = torch.load(tmp_path / "init" / CHECKPOINT_NAME, weights_only=True)["model"]
    return {k: torch.zeros_like(v) if k.endswith(".bias") else v for k, v in state.items()}


@pytest.mark.parametrize("name", list(STALE))
def test_stale_training_equals_pipegcn(name, lattice, runs, tmp_path):
    """Halo rows posted s epochs ago flow down the chain, their gradients up it s epochs
    later: the losses of PipeGCN's whole-graph computation over the same parts."""
    from _pipegcn import pipegcn_losses
    from test_methods_exact import reference_model
    _, graph, one, three = lattice
    init = initial(one, tmp_path, stale_sets(name))
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


def gcn_operator(arrays: dict) -> torch.Tensor:
    """Dense ``D^-1/2 (A + I) D^-1/2`` from the npz arrays (row ``i``: the nodes whose messages
    reach ``i``; D the in-degree + 1)."""
    n = int(arrays["num_nodes"])
    a = sp.csr_matrix((np.ones(len(arrays["adj_indices"])), arrays["adj_indices"],
                       arrays["adj_indptr"]), shape=(n, n)).toarray()
    d = 1.0 / np.sqrt(a.sum(1) + 1.0)
    return torch.from_numpy(d[:, None] * (a + np.eye(n)) * d[None, :]).float()


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


def test_predict_equals_dense_stacks(lattice, runs):
    """``hpcgnn predict`` on 3 ranks: a synchronous GCN's logits and last hidden rows, and the
    RETEXO GCN's logits and embedding, as dense whole-graph products of the checkpoints'
    weights with the directed operator (not its transpose)."""
    from _graphs import dense_gcn
    from hpcgnn.predict import read_predictions
    from test_retexo import dense_stage
    arrays = lattice[0]
    state = torch.load(runs["sync"] / "checkpoint.pt", weights_only=True)["model"]
    hidden, logits = dense_gcn(arrays, state)
    got = read_predictions(runs["predict-sync"])
    np.testing.assert_allclose(got["logits"], logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["embedding"], hidden, rtol=1e-4, atol=1e-5)
    transposed = dense_gcn({**arrays, **transpose(arrays)}, state)[1]
    assert not np.allclose(transposed, logits, rtol=1e-3, atol=1e-3)     # direction matters
    state = torch.load(runs["retexo-gcn"] / "checkpoint.pt", weights_only=True)["model"]
    op = gcn_operator(arrays)
    x = torch.from_numpy(arrays["features"])
    with torch.no_grad():
        for s in range(2):
            x = dense_stage("gcn", state, s, op, x)[1]
        logits = dense_stage("gcn", state, 2, op, x)[0]
    got = read_predictions(runs["predict-retexo-gcn"])
    np.testing.assert_allclose(got["embedding"], x.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["logits"], logits.numpy(), rtol=1e-4, atol=1e-5)


def transpose(arrays: dict) -> dict:
    """The CSR arrays of the reversed graph."""
    n = int(arrays["num_nodes"])
    a = sp.csr_matrix((np.ones(len(arrays["adj_indices"])), arrays["adj_indices"],
                       arrays["adj_indptr"]), shape=(n, n)).T.tocsr()
    a.sort_indices()
    return {"adj_indptr": a.indptr.astype(np.int64), "adj_indices": a.indices.astype(np.int64)}
