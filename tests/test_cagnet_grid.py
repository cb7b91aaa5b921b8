"""CAGNET's grids and blocks without processes: the rank arithmetic of the 1.5D, 2D and 3D
grids, the refusal of rank counts (with the valid ones), and the blocks of ``A`` that the ranks
build from the parts, assembled, against the normalised adjacency computed here from the raw
graph (directed, uneven METIS parts)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp

from hpcgnn.comm.cagnet import plan_15d
from hpcgnn.comm.cagnet2d import SummaGrid, column_slices, plan_2d
from hpcgnn.comm.cagnet3d import plan_3d
from hpcgnn.data.blocks import adjacency_blocks, group_ids
from hpcgnn.data.shard import ShardFormatError, read_meta
from hpcgnn.train.parallel import edge_values

DIRECTED = "rmat:scale=8,edge_factor=6,features=8,classes=3,symmetric=false,seed=5"
PAR = SimpleNamespace(replication=1)


def test_column_slices_cover_the_channels_once():
    for f in range(0, 12):
        for q in range(1, 6):
            s = column_slices(f, q)
            widths = [x.stop - x.start for x in s]
            assert len(s) == q and sum(widths) == f and max(widths) - min(widths) <= 1
            assert [x.start for x in s] == [sum(widths[:j]) for j in range(q)]


@pytest.mark.parametrize("q,c,k", [(2, 1, 4), (3, 1, 3), (2, 2, 4), (2, 2, 8), (3, 3, 9)])
def test_summa_grid_coordinates(q, c, k):
    grids = [SummaGrid(q, c, r, k) for r in range(q * q * c)]
    assert sorted((g.i, g.j, g.l) for g in grids) == [(i, j, m) for i in range(q)
                                                     for j in range(q) for m in range(c)]
    for g in grids:
        assert g.rank == (g.i * q + g.j) * c + g.l
        assert g.dense_group == (g.i * c + g.l, q * c)
    # every group's parts are K / (q c) consecutive parts, all parts once
    parts = [p for grp in range(q * c) for p in grids[0].parts(grp)]
    assert parts == list(range(k))
    # each group of dense rows is held by exactly q ranks (the replicas j)
    holders = [g.dense_group[0] for g in grids]
    assert all(holders.count(grp) == q for grp in range(q * c))


def test_15d_grid_coordinates():
    g = [plan_15d("D", 4, r, 8, SimpleNamespace(replication=2)) for r in range(8)]
    assert [(x.i, x.j) for x in g] == [(i, j) for i in range(4) for j in range(2)]
    assert [list(x.columns) for x in g[:2]] == [[0, 1], [2, 3]]
    assert all(x.dense_group == (x.i, 4) for x in g)


@pytest.mark.parametrize("plan,k,size,valid", [
    (plan_2d, 4, 8, "1, 4, 16"), (plan_2d, 4, 9, "1, 4, 16"), (plan_2d, 6, 2, "1, 4, 9, 36"),
    (plan_3d, 4, 4, "1, 8"), (plan_3d, 4, 27, "1, 8"), (plan_3d, 18, 8, "1, 27"),
    (plan_3d, 16, 9, "1, 8, 64")])
def test_wrong_rank_counts_are_refused_with_the_valid_ones(plan, k, size, valid):
    with pytest.raises(ShardFormatError) as err:
        plan("DIR", k, 0, size, PAR)
    msg = str(err.value)
    assert "DIR/meta.json" in msg and f"P in {valid} for this {k}-part set" in msg
    assert f"the job has {size} ranks" in msg and "parallel.algorithm = 'halo'" in msg


@pytest.mark.parametrize("k,c,size", [(2, 2, 6), (3, 2, 4), (3, 2, 6), (1, 2, 2), (4, 2, 12),
                                        (6, 4, 24), (2, 3, 4), (4, 2, 9)])
def test_15d_refusals_suggest_counts_that_work(k, c, size):
    """Every rank count and part count a 1.5D refusal suggests is one that plans: a K-part set
    with c not dividing K is refused for its c (no rank count helps), not told to launch K*c
    ranks, and ``preprocess N parts`` is offered only when N parts would run on these ranks."""
    import re
    with pytest.raises(ShardFormatError) as err:
        plan_15d("DIR", k, 0, size, SimpleNamespace(replication=c))
    msg = str(err.value)
    assert "DIR/meta.json" in msg and f"replication {c}" in msg
    for ranks in re.findall(r"mpirun -n (\d+)", msg):
        assert plan_15d("DIR", k, 0, int(ranks), SimpleNamespace(replication=c)).c == c
    for parts in re.findall(r"preprocess (\d+) parts", msg):
        assert plan_15d("DIR", int(parts), 0, size, SimpleNamespace(replication=c)).k == int(parts)
    for fits in re.findall(r"replication in ([\d, ]+) for", msg):
        for other in map(int, fits.split(", ")):
            assert plan_15d("DIR", k, 0, k * other, SimpleNamespace(replication=other)).k == k
    if k % c:
        assert f"divisible by c^2 = {c * c}" in msg and "mpirun -n" not in msg


def test_right_rank_counts_are_planned():
    assert (plan_2d("D", 6, 5, 9, PAR).q, plan_2d("D", 6, 5, 9, PAR).c) == (3, 1)
    assert (plan_3d("D", 8, 7, 8, PAR).q, plan_3d("D", 8, 7, 8, PAR).c) == (2, 2)
    assert plan_3d("D", 9, 0, 27, PAR).groups == 9


def _normalised(spec: str, arch: str) -> np.ndarray:
    """Dense ``A`` of the raw graph, as the models define it (here, independently): row i
    aggregates its in-neighbours j; GCN D^-1/2 (A + I) D^-1/2, SAGE 1 / d_i; d = in-degree
    without self-loops or duplicates."""
    from hpcgnn.data.datasets import load_dataset
    g = load_dataset(spec)
    n = g.num_nodes
    a = sp.csr_matrix((np.ones(len(g.indices)), g.indices, g.indptr), shape=(n, n)).toarray()
    np.fill_diagonal(a, 0)
    a = (a > 0).astype(np.float64)
    d = a.sum(axis=1)
    if arch == "gcn":
        s = 1.0 / np.sqrt(d + 1.0)
        return s[:, None] * (a + np.eye(n)) * s[None, :]
    return a / np.maximum(d, 1.0)[:, None]


@pytest.mark.parametrize("arch", ["gcn", "sage"])
@pytest.mark.parametrize("q,c,k", [(2, 1, 4), (2, 2, 4), (1, 1, 3)])
def test_blocks_assemble_to_the_normalised_adjacency(shards, arch, q, c, k):
    d = shards(DIRECTED, k, "metis")
    sizes = [p["num_owned"] for p in read_meta(d)["parts"]]
    assert len(set(sizes)) > 1                            # uneven parts
    want = _normalised(DIRECTED, arch)
    assert not np.allclose(want != 0, (want != 0).T)      # the graph is directed
    got = np.zeros_like(want)
    for r in range(q * q * c):
        g = SummaGrid(q, c, r, k)
        rows = [g.parts(g.group(g.i, m)) for m in range(c)]
        cols = g.parts(g.group(g.j, g.l))
        block = adjacency_blocks(d, rows, [cols], edge_values(arch))[0]
        row_ids = np.concatenate([group_ids(d, x) for x in rows])
        got[np.ix_(row_ids, group_ids(d, cols))] += block.toarray()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_config_keys_and_refused_combinations():
    from hpcgnn.config import ConfigError, load_config
    from hpcgnn.train.parallel import PLANS
    for alg in ("2d", "3d"):
        cfg = load_config(None, [f"parallel.algorithm={alg}"])
        assert cfg.parallel.algorithm == alg and alg in PLANS
        with pytest.raises(ConfigError, match=rf"parallel.algorithm = '{alg}'.*fixed adjacency.*'halo'"):
            load_config("configs/cora-gat.toml", [f"parallel.algorithm={alg}"])
        with pytest.raises(ConfigError, match=r"parallel.replication = 2.*'1.5d' only"):
            load_config(None, [f"parallel.algorithm={alg}", "parallel.replication=2"])
        with pytest.raises(ValueError, match=rf"'{alg}' runs uncompressed and synchronous"):
            load_config(None, [f"parallel.algorithm={alg}", "train.staleness=1"])
    with pytest.raises(ConfigError, match=r"parallel.algorithm = '4d'.*'halo', '1.5d', '2d' or '3d'"):
        load_config(None, ["parallel.algorithm=4d"])
