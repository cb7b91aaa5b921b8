"""Shard sets reconstruct their input exactly, satisfy the halo invariant, and verify."""
from __future__ import annotations

import numpy as np
import pytest

from _graphs import assert_reconstructs, reconstruct, tamper, two_components
from hpcgnn.data.datasets import load_dataset
from hpcgnn.data.shard import ShardFormatError, read_meta, read_shard
from preprocess import partition_graph, verify_shards, write_shards


@pytest.fixture(scope="module")
def cora():
    return load_dataset("cora")


@pytest.fixture(scope="module")
def csbm():
    return load_dataset("csbm:nodes=600,classes=3,degree=6,features=8,seed=3")


@pytest.mark.parametrize("partitioner", ["metis", "random"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_cora_shards_reconstruct_the_graph(cora, tmp_path, partitioner, k):
    parts = partition_graph(cora, k, partitioner, seed=1)
    meta = write_shards(cora, parts, tmp_path, partitioner=partitioner, seed=1, num_parts=k)
    assert meta["num_parts"] == k and len(meta["parts"]) == k
    assert sum(p["num_owned"] for p in meta["parts"]) == cora.num_nodes
    assert_reconstructs(tmp_path, cora)
    report = verify_shards(tmp_path)
    assert report.num_edges == cora.num_edges and report.edge_cut == meta["edge_cut"]
    assert (k == 1) == (meta["edge_cut"] == 0)


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_synthetic_shards_reconstruct(csbm, tmp_path, k):
    parts = partition_graph(csbm, k, "metis", seed=0)
    write_shards(csbm, parts, tmp_path, partitioner="metis", seed=0, num_parts=k)
    assert_reconstructs(tmp_path, csbm)
    verify_shards(tmp_path)


def test_uneven_empty_and_haloless_parts(tmp_path):
    g = two_components()
    # part 0 owns the triangle (no halo), part 1 one node, part 2 is empty, part 3 the rest.
    parts = np.array([0, 0, 0, 1, 3, 3, 3, 3])
    meta = write_shards(g, parts, tmp_path, partitioner="custom", seed=0, num_parts=4)
    counts = [(p["num_owned"], p["num_halo"]) for p in meta["parts"]]
    assert counts == [(3, 0), (1, 1), (0, 0), (4, 1)]
    assert_reconstructs(tmp_path, g)
    verify_shards(tmp_path)
    empty = read_shard(tmp_path / "part-00002.h5")
    assert empty.n_owned == 0 and empty.indptr.tolist() == [0]


def test_halo_invariant_send_block_equals_peer_halo_block(cora, tmp_path):
    k = 4
    parts = partition_graph(cora, k, "random", seed=5)
    write_shards(cora, parts, tmp_path, partitioner="random", seed=5)
    shards = [read_shard(tmp_path / f"part-{p:05d}.h5") for p in range(k)]
    for q, sq in enumerate(shards):
        send_starts = np.concatenate([[0], np.cumsum(sq.send_counts)])
        for p, sp_ in enumerate(shards):
            recv_starts = np.concatenate([[0], np.cumsum(sp_.recv_counts)])
            sent = sq.global_id[sq.send_index[send_starts[p]:send_starts[p + 1]]]
            halo = sp_.halo_global_id[recv_starts[q]:recv_starts[q + 1]]
            np.testing.assert_array_equal(sent, halo)
            assert np.all(parts[halo] == q)
    # every owned node's edges, mapped back to global ids, are the node's in-neighbours
    s = shards[2]
    to_global = np.concatenate([s.global_id, s.halo_global_id])
    u = int(s.global_id[5])
    row = to_global[s.indices[s.indptr[5]:s.indptr[6]]]
    np.testing.assert_array_equal(np.sort(row), cora.indices[cora.indptr[u]:cora.indptr[u + 1]])


def test_partitioners_are_deterministic_and_balanced(cora):
    for name in ("metis", "random"):
        a, b = partition_graph(cora, 4, name, seed=7), partition_graph(cora, 4, name, seed=7)
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.int64 and set(np.unique(a)) == {0, 1, 2, 3}
    sizes = np.bincount(partition_graph(cora, 4, "random", seed=7))
    assert sizes.max() - sizes.min() <= 1
    assert not np.array_equal(partition_graph(cora, 4, "random", seed=1),
                              partition_graph(cora, 4, "random", seed=2))


def test_metis_balances_nodes_and_training_nodes_and_cuts_less(cora):
    parts = partition_graph(cora, 4, "metis", seed=0)
    owned = np.bincount(parts, minlength=4)
    train = np.bincount(parts[cora.train_idx], minlength=4)
    assert owned.max() <= 1.05 * cora.num_nodes / 4
    assert train.max() <= 1.1 * len(cora.train_idx) / 4
    rows = np.repeat(np.arange(cora.num_nodes), np.diff(cora.indptr))
    cut = lambda p: int(np.count_nonzero(p[rows] != p[cora.indices]))  # noqa: E731
    assert cut(parts) < 0.3 * cut(partition_graph(cora, 4, "random", seed=0))


def test_meta_json_matches_the_contract(cora, tmp_path):
    parts = partition_graph(cora, 2, "metis", seed=0)
    write_shards(cora, parts, tmp_path, partitioner="metis", seed=0)
    meta = read_meta(tmp_path)
    assert (meta["dataset"], meta["num_nodes"], meta["num_edges"]) == ("cora", 2708, 10556)
    assert (meta["feature_dim"], meta["num_classes"], meta["partitioner"]) == (1433, 7, "metis")
    assert [p["file"] for p in meta["parts"]] == ["part-00000.h5", "part-00001.h5"]
    assert reconstruct(tmp_path)["edges"].size == meta["num_edges"]


def test_a_file_given_as_the_shard_directory_names_its_folder(cora, tmp_path):
    """``--shards DIR/meta.json`` (or a part file) was refused as 'shard directory not found',
    which it is not: the error says it is a file and names the directory to pass."""
    write_shards(cora, partition_graph(cora, 2, "random", seed=0), tmp_path,
                 partitioner="random", seed=0)
    for name in ("meta.json", "part-00001.h5"):
        with pytest.raises(ShardFormatError) as err:
            read_meta(tmp_path / name)
        assert (f"is a file, not a shard directory; pass the directory that holds meta.json "
                f"and the part files ({tmp_path})") in str(err.value)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "meta.json").unlink()
    with pytest.raises(ShardFormatError, match="is a file, not a shard directory.*preprocess"):
        read_meta(tmp_path / "notes.txt")


def test_meta_json_counts_training_nodes_and_a_graph_without_is_one_to_predict_on(
        cora, tmp_path, caplog):
    """A graph without a training split (one to predict on) is written with a warning; its
    ``meta.json`` counts 0 training nodes, which ``hpcgnn train`` refuses."""
    from dataclasses import replace

    from hpcgnn.data.shardset import ShardSet
    parts = partition_graph(cora, 2, "metis", seed=0)
    write_shards(cora, parts, tmp_path / "ok", partitioner="metis", seed=0)
    counts = [p["num_train"] for p in read_meta(tmp_path / "ok")["parts"]]
    assert counts == np.bincount(parts[cora.train_idx], minlength=2).tolist() and sum(counts) == 140
    ShardSet.open(tmp_path / "ok").check_trainable()
    with caplog.at_level("WARNING", logger="hpcgnn.preprocess"):
        write_shards(replace(cora, train_idx=np.zeros(0, np.int64)), parts, tmp_path / "empty",
                     partitioner="metis", seed=0)
    assert "cora: no labelled training node" in caplog.text and "predict" in caplog.text
    assert [p["num_train"] for p in read_meta(tmp_path / "empty")["parts"]] == [0, 0]
    with pytest.raises(ShardFormatError, match="no labelled training node.*a set to predict on"):
        ShardSet.open(tmp_path / "empty").check_trainable()


def test_the_inputs_num_classes_is_the_sets_class_count(tmp_path):
    """meta.json's num_classes is the input's ``num_classes`` key where it has one (npz, and h5
    through ``convert``), not the largest label + 1: a graph to predict on may label no node,
    or no node of the last class. Without the key and without a label the set is refused
    (it was written with 0 classes, which no reader takes)."""
    from _graphs import save_npz
    from hpcgnn.data.h5input import write_h5
    from preprocess.errors import PreprocessError
    none = {"labels": np.full(5, -1, np.int64), "train_idx": np.zeros(0, np.int64),
            "val_idx": np.zeros(0, np.int64), "test_idx": np.zeros(0, np.int64)}
    cases = {"unlabelled": none, "no-last-class": {"labels": np.zeros(5, np.int64)}}
    for name, keys in cases.items():
        graph = load_dataset(f"npz:{save_npz(tmp_path / f'{name}.npz', num_classes=np.int64(4), **keys)}")
        write_h5(graph, tmp_path / f"{name}.h5")
        for spec in (f"npz:{tmp_path / name}.npz", f"h5:{tmp_path / name}.h5"):
            g = load_dataset(spec)
            write_shards(g, partition_graph(g, 2, "random"), tmp_path / f"{name}-{spec[:2]}",
                         partitioner="random", seed=0)
            assert read_meta(tmp_path / f"{name}-{spec[:2]}")["num_classes"] == 4, spec
    graph = load_dataset(f"npz:{save_npz(tmp_path / 'bare.npz', **none)}")
    with pytest.raises(PreprocessError, match="no labelled node and no num_classes.*add the "
                                              "num_classes key"):
        write_shards(graph, partition_graph(graph, 2, "random"), tmp_path / "bare",
                     partitioner="random", seed=0)
    assert not (tmp_path / "bare" / "meta.json").exists()


@pytest.mark.parametrize("counted", [True, False], ids=["num_train", "older-meta"])
def test_a_set_without_training_nodes_verifies_with_a_warning_and_is_not_trainable(
        cora, tmp_path, counted, caplog):
    from hpcgnn.data.shardset import ShardSet
    write_shards(cora, partition_graph(cora, 2, "metis", seed=0), tmp_path,
                 partitioner="metis", seed=0)
    for part in (0, 1):
        tamper(tmp_path, part, "nodes/train_mask", np.zeros_like, num_train=0 if counted else None)
    with caplog.at_level("WARNING", logger="hpcgnn.preprocess"):
        verify_shards(tmp_path)
    assert "no part holds a labelled training node" in caplog.text
    shards = ShardSet.open(tmp_path)
    if not counted:                       # an older meta.json: only a rank without any decides
        shards.check_trainable(own=None)
    with pytest.raises(ShardFormatError, match="no labelled training node"):
        shards.check_trainable(own=0)


def test_metis_balances_training_nodes_clustered_in_one_community():
    g = load_dataset("csbm:nodes=8000,classes=4,degree=8,features=2,seed=1")
    g.train_idx = np.nonzero(g.labels == 0)[0][:400]     # all training nodes in one class
    parts = partition_graph(g, 4, "metis", seed=0)
    train = np.bincount(parts[g.train_idx], minlength=4)
    assert train.max() <= 1.1 * 100 and np.bincount(parts).max() <= 1.05 * 2000


def _swap_first_two(a):
    a = a.copy()
    a[[0, 1]] = a[[1, 0]]
    return a


def _bump_first(a):
    a = a.copy()
    a[0] += 1
    return a


def _shift_2_to_3(a):
    a = a.copy()
    a[2] += 1
    a[3] -= 1
    return a


@pytest.mark.parametrize("part, h5path, change, expect", [
    (1, "halo/send_counts", _shift_2_to_3, "halo/recv_counts from part 1 differ"),
    (1, "halo/send_index", _swap_first_two, "halo invariant broken"),
    (0, "halo/global_id", _swap_first_two, "not ascending within each owner's group"),
    (2, "nodes/degree", _bump_first, "row lengths differ from nodes/degree"),
    (3, "halo/degree", _bump_first, "halo/degree differs from the owner's nodes/degree"),
    (0, "nodes/global_id", lambda a: a + 1, "are not exactly the nodes"),
])
def test_verify_catches_consistent_looking_but_wrong_parts(cora, tmp_path, part, h5path,
                                                           change, expect):
    write_shards(cora, partition_graph(cora, 4, "random", seed=0), tmp_path,
                 partitioner="random", seed=0)
    tamper(tmp_path, part, h5path, change)
    with pytest.raises(ShardFormatError, match=expect):
        verify_shards(tmp_path)


def _row_with_two_owned_columns(s) -> tuple[int, int]:
    """(row, position in graph/indices of its first entry) of the first owned row whose first
    two in-neighbours are owned nodes (neither a halo slot)."""
    for r in range(s.n_owned):
        lo, hi = s.indptr[r], s.indptr[r + 1]
        if hi - lo >= 2 and s.indices[lo] < s.n_owned and s.indices[lo + 1] < s.n_owned:
            return r, int(lo)
    raise AssertionError("no row with two owned in-neighbours")


def _repeat_an_edge(s) -> np.ndarray:
    """The row's second in-neighbour replaced by its first: row lengths, halo use, cut kept."""
    _, lo = _row_with_two_owned_columns(s)
    a = s.indices.copy()
    a[lo + 1] = a[lo]
    return a


def _add_a_self_loop(s) -> np.ndarray:
    """The row's first (owned) in-neighbour replaced by the row itself."""
    r, lo = _row_with_two_owned_columns(s)
    a = s.indices.copy()
    a[lo] = r
    return a


def _unuse_a_halo_slot(s) -> np.ndarray:
    """The one edge of a halo slot used once redirected to an owned node not in its row (nor
    the row itself): the slot is left unused, the row's length kept."""
    used = np.bincount(s.indices[s.indices >= s.n_owned] - s.n_owned, minlength=s.n_halo)
    at = int(np.flatnonzero(s.indices == s.n_owned + int(np.flatnonzero(used == 1)[0]))[0])
    r = int(np.searchsorted(s.indptr, at, side="right")) - 1
    row = set(s.indices[s.indptr[r]:s.indptr[r + 1]].tolist()) | {r}
    a = s.indices.copy()
    a[at] = next(v for v in range(s.n_owned) if v not in row)
    return a


@pytest.mark.parametrize("change, expect", [
    (_repeat_an_edge, "graph/indices repeats an edge"),
    (_add_a_self_loop, "graph/indices holds a self-loop"),
    (_unuse_a_halo_slot, "a halo slot is used by no edge"),
])
def test_verify_catches_a_wrong_local_csr(cora, tmp_path, change, expect):
    """graph/indices changed in place (its length, the row lengths and nodes/degree kept): a
    repeated edge, a self-loop, a halo row that no edge reads."""
    write_shards(cora, partition_graph(cora, 4, "random", seed=0), tmp_path,
                 partitioner="random", seed=0)
    verify_shards(tmp_path)
    changed = change(read_shard(tmp_path / "part-00001.h5"))
    tamper(tmp_path, 1, "graph/indices", lambda a: changed)
    with pytest.raises(ShardFormatError, match=f"part-00001.h5: {expect}"):
        verify_shards(tmp_path)


def test_verify_catches_a_halo_node_from_the_wrong_owner(cora, tmp_path):
    """One of part 0's halo nodes from part 1 replaced by a node that part 2 owns, between
    its neighbours in the group (so the group stays ascending and every count matches)."""
    parts = partition_graph(cora, 4, "random", seed=0)
    write_shards(cora, parts, tmp_path, partitioner="random", seed=0)
    s = read_shard(tmp_path / "part-00000.h5")
    gid = s.halo_global_id.copy()
    group = gid[:s.recv_counts[1]]                               # received from part 1
    bounds = np.r_[-1, group, cora.num_nodes]
    i, v = next((i, v) for i in range(len(group)) for v in np.flatnonzero(parts == 2)
                if bounds[i] < v < bounds[i + 2])
    gid[i] = v
    tamper(tmp_path, 0, "halo/global_id", lambda a: gid)
    with pytest.raises(ShardFormatError, match="part-00000.h5: a halo node is not owned by the "
                                               "part it is received from"):
        verify_shards(tmp_path)


@pytest.mark.parametrize("key, expect", [("edge_cut", "edge_cut says"),
                                         ("num_edges", "num_edges says")])
def test_verify_checks_meta_totals(cora, tmp_path, key, expect):
    from hpcgnn.data.shard import write_meta
    write_shards(cora, partition_graph(cora, 2, "metis", seed=0), tmp_path,
                 partitioner="metis", seed=0)
    meta = read_meta(tmp_path)
    meta[key] += 2
    write_meta(tmp_path, meta)
    with pytest.raises(ShardFormatError, match=expect):
        verify_shards(tmp_path)


def test_metis_input_symmetrises_directed_graphs(cora):
    from dataclasses import replace
    from preprocess.partition import metis_adjacency
    rows = np.repeat(np.arange(cora.num_nodes), np.diff(cora.indptr))
    keep = rows < cora.indices                                   # one direction only, + a loop
    indices = np.r_[cora.indices[keep], 0]
    rows = np.r_[rows[keep], 0]
    order = np.lexsort((indices, rows))
    indptr = np.r_[0, np.cumsum(np.bincount(rows, minlength=cora.num_nodes))]
    directed = replace(cora, indptr=indptr, indices=indices[order])
    a, b = metis_adjacency(directed), metis_adjacency(cora)
    np.testing.assert_array_equal(a.adj_starts, b.adj_starts)
    np.testing.assert_array_equal(a.adjacent, b.adjacent)



def test_a_part_file_whose_lock_is_refused_names_the_lock(tmp_path):
    """The error of a part that HDF5 could not lock as it wrote it (a file system that refuses
    locks) names HDF5_USE_FILE_LOCKING, not the directory's permissions or space. The error is
    HDF5's own: an h5py create of a file whose lock another open file holds."""
    import fcntl

    import h5py

    from preprocess.write import write_failed
    path = tmp_path / "part-00000.h5"
    with open(path, "wb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(OSError) as exc:
            h5py.File(path, "w")
    message = str(write_failed(path, exc.value))
    assert "unable to lock file" in str(exc.value) and "HDF5_USE_FILE_LOCKING=FALSE" in message
    assert "writable" not in message and str(path) in message


def test_damaged_part_files_are_shard_format_errors(tmp_path):
    """Every 16th byte position of a real part file changed in turn (HDF5 keeps no checksum of
    its data, so many changes read on): each reader of a part either reads it or raises one
    ShardFormatError naming the file, never HDF5's own KeyError, RuntimeError ('bad local heap
    signature', 'bad object header') or ValueError."""
    import numpy as np

    from hpcgnn.data.blocks import read_part_graph
    from hpcgnn.data.shard import read_features_into, read_global_ids
    from hpcgnn.data.shardset import read_train_count
    graph = load_dataset("csbm:nodes=40,classes=2,degree=3,features=2,seed=5")
    out = tmp_path / "shards"
    write_shards(graph, partition_graph(graph, 2, "random", seed=0), out, partitioner="random", seed=0)
    path = out / "part-00000.h5"
    good = path.read_bytes()
    readers = [lambda: read_shard(path), lambda: read_global_ids(out, 0),
               lambda: read_train_count(path), lambda: read_part_graph(out, 0),
               lambda: read_features_into(path, np.zeros((40, 2), np.float32), np.arange(len(read_shard(path, features=False).global_id)))]
    refused = 0
    for at in range(0, len(good), 16):
        data = bytearray(good)
        data[at:at + 8] = bytes(b ^ 0xA5 for b in data[at:at + 8])
        path.write_bytes(data)
        for read in readers:
            try:
                read()
            except ShardFormatError as exc:
                assert str(path) in str(exc), exc
                refused += 1
    assert refused > 50
