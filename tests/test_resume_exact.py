"""``--stop-after K`` + ``--resume`` equals the uninterrupted run bit for bit on 2 real ranks, for
the methods the other resume tests leave out (``test_train_resume``, ``test_run_records``,
``test_methods_exact``, ``test_stale_checkpoint``, ``test_autotune_run``, ``test_retexo``,
``test_cagnet_2d3d`` have the rest): GAT with attention dropout, an exponential curve, VARCO's
learned codec (its encoder, decoder and their Adam state are in the compared checkpoint),
PipeGCN's staleness 1 with smoothing, a synchronous run that keeps the features' halo rows
for evaluation (``train.eval_features = "kept"``) stopped between two evaluations of
``train.eval_every = 3``, halves run with ``HPCGNN_MAX_MESSAGE=4096`` (every collective and
the checkpoint's broadcast in pieces) against an uninterrupted run without it, and one whose best
validation epoch comes before the stop and is not beaten after it (summary.json's test_acc and
best_epoch come from the checkpoint); and CAGNET's 1.5D (c = 2) and 2D on 4 ranks. Compared:
every metrics line (timings aside), the final checkpoint's model and optimiser tensors, and
summary.json's accuracies and byte counts (each rank's too, ``per_rank``: a line's window across
the stop between two evaluations included). The runs of each rank count are one mpiexec job
(``conftest.train_together``)."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import CSBM, check_ok, read_metrics, train_together

pytestmark = pytest.mark.mpi

BASE = ("model.hidden=8", "model.dropout=0.5", "train.epochs=7")
EXPONENTIAL = ('codec = "truncate"\nkind = "exponential"\nmax_ratio = 8.0\nmin_ratio = 1.0\n'
               'slope = 3.0\n')
LEARNED = 'codec = "learned"\nkind = "linear"\nmax_ratio = 4.0\nmin_ratio = 1.0\nslope = 1.0\n'
# name: (--set list, schedule text or None, --stop-after)
CASES = {
    "gat-attention-dropout": (("model.arch=gat", "model.heads=2", "model.attn_dropout=0.3"), None, 3),
    "exponential-truncate": ((), EXPONENTIAL, 3),
    "learned": ((), LEARNED, 2),
    "pipegcn-s1-smoothing": (("train.staleness=1", "train.smoothing=0.95"), None, 3),
    # evaluations at epochs 2, 5 and 6 (the last): the stop after 4 epochs is between two
    "eval-kept-every-3": (("train.eval_features=kept", "train.eval_every=3"), None, 4),
    # the stopped and resumed halves with every MPI call cut to 4 KiB (below): the halo
    # exchange in rounds, the gradient Allreduce, the parameters' Bcast and the checkpoint's
    # bytes at --resume in pieces; 2 ranks, so a sum in pieces is the same sum
    "max-message-4k": ((), None, 3),
    # lr 0.3: validation accuracy peaks at epoch 4 and the last two epochs stay below it, so
    # the resumed run's summary must carry the best epoch's figures from the checkpoint
    "best-before-the-stop": (("train.lr=0.3",), None, 5),
}
# environment of the stopped and resumed halves (the uninterrupted run has none)
SPLIT = {"max-message-4k": {"HPCGNN_MAX_MESSAGE": "4096"}}
BEST_BEFORE_THE_STOP = "best-before-the-stop"
TIMINGS = {"epoch_s", "comm_s", "codec_s", "eval_s", "wall_s"}
SUMMARY_KEYS = ("test_acc", "final_test_acc", "best_val_acc", "best_epoch", "epochs", "bytes_sent",
           "bytes_full", "allreduce_bytes", "eval_bytes")


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory):
    """name -> (uninterrupted run dir, stopped-and-resumed run dir), all in one 2-rank job."""
    root = tmp_path_factory.mktemp("resume-exact")
    shard_dir, jobs, dirs = shards("cora", 2), [], {}
    for name, (sets, schedule, stop) in CASES.items():
        extra = ()
        if schedule is not None:
            (root / f"{name}.toml").write_text(schedule)
            extra = ("--schedule", str(root / f"{name}.toml"))
        sets = (*BASE, *sets)
        full, part = root / name / "full", root / name / "part"
        env = SPLIT.get(name, {})
        jobs += [(shard_dir, full, sets, {}, extra),
                 (shard_dir, part, sets, env, (*extra, "--stop-after", str(stop))),
                 (shard_dir, part, sets, env, (*extra, "--resume"))]
        dirs[name] = (full, part)
    done = train_together(2, jobs, root)
    for i, name in enumerate(CASES):
        for proc in done[3 * i: 3 * i + 3]:
            check_ok(proc)
        assert f"stopped after {CASES[name][2]} epochs" in done[3 * i + 1].stderr
    return dirs


def untimed(run_dir) -> list[dict]:
    """The metrics lines without timings (``per_rank``'s too: its byte counts stay)."""
    return [{k: (_untimed_ranks(v) if k == "per_rank" else v) for k, v in r.items()
             if k not in TIMINGS} for r in read_metrics(run_dir)]


def _untimed_ranks(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if k not in ("step_s", "comm_s", "compute_s")}


def same_tensors(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("case", list(CASES))
def test_stopped_and_resumed_equals_the_uninterrupted_run(case, runs):
    full, part = runs[case]
    assert len({r["loss"] for r in read_metrics(full)}) == 7      # it trained
    if case == BEST_BEFORE_THE_STOP:
        assert json.loads((full / "summary.json").read_text())["best_epoch"] < CASES[case][2]
    same_runs(full, part, 7)
    assert json.loads((full / "summary.json").read_text())["bytes_sent"] > 0


def same_runs(full, part, epochs: int) -> None:
    """Run ``part`` ends where ``full`` does: the same metrics lines (timings aside), final
    checkpoint tensors (model, optimiser) and summary.json accuracies and byte counts."""
    want, got = untimed(full), untimed(part)
    assert [r["epoch"] for r in got] == list(range(epochs))
    for w, g in zip(want, got):
        assert g == w, {k: (w.get(k), g.get(k)) for k in w.keys() | g.keys() if w.get(k) != g.get(k)}
    cw, cg = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (full, part))
    for key in ("model", "optimizer"):
        same_tensors(cw[key], cg[key], key)
    sw, sg = (json.loads((d / "summary.json").read_text()) for d in (full, part))
    assert {k: sg[k] for k in SUMMARY_KEYS} == {k: sw[k] for k in SUMMARY_KEYS}
    # each rank's bytes over the whole run, carried through the checkpoint
    assert _untimed_ranks(sg["per_rank"]) == _untimed_ranks(sw["per_rank"])


def test_cagnet_stopped_and_resumed_equals_the_uninterrupted_run(shards, tmp_path):
    """1.5D (K = 2 parts, c = 2) and 2D (q = 2, K = 4), dropout 0.5, on 4 ranks, one job."""
    cases = {"1.5d": (shards(CSBM, 2), ("parallel.algorithm=1.5d", "parallel.replication=2")),
             "2d": (shards(CSBM, 4), ("parallel.algorithm=2d",))}
    jobs = []
    for name, (shard_dir, sets) in cases.items():
        sets = (*BASE, *sets)
        jobs += [(shard_dir, tmp_path / name / "full", sets, {}),
                 (shard_dir, tmp_path / name / "part", sets, {}, ("--stop-after", "3")),
                 (shard_dir, tmp_path / name / "part", sets, {}, ("--resume",))]
    for proc in train_together(4, jobs, tmp_path):
        check_ok(proc)
    for name in cases:
        same_runs(tmp_path / name / "full", tmp_path / name / "part", 7)
