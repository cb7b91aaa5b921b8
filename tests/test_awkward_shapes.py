"""Uncompressed synchronous training at awkward shapes equals one rank, on real ranks, for the
halo exchange (both transports, in rounds) and CAGNET's 1.5D, 2D and 3D:

a 7-node directed graph with an isolated node and a node with no in-edge, split by hand so that
part 0 is empty (a rank with no rows, a grid group with no rows), two parts hold no training
node, one part has no halo at all, and the parts are uneven; fewer nodes than ranks (8 and 9
ranks for 7 nodes); features (3) and layer widths (2) no wider than the 2D grid (q = 3: some
column slices are empty); more parts than ranks (6 parts on 3 ranks); ``comm.max_message`` at
the least each run can keep. The per-epoch losses and accuracies must equal the single-process
run (``train_here``, in this process). One byte less is refused at start-up on every rank, in
the same jobs (``REFUSED``).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import check_ok, read_metrics, together, train_here

pytestmark = pytest.mark.mpi

EPOCHS = 4
# in-neighbours (CSR rows: whose messages reach node i); directed: 5 has no in-edge, 6 none at all
IN = {0: [1, 3], 1: [0, 2], 2: [4], 3: [2, 5], 4: [3], 5: [], 6: []}
LABELS = [0, 1, 1, 0, 1, 0, 1]
TRAIN, VAL, TEST = [0, 2, 3], [1, 4], [5, 6]
# node -> part: part 0 empty; parts 4 and 5 without a training node; part 5 (node 6) no halo
PARTS = {6: [1, 1, 2, 3, 3, 4, 5], 4: [1, 1, 1, 2, 2, 3, 3], 1: [0] * 7}
SETS = ("train.epochs=4", "model.hidden=2")


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """``{parts: shard dir}`` of the graph above, written with the hand-made assignments."""
    from hpcgnn.data.datasets import load_dataset
    from preprocess import write_shards
    root = tmp_path_factory.mktemp("awkward")
    indptr = np.cumsum([0] + [len(IN[i]) for i in range(7)])
    np.savez(root / "g.npz", num_nodes=np.int64(7), adj_indptr=indptr.astype(np.int64),
             adj_indices=np.array([j for i in range(7) for j in IN[i]], np.int64),
             features=np.random.default_rng(3).standard_normal((7, 3)).astype(np.float32),
             labels=np.array(LABELS, np.int64), train_idx=np.array(TRAIN, np.int64),
             val_idx=np.array(VAL, np.int64), test_idx=np.array(TEST, np.int64))
    graph = load_dataset(f"npz:{root / 'g.npz'}")
    out = {}
    for k, assignment in PARTS.items():
        out[k] = root / f"parts-{k}"
        write_shards(graph, np.array(assignment, np.int64), out[k], partitioner="random", seed=0,
                     num_parts=k)
    return out


def test_the_shard_sets_are_awkward(sets):
    from hpcgnn.data.shard import read_meta
    import h5py
    six = read_meta(sets[6])["parts"]
    assert six[0]["num_owned"] == 0 and six[5]["num_halo"] == 0
    assert len({p["num_owned"] for p in six}) > 1
    for p in (4, 5):
        with h5py.File(sets[6] / six[p]["file"]) as f:
            assert not f["nodes/train_mask"][...].any()
    assert read_meta(sets[4])["parts"][0]["num_owned"] == 0


@pytest.fixture(scope="module")
def one_rank(sets, tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = train_here(sets[1], tmp_path_factory.mktemp("ref"), *SETS,
                                     f"model.arch={arch}", config=None)
        return cache[arch]
    return get


CASES = [  # (name, ranks, parts, arch, sets)
    ("halo-6", 6, 6, "gcn", ()),
    ("halo-6-neighbor-rounds", 6, 6, "gat", ("comm.transport=neighbor", "comm.max_message=5")),
    ("halo-3-of-6-alltoallv-rounds", 3, 6, "sage", ("comm.transport=alltoallv",
                                                   "comm.max_message=4")),
    ("1.5d-6-c1", 6, 6, "gcn", ("parallel.algorithm=1.5d",)),
    ("1.5d-8-c2", 8, 4, "sage", ("parallel.algorithm=1.5d", "parallel.replication=2")),
    ("2d-9", 9, 6, "gcn", ("parallel.algorithm=2d",)),
    ("2d-9-sage", 9, 6, "sage", ("parallel.algorithm=2d",)),
    ("2d-4", 4, 4, "gcn", ("parallel.algorithm=2d",)),
    ("3d-8", 8, 4, "gcn", ("parallel.algorithm=3d",)),
]


# (name, ranks, parts, sets, env, what the refusal says): one byte below the least message
# limit: the halo exchange's P - 1 peers a round (6 ranks: 5), a 4-byte value (3 ranks), the
# 2D grid's Allgatherv round of a value from each of q = 3 ranks (12)
REFUSED = [
    ("halo-6-max-message-4", 6, 6, ("comm.transport=neighbor", "comm.max_message=4"), {},
     "(with --set overrides): comm.max_message = 4 is below 5 bytes"),
    ("halo-3-env-max-message-3", 3, 6, (), {"HPCGNN_MAX_MESSAGE": "3"},
     "HPCGNN_MAX_MESSAGE=3 is below 4 bytes"),
    ("2d-9-max-message-11", 9, 6, ("parallel.algorithm=2d", "comm.max_message=11"), {},
     "(with --set overrides): comm.max_message = 11 is below 12 bytes"),
]


@pytest.fixture(scope="module")
def case_runs(sets, tmp_path_factory):
    plan = {name: (ranks, sets[parts], (*SETS, f"model.arch={arch}", *more), {})
            for name, ranks, parts, arch, more in CASES}
    plan.update({name: (ranks, sets[parts], (*SETS, *more), env)
                 for name, ranks, parts, more, env, _ in REFUSED})
    return together(tmp_path_factory, plan)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_awkward_shapes_equal_one_rank(case, one_rank, case_runs):
    name, ranks, parts, arch, more = case
    proc, run = case_runs(name)
    check_ok(proc)
    got, want = read_metrics(run), one_rank(arch)
    assert len(got) == len(want) == EPOCHS
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    for key in ("train_acc", "val_acc", "test_acc"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], abs=1e-9)
    assert all(r["bytes_sent"] > 0 for r in got)            # the ranks did exchange


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_message_limit_below_one_call_is_refused_on_every_rank(case, case_runs):
    """A limit a call cannot keep (a round's byte for each peer, a whole value) ended the run
    at start-up, every rank in one ERROR line naming the key, the least value and the fix; it
    used to train with calls past it."""
    name, ranks, _, _, env, want = case
    proc, run = case_runs(name)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln]
    head = f"[rank 0/{ranks}] ERROR ranks 0-{ranks - 1}: "
    assert len(errors) == 1 and errors[0].startswith(head) and want in errors[0], errors
    least = want.split(" is below ")[1].split()[0]
    fix = f"set HPCGNN_MAX_MESSAGE to {least} or more" if env else \
        f"set comm.max_message to {least} or more"
    assert fix in errors[0], errors
    assert not (run / "metrics.jsonl").exists()
