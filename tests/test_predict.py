"""``hpcgnn predict`` on real ranks: the files' predictions give exactly the trainer's final
accuracies, a 2-rank predict equals a 1-rank predict of the same checkpoint, logits and embeddings
equal a dense whole-graph GCN with the checkpoint's weights, and errors end the job cleanly."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from _graphs import dense_gcn, partly_labelled_npz, unwritable_dir
from _mpi import REPO
from conftest import check_ok, refused_before_torch, run_mpi, run_together, train

pytestmark = pytest.mark.mpi


def predict(nranks, run_dir, shard_dir, out, env=None):
    return run_mpi(nranks, ["-m", "hpcgnn", "predict", "--run", str(run_dir), "--shards",
                            str(shard_dir), "--out", str(out)], timeout=120, env=env)


def _accuracy(pred, labels, idx):
    idx = idx[labels[idx] >= 0]
    return float((pred[idx] == labels[idx]).sum()) / len(idx)


def test_predictions_equal_the_trainers_evaluation(shards, tmp_path):
    from hpcgnn.data.datasets import load_dataset
    from hpcgnn.predict import read_predictions
    run = tmp_path / "run"
    for proc in run_together(2, [(["train", "--shards", shards("cora", 2), "--out", run, "--config",
                                   "configs/cora.toml", "--set", "train.epochs=15"], {}),
                                 (["predict", "--run", run, "--shards", shards("cora", 2),
                                   "--out", tmp_path / "p2"], {})], tmp_path / "jobs"):
        check_ok(proc)
    check_ok(predict(1, run, shards("cora", 1), tmp_path / "p1"))
    two, one = read_predictions(tmp_path / "p2"), read_predictions(tmp_path / "p1")
    graph, summary = load_dataset("cora"), json.loads((run / "summary.json").read_text())
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert two["logits"].dtype == np.float32 and two["logits"].shape == (graph.num_nodes, 7)
    assert two["embedding"].shape == (graph.num_nodes, 16) and two["embedding"].min() >= 0
    assert np.array_equal(two["pred"], two["logits"].argmax(axis=1))
    assert _accuracy(two["pred"], graph.labels, graph.test_idx) == summary["final_test_acc"]
    assert _accuracy(two["pred"], graph.labels, graph.val_idx) == last["val_acc"]
    # the metrics' val_loss: mean cross-entropy of the logits over the labelled val nodes
    idx = graph.val_idx[graph.labels[graph.val_idx] >= 0]
    z = two["logits"][idx].astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    nll = np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(idx)), graph.labels[idx]]
    assert last["val_loss"] == pytest.approx(nll.mean(), rel=1e-5)
    assert np.array_equal(one["pred"], two["pred"])
    np.testing.assert_allclose(one["logits"], two["logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(one["embedding"], two["embedding"], rtol=1e-5, atol=1e-5)
    # predicting again into an earlier output replaces it whole: 2 parts -> 1, no part left over
    check_ok(predict(1, run, shards("cora", 1), tmp_path / "p2"))
    assert not (tmp_path / "p2" / "part-00001.h5").exists()
    assert np.array_equal(read_predictions(tmp_path / "p2")["pred"], one["pred"])
    # a graph to predict on (no training split: train refuses its shard set) predicts alike
    from dataclasses import replace

    from preprocess import partition_graph, write_shards
    bare = replace(graph, train_idx=np.zeros(0, np.int64))
    write_shards(bare, partition_graph(bare, 1, "metis"), tmp_path / "bare", partitioner="metis",
                 seed=0)
    check_ok(predict(1, run, tmp_path / "bare", tmp_path / "pb"))
    assert np.array_equal(read_predictions(tmp_path / "pb")["pred"], one["pred"])


def test_runs_evaluated_through_their_codecs_are_predicted_uncompressed(shards, tmp_path):
    """``train.eval_codec = 'train'`` is how training evaluates; predict stays uncompressed (the
    same on 2 ranks as on 1, which exchanges nothing), and a stale run evaluated on kept rows
    through its codecs predicts too (was refused: predict's synchronous config broke the rule)."""
    from hpcgnn.predict import read_predictions
    sched, d = "configs/schedules/quant1-all.toml", shards("cora", 2)
    runs = {"sync": ("configs/cora.toml", []),
            "stale": ("configs/sylvie.toml", ["train.eval_features=kept", "model.hidden=16"])}
    jobs = []
    for name, (config, sets) in runs.items():
        jobs.append((["train", "--shards", d, "--out", tmp_path / name, "--config", config,
                      "--schedule", sched, *(a for s in ["train.epochs=4", "train.eval_codec=train",
                                                         *sets] for a in ("--set", s))], {}))
        jobs.append((["predict", "--run", tmp_path / name, "--shards", d, "--out",
                      tmp_path / f"{name}-p2"], {}))
    for proc in run_together(2, jobs, tmp_path / "jobs"):
        check_ok(proc)
    check_ok(predict(1, tmp_path / "sync", shards("cora", 1), tmp_path / "sync-p1"))
    two, one = read_predictions(tmp_path / "sync-p2"), read_predictions(tmp_path / "sync-p1")
    assert np.array_equal(two["pred"], one["pred"])
    np.testing.assert_allclose(two["logits"], one["logits"], rtol=1e-5, atol=1e-5)
    assert read_predictions(tmp_path / "stale-p2")["pred"].shape == one["pred"].shape


def test_logits_and_embedding_equal_a_dense_gcn(tmp_path):
    """Also on a graph to predict on that has no label at all: its input's ``num_classes`` key
    gives the class count (was: meta.json said 0 classes, and every reader refused the set),
    here on 2 ranks over 4 random parts (merged)."""
    from hpcgnn.data.datasets import load_dataset
    from hpcgnn.predict import read_predictions
    from preprocess import partition_graph, write_shards
    arrays = partly_labelled_npz(tmp_path / "g.npz")
    unlabelled = {**arrays, "labels": np.full(80, -1, np.int64), "num_classes": np.int64(3),
                  **{k: np.zeros(0, np.int64) for k in ("train_idx", "val_idx", "test_idx")}}
    np.savez(tmp_path / "u.npz", **unlabelled)
    for name, k in (("g", 2), ("u", 4)):
        graph = load_dataset(f"npz:{tmp_path / name}.npz")
        write_shards(graph, partition_graph(graph, k, "random", seed=0), tmp_path / f"{name}-shards",
                     partitioner="random", seed=0, force=False, num_parts=k)
    for proc in run_together(2, [(["train", "--shards", tmp_path / "g-shards", "--out", tmp_path / "run",
                                   "--set", "train.epochs=4", "--set", "model.layers=3",
                                   "--set", "model.hidden=6"], {}),
                                 (["predict", "--run", tmp_path / "run", "--shards",
                                   tmp_path / "g-shards", "--out", tmp_path / "pred"], {}),
                                 (["predict", "--run", tmp_path / "run", "--shards",
                                   tmp_path / "u-shards", "--out", tmp_path / "u-pred"], {})],
                             tmp_path / "jobs"):
        check_ok(proc)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["model"]
    hidden, logits = dense_gcn(arrays, state)
    for pred in ("pred", "u-pred"):
        got = read_predictions(tmp_path / pred)
        np.testing.assert_allclose(got["logits"], logits, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["embedding"], hidden, rtol=1e-4, atol=1e-5)
        assert got["embedding"].shape == (80, 6)


def test_predict_errors_end_the_job_on_every_rank(shards, tmp_path):
    from hpcgnn.predict import PredictError, read_predictions
    run = tmp_path / "run"
    check_ok(train(2, shards("cora", 2), run, "train.epochs=2", config="configs/cora.toml",
                   extra=("--stop-after", "0")))                  # records written, no checkpoint
    proc = predict(2, run, shards("cora", 2), tmp_path / "pred")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "[rank 0/2] ERROR rank 0: " in proc.stderr and "checkpoint.pt: not found" in proc.stderr
    assert "[rank 0/2] ERROR rank 1: no error; stopping with the others" in proc.stderr
    (run / "checkpoint.pt").write_bytes(b"PK\x03\x04 torn by a kill")
    proc = predict(2, run, shards("cora", 2), tmp_path / "pred")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "checkpoint.pt: unreadable checkpoint" in proc.stderr and "--resume" not in proc.stderr
    assert "predict needs the run's whole checkpoint" in proc.stderr
    shutil.rmtree(run)
    proc = predict(2, run, shards("cora", 2), tmp_path / "pred")
    assert proc.returncode == 2 and proc.stderr.count("config.toml: not found") == 1
    assert "[rank 0/2] ERROR ranks 0-1: " in proc.stderr
    with pytest.raises(PredictError, match="meta.json: not found"):
        read_predictions(tmp_path / "pred")


@pytest.mark.parametrize("case,ranks,want", [
    ("no run", 2, "config.toml: not found; --run must be a run directory"),
    ("rank count", 3, "the shard set has 2 parts but the job has 3 ranks"),
    ("out is --shards", 2, "is the --shards directory; predict writes part-NNNNN.h5"),
    ("out is --run", 2, "is the --run directory"),
    ("out holds a shard set", 2, "holds a shard set (meta.json is not a prediction's)"),
    ("out holds a run", 2, "holds a finished run"),
    ("out holds a shard's part", 2, "part-00001.h5 is not a prediction part"),
    ("out under a file", 2, "is a file, not a directory"),
    ("out is a file", 2, "exists and is not a directory"),
    ("out cannot be made", 2, "cannot make or write it on this rank"),
    ("out is read only", 2, "cannot make or write it on this rank"),
    ("max message", 2, "config.toml: comm.max_message = 3 is below 4 bytes")])
def test_these_refusals_come_before_torch_is_imported(case, ranks, want, shards, tmp_path):
    """predict's --run without a recorded config, a rank count that does not divide the parts,
    a recorded ``comm.max_message`` below what a call must carry on these ranks, and an --out
    that would overwrite a shard set, a run or an input end every rank before any imports torch
    (``hpcgnn.train.early``), and leave those files as they were. So does an --out that a rank
    cannot make or write (a missing parent it may not create, a read-only directory): each rank
    probes it, naming the path, its host and the fix. (Before: a missing one was made only after
    torch, the shards and the checkpoint were loaded, and a read-only one was found at the first
    part's write, after the forward: exit 4 and an abort.)"""
    run, out = tmp_path / "run", tmp_path / "pred"
    run.mkdir()
    if case != "no run":
        shutil.copy(REPO / "configs" / "cora.toml", run / "config.toml")
    if case == "max message":
        with open(run / "config.toml", "a") as f:
            f.write("\n[comm]\nmax_message = 3\n")
    src = shards("cora", 2)
    if case == "out holds a shard set":
        shutil.copytree(src, out)
    if case == "out holds a run":
        out.mkdir()
        (out / "summary.json").write_text('{"epochs": 3}')
    if case == "out holds a shard's part":
        out.mkdir()
        shutil.copy(src / "part-00001.h5", out)
    if case in ("out under a file", "out is a file"):
        (tmp_path / "afile").write_text("x")
    unmade = unwritable_dir(tmp_path)              # below a read-only folder (root: in sysfs)
    out = {"out is --shards": src, "out is --run": run,
           "out under a file": tmp_path / "afile" / "pred", "out is a file": tmp_path / "afile",
           "out cannot be made": unmade,
           "out is read only": unmade.parent if unmade.parent.exists() else Path("/sys/kernel"),
           }.get(case, out)
    before = {p: p.read_bytes() for d in (src, out) if d.is_dir() and "only" not in case
              for p in d.iterdir()}
    proc = predict(ranks, run, src, out, env={"PYTHONPROFILEIMPORTTIME": "1"})
    refused_before_torch(proc, ranks, want)
    if case.startswith("out is read") or case.startswith("out cannot"):
        assert str(out) in proc.stderr and "Fix: give --out a directory that every rank can write" in proc.stderr
    assert {p: p.read_bytes() for p in before} == before
    if case in ("no run", "rank count"):
        assert not out.exists()


def test_damaged_prediction_parts_are_predict_errors(tmp_path):
    """Every 16th byte of a real prediction part changed in turn: ``read_predictions`` reads it
    or raises one PredictError naming the part, never HDF5's own RuntimeError or KeyError; and
    an output directory holding it is still told apart from a foreign file."""
    import torch

    from hpcgnn.predict import PredictError, read_predictions, write_part
    from hpcgnn.train.outdir import is_prediction_part
    n = 12
    write_part(tmp_path, 0, 1, 3, {"global_id": torch.arange(n), "pred": torch.zeros(n, dtype=torch.int64),
                                   "logits": torch.randn(n, 3), "embedding": torch.randn(n, 4)})
    (tmp_path / "meta.json").write_text(json.dumps({"format_version": 1, "num_parts": 1, "num_nodes": n,
                                                    "num_classes": 3, "epochs_done": 3}))
    path = tmp_path / "part-00000.h5"
    good, refused = path.read_bytes(), 0
    for at in range(0, len(good), 16):
        data = bytearray(good)
        data[at:at + 8] = bytes(b ^ 0xA5 for b in data[at:at + 8])
        path.write_bytes(data)
        is_prediction_part(path)                      # True or False, never an exception
        try:
            read_predictions(tmp_path)
        except PredictError as exc:
            assert str(tmp_path) in str(exc), exc         # the part, or the directory
            refused += 1
    assert refused > 20


def test_a_recorded_schedule_this_version_refuses_is_set_aside_unless_learned(shards, tmp_path):
    """A run of an earlier version may hold a ``schedule.toml`` that today's checks refuse (a key
    its codec does not use, an empty file). Predict runs uncompressed and needs the schedule only
    for a learned codec's modules, so it predicts such a run with a warning; a refused schedule
    that names ``learned`` still ends the job, since the model would not fit the checkpoint."""
    from hpcgnn.predict import read_predictions
    run, d = tmp_path / "run", shards("cora", 2)
    check_ok(train(2, d, run, "train.epochs=2", config="configs/cora.toml",
                   extra=("--schedule", "configs/schedules/quant2-all.toml")))
    check_ok(predict(2, run, d, tmp_path / "p0"))
    (run / "schedule.toml").write_text((run / "schedule.toml").read_text() + "keep = 0.5\n")
    proc = predict(2, run, d, tmp_path / "p1")
    check_ok(proc)
    assert "key 'keep'" in proc.stderr and "goes on without it" in proc.stderr
    assert np.array_equal(read_predictions(tmp_path / "p1")["logits"],
                          read_predictions(tmp_path / "p0")["logits"])
    (run / "schedule.toml").write_text('codec = "learned"\nkind = "constant"\nratio = 2.0\n'
                                       'keep = 0.5\n')
    proc = predict(2, run, d, tmp_path / "p2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "key 'keep'" in proc.stderr


def test_a_part_is_written_without_a_copy_of_its_arrays(tmp_path):
    """``write_part`` builds the part's HDF5 image in memory: that image is its peak, not the
    image plus a float32 copy of float32 arrays (on 2 ranks of a 300k-node cSBM, SAGE hidden 256,
    writing a part took 300 MiB above the rank's resident set, now 154: its embedding's size)."""
    import tracemalloc

    from hpcgnn.predict import read_predictions, write_part
    from hpcgnn.train.outdir import PRED_VERSION
    n, hidden = 20000, 256
    arrays = {"global_id": torch.arange(n), "pred": torch.arange(n) % 8,
              "logits": torch.rand(n, 8), "embedding": torch.rand(n, hidden)}
    write_part(tmp_path, 0, 1, 1, arrays)                   # warm, outside the count
    tracemalloc.start()
    try:
        write_part(tmp_path, 0, 1, 1, arrays)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    (tmp_path / "meta.json").write_text(json.dumps({"format_version": PRED_VERSION,
                                                    "num_parts": 1, "num_nodes": n}))
    got = read_predictions(tmp_path)
    for name, a in arrays.items():
        np.testing.assert_array_equal(got[name], a.numpy())
    image = sum(a.numel() * a.element_size() for a in arrays.values())
    assert peak <= 1.25 * image + (1 << 20), f"peak {peak / 2**20:.1f} MiB, image {image / 2**20:.1f} MiB"
