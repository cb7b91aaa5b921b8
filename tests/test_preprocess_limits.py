"""Distributed preprocessing's int64 key bound, tested at a lowered bound on real ranks.

Edges travel and sort as keys ``row * N + col``; a graph with more nodes than
``preprocess.distributed.node_limit()`` is refused on every rank before any key is built, with
the limit and the fix named, and nothing is written. ``HPCGNN_MAX_NODES`` lowers the bound so
the refusal is exercised on a small graph; exactly at the bound the set is written and holds
the input. Also the halo keys' bound on the part count, and the MPI count limit of the
distributed ``Alltoallv`` rounds.
"""
from __future__ import annotations

import pytest

from conftest import check_ok, run_mpi
from test_preprocess_dist import GEN, N_MESSY, check_set, messy_h5

pytestmark = pytest.mark.mpi


def _preprocess(spec: str, out, limit: int):
    return run_mpi(2, ["-m", "preprocess", "--dataset", spec, "--parts", "3", "--partitioner",
                       "random", "--out", str(out), "-q"], timeout=120,
                   env={"HPCGNN_MAX_NODES": str(limit)})


def _refused(proc, nodes: int, limit: int, out) -> None:
    assert proc.returncode != 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("preprocess: error")]
    assert len(lines) == 2, proc.stderr                                    # both ranks
    for ln in lines:
        assert f"{nodes:,} nodes is more than distributed preprocessing handles ({limit:,}" in ln
        assert "row * N + col" in ln and "split the graph" in ln and "HPCGNN_MAX_NODES" in ln
    assert "Traceback" not in proc.stderr
    assert not (out / "meta.json").exists() and not list(out.glob("part-*.h5"))


def test_h5_input_above_the_bound_is_refused_and_at_it_written(tmp_path):
    raw = messy_h5(tmp_path / "messy.h5")
    spec = f"h5:{tmp_path / 'messy.h5'}"
    _refused(_preprocess(spec, tmp_path / "over", N_MESSY - 1), N_MESSY, N_MESSY - 1,
             tmp_path / "over")
    check_ok(_preprocess(spec, tmp_path / "at", N_MESSY))
    check_set(tmp_path / "at", raw, symmetrize=False)


def test_sliced_generator_above_the_bound_is_refused(tmp_path):
    nodes = 2 ** 9                                     # GEN is rmat-sliced at scale 9
    assert "scale=9" in GEN
    _refused(_preprocess(GEN, tmp_path / "over", nodes - 1), nodes, nodes - 1, tmp_path / "over")


def test_node_limit_reads_the_override(monkeypatch):
    from hpcgnn.data.clean import MAX_NODES
    from preprocess.distributed import check_node_count, node_limit
    from preprocess.errors import PreprocessError
    assert node_limit() == MAX_NODES and MAX_NODES ** 2 < 2 ** 63      # keys fit int64
    monkeypatch.setenv("HPCGNN_MAX_NODES", str(10 ** 12))              # cannot raise it
    assert node_limit() == MAX_NODES
    monkeypatch.setenv("HPCGNN_MAX_NODES", "many")
    with pytest.raises(PreprocessError, match="HPCGNN_MAX_NODES='many' is not an integer"):
        check_node_count(5, "x")
    monkeypatch.delenv("HPCGNN_MAX_NODES")
    with pytest.raises(PreprocessError, match=r"3,000,000,001 nodes .* \(3,000,000,000\)"):
        check_node_count(MAX_NODES + 1, "big.h5")


# K parts of N nodes overflow the halo keys (q * K + p) * N + v when K^2 N >= 2^63: with N >= K,
# first at K = N = 2^21 (a 2M-node graph of 1M edges per rank: about 0.3 GiB a rank, 2 s)
KEY_NODES = 2 ** 21
KEY_GEN = "rmat-sliced:scale=21,edge_factor=1,features=1"


def test_parts_that_overflow_the_halo_keys_are_refused_before_partitioning(tmp_path):
    """The refusal names the bound and the fix on every rank, before the partitioner runs (a
    PT-Scotch run of hours was refused only after it, when the halo maps were built)."""
    assert KEY_NODES ** 3 >= 2 ** 63 > (KEY_NODES - 1) ** 3
    out = tmp_path / "over"
    proc = run_mpi(2, ["-m", "preprocess", "--dataset", KEY_GEN, "--parts", str(KEY_NODES),
                       "--partitioner", "random", "--out", str(out)], timeout=180)
    assert proc.returncode != 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("preprocess: error")]
    assert len(lines) == 2, proc.stderr                                    # both ranks
    for ln in lines:
        assert f"{KEY_NODES} parts x {KEY_NODES:,} nodes overflow the int64 halo keys" in ln
        assert "2^63" in ln and "use fewer parts" in ln
    assert "partitioned" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "meta.json").exists() and not list(out.glob("part-*.h5"))


def test_one_process_request_is_checked_against_the_halo_keys():
    """The one-process path checks the same bound with the part count, before METIS runs."""
    from preprocess.errors import PreprocessError
    from preprocess.partition import check_parts
    n = KEY_NODES
    check_parts(n - 1, n)                      # (n - 1)^2 n < 2^63
    with pytest.raises(PreprocessError, match=r"overflow the int64 halo keys \(parts\^2"):
        check_parts(n, n)


def test_alltoallv_rounds_stay_below_the_mpi_count_limit():
    """A round of R moves rows ``c (i + 1) // R - c i // R`` of every block of ``c`` rows: up to
    one row per peer more than ``total / R``. At the largest accepted round size (2^31 - 1
    bytes), 4096 peers with odd blocks of 4 KiB rows and a total just under two rounds' worth
    overflowed a C int in one of the 2 rounds the old count gave; every round stays below it."""
    from preprocess.exchange import INT_MAX, round_count
    peers, row_bytes = 4096, 4096
    counts = [255] * (peers - 1) + [1048574 - 255 * (peers - 1)]     # odd blocks
    assert all(c % 2 for c in counts) and sum(counts) == 1048574
    need = sum(counts) * row_bytes
    assert INT_MAX < need <= 2 * INT_MAX
    rounds = round_count(need, peers, row_bytes, INT_MAX)
    worst = max(sum(c * (i + 1) // rounds - c * i // rounds for c in counts) * row_bytes
                for i in range(rounds))
    assert worst <= INT_MAX, (rounds, worst)
    assert round_count(10 ** 6, 4, 100, 1 << 30) == 1            # a small exchange: one round


def test_a_bad_round_size_is_refused_on_every_rank_before_any_exchange(tmp_path, monkeypatch):
    from preprocess.errors import PreprocessError
    from preprocess.exchange import round_bytes
    for bad in ("abc", "0", str(2 ** 31)):
        monkeypatch.setenv("HPCGNN_A2A_ROUND_BYTES", bad)
        with pytest.raises(PreprocessError, match=r"HPCGNN_A2A_ROUND_BYTES=.*\[1, 2147483647\]"):
            round_bytes()
    monkeypatch.setenv("HPCGNN_A2A_ROUND_BYTES", "4096")
    assert round_bytes() == 4096
    out = tmp_path / "bad"
    proc = run_mpi(2, ["-m", "preprocess", "--dataset", GEN, "--parts", "3", "--partitioner",
                       "random", "--out", str(out), "-q"], timeout=120,
                   env={"HPCGNN_A2A_ROUND_BYTES": str(2 ** 32)})
    assert proc.returncode != 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("preprocess: error")]
    assert len(lines) == 2 and all("HPCGNN_A2A_ROUND_BYTES='4294967296'" in ln for ln in lines), \
        proc.stderr
    assert "Traceback" not in proc.stderr and not list(out.glob("part-*.h5"))


def test_a_32_bit_metis_refuses_node_ids_it_cannot_hold(monkeypatch):
    """With a METIS of 32-bit ``idx_t`` (a property of the pymetis build: simulated here, this
    one is 64-bit), a graph of 2^31 - 1 nodes or more is refused before its ids are cast (the
    cast wrapped them silently when the graph had fewer adjacency entries than that). The
    graph's arrays stay tiny: the check reads ``num_nodes`` first."""
    import numpy as np
    from hpcgnn.data.graph import Graph
    from preprocess import partition
    from preprocess.errors import PreprocessError
    monkeypatch.setattr(partition, "idx_dtype", lambda: np.int32)
    one = np.zeros(1, dtype=np.int64)
    graph = Graph(name="wide", num_nodes=2 ** 31, indptr=np.zeros(2, dtype=np.int64),
                  indices=one[:0], features=np.zeros((1, 1), dtype=np.float32), labels=one,
                  train_idx=one[:0], val_idx=one[:0], test_idx=one[:0])
    with pytest.raises(PreprocessError, match=r"wide: 2,147,483,648 nodes exceed this METIS "
                                              r"build's 32-bit index; use --partitioner random"):
        partition.metis_adjacency(graph)
