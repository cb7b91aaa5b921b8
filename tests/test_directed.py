"""A directed graph whose part adjacency is one-way, on every transport path.

The graph is a one-way lattice: messages flow ``i -> i+1 .. i+3`` (row ``j`` of the npz lists
``j-1 .. j-3``), written in the npz input format and preprocessed with METIS *without*
``--symmetrize``. Its parts form a chain in which a part receives halo rows from its
predecessor and sends nothing back, so the backward exchange (halo gradients back to their
owners) has other peers than the forward. Every transport path (plain ``Alltoallv``,
``Neighbor_alltoallv`` on dist-graph communicators, both in rounds under a lowered message
limit; blocking and non-blocking) is checked on 2, 3, 4 and 8 ranks against a single-process
computation written here in numpy from the input graph: the forward's halo rows and the
backward's owned-row gradients. Training on 8 ranks on the neighbourhood collective (GCN in one
call, SAGE in rounds; GCN on the all-to-all too) gives the 1-rank per-epoch losses, and those are the losses of a
plain-torch whole-graph model of the input arrays (``tests/test_model.py``'s), so the input is
not read transposed at every rank count alike; a 3-layer GCN with staleness 1 on the 8-part
chain, in the same job, gives the losses of ``tests/_pipegcn.py``'s PipeGCN over those parts
(halo rows one way, late gradients the other). The exchange checks' workers then train
synchronous GCN, SAGE and GAT on 2 and 4 ranks, GAT on 8, and RETEXO on 2, 4 and 8 ranks: the
1-rank losses and accuracies (1-rank RETEXO against ``test_retexo``'s dense stage-wise
training). This file is also
the MPI worker.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _mpi import mpi_env
from conftest import check_ok, initial_params, read_metrics, run_mpi, together, train_here

NODES, REACH, FEATURES, WIDTH = 240, 3, 6, 5
RANKS = (2, 3, 4, 8)
# name -> environment; the rounds variants get HPCGNN_MAX_MESSAGE = 16 bytes x ranks (set by
# the worker, which knows the rank count): blocks of 16 bytes a round, 4 B x 5 wide rows
TRANSPORTS = {"alltoallv": {"HPCGNN_EXCHANGE": "alltoallv"},
              "neighbor": {"HPCGNN_EXCHANGE": "neighbor"},
              "alltoallv-rounds": {"HPCGNN_EXCHANGE": "alltoallv", "HPCGNN_MAX_MESSAGE": "16"},
              "neighbor-rounds": {"HPCGNN_EXCHANGE": "neighbor", "HPCGNN_MAX_MESSAGE": "16"}}
# RETEXO (3 stages of 3 rounds); the worker jobs of 2, 4 and 8 ranks train it after the exchange
# checks, GCN on the all-to-all and SAGE on the neighbourhood collective
# (tests/test_directed_methods.py: 3 ranks)
RETEXO = ("train.method=retexo", "model.layers=3", "model.hidden=8", "train.rounds_per_layer=3",
          "train.epochs=9", "train.lr=0.05", "model.dropout=0.0")
RETEXO_RUNS = {"gcn": "alltoallv", "sage": "neighbor"}
RETEXO_RANKS = (2, 4, 8)
# synchronous runs in the same worker jobs (8 ranks: GCN and SAGE in runs_on_8 below; 3 ranks:
# tests/test_pyg_layers.py), against 1 rank
GAT_SETS = ("model.arch=gat", "model.heads=2", "model.hidden=4", "model.attn_dropout=0.3",
            "train.epochs=6")
SYNC_RUNS = {2: ("gcn", "sage", "gat"), 4: ("gcn", "sage", "gat"), 8: ("gat",)}


def worker_trainings(ranks: int) -> dict[str, tuple[str, ...]]:
    """name -> --set list of the runs the worker job of ``ranks`` trains after its checks."""
    runs = {f"retexo-{arch}": (*RETEXO, f"model.arch={arch}", f"comm.transport={transport}")
            for arch, transport in RETEXO_RUNS.items()} if ranks in RETEXO_RANKS else {}
    runs.update({f"sync-{arch}": sync_sets(arch) for arch in SYNC_RUNS.get(ranks, ())})
    return runs


def sync_sets(arch: str) -> tuple[str, ...]:
    return GAT_SETS if arch == "gat" else train_sets(arch)


def lattice_arrays(n: int = NODES, reach: int = REACH, seed: int = 4) -> dict:
    """The npz arrays of the one-way lattice: row ``j`` lists ``j - reach .. j - 1``."""
    rows = [np.arange(max(0, j - reach), j) for j in range(n)]
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    return {"num_nodes": np.int64(n),
            "adj_indptr": np.r_[0, np.cumsum([len(r) for r in rows])].astype(np.int64),
            "adj_indices": np.concatenate(rows).astype(np.int64),
            "features": rng.standard_normal((n, FEATURES)).astype(np.float32),
            "labels": (np.arange(n) // 20 % 3).astype(np.int64),
            "train_idx": np.sort(order[: n // 2]), "val_idx": np.sort(order[n // 2: 3 * n // 4]),
            "test_idx": np.sort(order[3 * n // 4:])}


@pytest.fixture(scope="module")
def lattice(tmp_path_factory):
    """(arrays, {parts: shard dir}): the npz preprocessed with METIS, no --symmetrize."""
    root = tmp_path_factory.mktemp("lattice")
    arrays = lattice_arrays()
    np.savez(root / "lattice.npz", **arrays)
    dirs = {}
    for k in (1, *RANKS):
        dirs[k] = root / f"metis-{k}"
        proc = subprocess.run([sys.executable, "-m", "preprocess", "--dataset",
                               f"npz:{root / 'lattice.npz'}", "--parts", str(k), "--partitioner",
                               "metis", "--out", str(dirs[k]), "-q"], capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL, env=mpi_env())
        assert proc.returncode == 0, proc.stderr
    return arrays, dirs


# -- the single-process reference (numpy, from the input graph) ---------------------------------

def f(gid: np.ndarray) -> np.ndarray:
    """The forward's row values: ``x[v, c]``."""
    return np.sin(0.37 * gid[:, None] + 1.3 * np.arange(WIDTH)[None, :]) + gid[:, None] % 7


def w(rank: int, gid: np.ndarray) -> np.ndarray:
    """The weight rank ``rank`` puts on halo row ``v`` in its loss ``sum(halo * w)``."""
    return np.cos(0.11 * gid[:, None] - 0.7 * np.arange(WIDTH)[None, :] + rank)


def owners(shard_dir: Path, parts: int, n: int) -> np.ndarray:
    from hpcgnn.data.shard import read_global_ids
    own = np.full(n, -1, dtype=np.int64)
    for p in range(parts):
        own[read_global_ids(shard_dir, p)] = p
    assert (own >= 0).all()
    return own


def cut_pairs(arrays: dict, own: np.ndarray) -> np.ndarray:
    """Distinct (receiving part, node) pairs: node ``v``'s message reaches a node of another
    part, which then needs ``v`` as a halo row. From the input graph's edges."""
    indptr, src = arrays["adj_indptr"], arrays["adj_indices"]
    dst = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    cut = own[src] != own[dst]
    return np.unique(np.stack([own[dst[cut]], src[cut]], axis=1), axis=0)


def reference(arrays: dict, own: np.ndarray, parts: int):
    """(halo node set per part, gradient per node ``(N, WIDTH)``): the loss of part ``q`` is
    ``sum_v halo_q[v] * w(q, v)``, so node ``v`` gets ``sum_q w(q, v)`` over the parts that
    hold it as a halo row."""
    pairs = cut_pairs(arrays, own)
    halos = [set(pairs[pairs[:, 0] == q, 1].tolist()) for q in range(parts)]
    grad = np.zeros((int(arrays["num_nodes"]), WIDTH))
    for q, v in pairs:
        grad[v] += w(int(q), np.array([v]))[0]
    return halos, grad


def assert_one_way(arrays: dict, own: np.ndarray, parts: int) -> None:
    """Some part receives from a peer it sends nothing to (from the input graph)."""
    pairs = cut_pairs(arrays, own)
    receives = {(int(q), int(own[v])) for q, v in pairs}       # (receiver, sender)
    one_way = [(q, p) for q, p in receives if (p, q) not in receives]
    assert one_way, f"the {parts}-part adjacency is symmetric; the test needs a one-way pair"


# -- the tests ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def worker_jobs(lattice, tmp_path_factory):
    """``get(ranks) -> output dir`` of the worker's job on that many ranks (run once)."""
    _, dirs = lattice
    done = {}

    def get(ranks: int) -> Path:
        if ranks not in done:
            out = tmp_path_factory.mktemp(f"worker-{ranks}")
            proc = run_mpi(ranks, [__file__, str(dirs[ranks]), str(out)], timeout=300)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            done[ranks] = out
        return done[ranks]

    return get


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", RANKS)
def test_every_transport_on_a_one_way_partition(lattice, ranks, worker_jobs):
    arrays, dirs = lattice
    own = owners(dirs[ranks], ranks, NODES)
    assert_one_way(arrays, own, ranks)
    halos, grad = reference(arrays, own, ranks)
    out = worker_jobs(ranks)
    from hpcgnn.data.shard import read_shard
    for r in range(ranks):
        got = np.load(out / f"rank-{r}.npz")
        s = read_shard(dirs[ranks] / f"part-{r:05d}.h5")
        assert set(s.halo_global_id.tolist()) == halos[r]
        for name in TRANSPORTS:
            for overlap in (0, 1):
                key = f"{name}-{overlap}"
                assert str(got[f"{key}-mode"]) == name.split("-")[0], key
                np.testing.assert_allclose(got[f"{key}-halo"], f(s.halo_global_id), rtol=1e-6,
                                           atol=1e-6, err_msg=f"{key} halo rows, rank {r}")
                np.testing.assert_allclose(got[f"{key}-grad"], grad[s.global_id], rtol=1e-5,
                                           atol=1e-5, err_msg=f"{key} owned-row grads, rank {r}")
                if name.endswith("rounds"):
                    assert int(got[f"{key}-rounds"]) > 1, key


@pytest.fixture(scope="module")
def retexo_one_rank(lattice, tmp_path_factory):
    """arch -> the 1-rank RETEXO run's metrics records (trained once), checked against
    ``test_retexo``'s dense stage-wise training on the npz's graph: the in-neighbour operators
    (the lattice's first node has none), not their transposes."""
    from test_retexo import dense_retexo
    _, dirs = lattice
    done = {}

    def get(arch: str) -> list[dict]:
        if arch not in done:
            sets = (*RETEXO, f"model.arch={arch}")
            done[arch] = train_here(dirs[1], tmp_path_factory.mktemp(f"retexo-{arch}"), *sets,
                                    config=None)
            losses, vals, _ = dense_retexo(arch, initial_params(dirs[1], *sets),
                                           spec=f"npz:{dirs[1].parent / 'lattice.npz'}")
            assert [r["loss"] for r in done[arch]] == pytest.approx(losses, rel=2e-5), arch
            assert [r["val_acc"] for r in done[arch]] == pytest.approx(vals, abs=1e-6), arch  # fp32
        return done[arch]

    return get


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", RETEXO_RANKS)
@pytest.mark.parametrize("arch", list(RETEXO_RUNS))
def test_retexo_equals_one_rank(lattice, arch, ranks, worker_jobs, retexo_one_rank):
    """RETEXO's stage embeddings cross the chain's cuts one way (each stage exchanges its
    fixed input once): every rank count gives the 1-rank losses and accuracies."""
    run = worker_jobs(ranks) / f"retexo-{arch}"
    want, got = retexo_one_rank(arch), read_metrics(run)
    assert [r["stage"] for r in got] == [e // 3 for e in range(9)]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=2e-5)
    for key in ("val_acc", "test_acc"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], abs=1e-9)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["transport"] == RETEXO_RUNS[arch], summary["transport"]


# each architecture trains on the neighbourhood collective (the path of the original defect: 27 %
# and 160 % off), GCN in one call, SAGE in rounds, and GCN on the default all-to-all (no other
# test trains on 8 ranks on it); the exchange test above covers every path at every rank count.
# All in one job (8-rank launches are the suite's slowest; a run here takes well under a second)
TRAIN_TRANSPORTS = {"gcn": ("neighbor", "alltoallv"), "sage": ("neighbor-rounds",)}


def train_sets(arch: str) -> tuple[str, ...]:
    return (f"model.arch={arch}", "train.epochs=6", "model.hidden=8")


@pytest.fixture(scope="module")
def runs_on_8(lattice, tmp_path_factory):
    """The 8-rank runs of TRAIN_TRANSPORTS, in one job (``conftest.together``)."""
    _, dirs = lattice
    return together(tmp_path_factory, {
        **{(arch, name): (8, dirs[8], train_sets(arch),
                          {**TRANSPORTS[name], **({"HPCGNN_MAX_MESSAGE": "128"} if name.endswith("rounds") else {})})
           for arch, names in TRAIN_TRANSPORTS.items() for name in names},
        ("gcn", "stale"): (8, dirs[8], (*STALE_SETS, "train.staleness=1"), {})})


# a stale run in the same job: 3-layer GCN, dropout 0.5 (tests/test_directed_methods.py has the
# other methods on 3 ranks)
STALE_SETS = ("model.arch=gcn", "model.layers=3", "model.hidden=8", "model.dropout=0.5",
              "train.epochs=6")


def as_graph(arrays: dict):
    """The npz arrays as the graph the whole-graph references read."""
    from types import SimpleNamespace
    return SimpleNamespace(num_nodes=int(arrays["num_nodes"]), num_edges=len(arrays["adj_indices"]),
                           indptr=arrays["adj_indptr"], indices=arrays["adj_indices"],
                           dense_features=lambda: arrays["features"], labels=arrays["labels"],
                           train_idx=arrays["train_idx"])


def plain_torch_losses(arrays: dict, arch: str, init: dict) -> list[float]:
    """The whole-graph model of ``tests/test_model.py`` on the lattice, from the npz arrays
    (row ``i`` of the CSR lists the nodes whose messages reach ``i``): what the 1-rank run
    must give, so that a direction mistake common to every rank count cannot pass."""
    from test_model import _reference_losses
    return _reference_losses(arch, init, layers=2, p=0.5, seed=0, g=as_graph(arrays),
                             normalize=False, epochs=6)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,arch", [(r, a) for r, archs in SYNC_RUNS.items() for a in archs])
def test_synchronous_training_equals_1_rank(lattice, ranks, arch, worker_jobs, tmp_path):
    """GCN, SAGE and GAT (attention dropout) on 2 and 4 ranks, GAT on 8: the 1-rank losses
    and accuracies (1 rank against whole-graph models: the test below for GCN and SAGE,
    tests/test_pyg_layers.py's PyG GAT on a directed graph)."""
    _, dirs = lattice
    want = train_here(dirs[1], tmp_path / "one", *sync_sets(arch), config=None)
    got = read_metrics(worker_jobs(ranks) / f"sync-{arch}")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    for key in ("train_acc", "val_acc", "test_acc"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], abs=1e-9), key


@pytest.mark.mpi
@pytest.mark.parametrize("arch", list(TRAIN_TRANSPORTS))
def test_training_on_8_ranks_equals_1_rank_across_the_transports(lattice, arch, runs_on_8, tmp_path):
    """The 1-rank run equals a plain-torch whole-graph model of the directed input (not its
    transpose), and the 8-rank runs equal both."""
    arrays, dirs = lattice
    init = initial_params(dirs[1], *train_sets(arch))
    want = [r["loss"] for r in train_here(dirs[1], tmp_path / "one", *train_sets(arch), config=None)]
    assert len(want) == 6
    assert want == pytest.approx(plain_torch_losses(arrays, arch, init), rel=1e-5), arch
    for name in TRAIN_TRANSPORTS[arch]:
        proc, out = runs_on_8((arch, name))
        check_ok(proc)
        got = [r["loss"] for r in read_metrics(out)]
        assert got == pytest.approx(want, rel=1e-5), (arch, name, got, want)
        summary = json.loads((out / "summary.json").read_text())     # the transport it used
        assert summary["transport"] == name.split("-")[0], (name, summary["transport"])


@pytest.mark.mpi
def test_stale_training_on_8_ranks_equals_pipegcn(lattice, runs_on_8):
    """Staleness 1 on the 8-part chain: each part's halo rows of the epoch before come from its
    predecessor, its halo gradients reach that predecessor an epoch later; the losses of
    ``tests/_pipegcn.py``'s whole-graph PipeGCN over the same parts."""
    from _pipegcn import Model, pipegcn_losses
    arrays, dirs = lattice
    proc, out = runs_on_8(("gcn", "stale"))
    check_ok(proc)
    got = [r["loss"] for r in read_metrics(out)]
    init, parts = initial_params(dirs[1], *STALE_SETS), owners(dirs[8], 8, NODES)
    model = Model("gcn", 3, dropout=0.5)
    assert got == pytest.approx(pipegcn_losses(as_graph(arrays), parts, init, model, 1, 0.0, 6),
                                rel=2e-5)
    assert got[1:] != pytest.approx(pipegcn_losses(as_graph(arrays), parts, init, model, 0, 0.0, 6)[1:],
                                    rel=1e-4)                 # staleness changed the trajectory


# -- the worker (runs on every rank) ------------------------------------------------------------

def _worker(shard_dir: str, out: str) -> None:
    import os

    import torch

    from hpcgnn.codecs.base import IDENTITY
    from hpcgnn.comm.context import CommContext
    from hpcgnn.comm.exchange import ExchangeSettings, ExchangeStats, HaloExchanger
    from hpcgnn.comm.plan import HaloPlan
    from hpcgnn.train.inputs import load_part
    ctx = CommContext.from_world("cpu")
    _, shard = load_part(shard_dir, ctx.rank, ctx.size)
    plan = HaloPlan.from_shard(shard)
    results = {}
    for name, env in TRANSPORTS.items():
        os.environ.pop("HPCGNN_MAX_MESSAGE", None)
        os.environ.update(env)
        if "HPCGNN_MAX_MESSAGE" in env:
            os.environ["HPCGNN_MAX_MESSAGE"] = str(int(env["HPCGNN_MAX_MESSAGE"]) * ctx.size)
        for overlap in (0, 1):
            exch = HaloExchanger(ctx, plan, layer=1, seed=3, stats=ExchangeStats(),
                                 overlap=bool(overlap))
            x = torch.tensor(f(shard.global_id), dtype=torch.float32, requires_grad=True)
            halo = exch.exchange(x, ExchangeSettings(2, IDENTITY, IDENTITY))
            (halo * torch.tensor(w(ctx.rank, shard.halo_global_id), dtype=torch.float32)).sum().backward()
            key = f"{name}-{overlap}"
            grad = x.grad if x.grad is not None else torch.zeros_like(x)    # sends nothing
            results.update({f"{key}-halo": halo.detach().numpy(), f"{key}-grad": grad.numpy(),
                            f"{key}-mode": np.array(exch._transport.mode),
                            f"{key}-rounds": np.array(exch._layout(IDENTITY, WIDTH, False)[0].rounds)})
    np.savez(Path(out, f"rank-{ctx.rank}.npz"), **results)
    for name in ("HPCGNN_EXCHANGE", "HPCGNN_MAX_MESSAGE"):
        os.environ.pop(name, None)
    from hpcgnn.__main__ import main
    for name, sets in worker_trainings(ctx.size).items():
        rc = main(["train", "--shards", shard_dir, "--out", str(Path(out, name)),
                   *(a for s in sets for a in ("--set", s))])
        assert rc == 0, (name, rc)
    print(f"rank {ctx.rank}: done", flush=True)


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent), str(here)]     # this checkout's hpcgnn, then the helpers
    _worker(sys.argv[1], sys.argv[2])
