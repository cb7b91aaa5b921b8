"""RETEXO (``train.method = "retexo"``) against a plain single-process, whole-graph, stage-wise
training written here in dense torch; 2, 3 and 4 ranks (uneven METIS parts) against 1 rank;
bytes per stage against a count made from the shard files; resume mid-stage and at a stage
boundary (with a compressing, stochastically rounding codec) against the uninterrupted run;
``hpcgnn predict`` against the dense stack; config errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from conftest import CSBM, check_ok, initial_params, read_metrics, run_mpi, train, train_here
from test_resume_exact import untimed

LAYERS, HIDDEN, ROUNDS, CLASSES, FEATS = 3, 8, 3, 4, 24
TABLE = (3.0, 2.0, 1.0)          # the resume test's table schedule: stage l's ratio (3 | FEATS)
SETS = ("train.method=retexo", f"model.layers={LAYERS}", f"model.hidden={HIDDEN}",
        f"train.rounds_per_layer={ROUNDS}", f"train.epochs={LAYERS * ROUNDS}", "train.lr=0.05")


def retexo_sets(arch: str, dropout: float) -> tuple[str, ...]:
    return (*SETS, f"model.arch={arch}", f"model.dropout={dropout}")


# -- the single-process reference -----------------------------------------------------------

def operator(arch: str, spec: str = CSBM) -> tuple[torch.Tensor, object]:
    """Dense ``(N, N)``: GCN ``D^-1/2 (A + I) D^-1/2`` (D = in-degree + 1), SAGE the mean over
    in-neighbours; and the graph ``spec``."""
    from hpcgnn.data.datasets import load_dataset
    g = load_dataset(spec)
    a = sp.csr_matrix((np.ones(g.num_edges), g.indices, g.indptr), shape=(g.num_nodes,) * 2).toarray()
    deg = a.sum(1)
    if arch == "gcn":
        d = 1.0 / np.sqrt(deg + 1.0)
        return torch.from_numpy(d[:, None] * (a + np.eye(g.num_nodes)) * d[None, :]).float(), g
    return torch.from_numpy(a / np.maximum(deg, 1)[:, None]).float(), g


def dense_stage(arch: str, p: dict, s: int, op: torch.Tensor, x: torch.Tensor):
    """(logits, embedding or None) of stage ``s`` on the whole graph."""
    w, b = p[f"layers.{s}.weight"], p[f"layers.{s}.bias"]
    if arch == "gcn":
        h = op @ x @ w + b
    else:
        out = w.shape[1] // 2
        h = x @ w[:, :out] + op @ x @ w[:, out:] + b
    if f"heads.{s}.weight" not in p:
        return h, None
    e = torch.relu(F.layer_norm(h, (h.shape[1],), p[f"norms.{s}.weight"], p[f"norms.{s}.bias"]))
    return e @ p[f"heads.{s}.weight"].T + p[f"heads.{s}.bias"], e


def dense_retexo(arch: str, init: dict, lr: float = 0.05, wd: float = 5e-4, dropout: float = 0.0,
                 spec: str = CSBM):
    """RETEXO written out: per stage a fresh Adam, ROUNDS full-batch steps on the fixed input,
    the best-validation state kept (strictly greater), its embedding the next input.
    ``dropout``: a fresh mask every round on the whole stage input (every node, the neighbours'
    rows too), nothing dropped after the convolution, none for evaluation or the embedding; the
    bits are hpcgnn's counter-based ones (``keep_mask``, keyed by node id, epoch and stage) so
    the runs can be compared exactly, where they are applied is written here.
    ``spec``: the graph. Returns (losses per round, val accuracy per round, final parameters)."""
    from hpcgnn.nn.dropout import keep_mask
    op, g = operator(arch, spec)
    x, y = torch.from_numpy(g.dense_features()), torch.from_numpy(g.labels)
    tr, va = torch.from_numpy(g.train_idx), torch.from_numpy(g.val_idx)
    ids = torch.arange(g.num_nodes)
    params = {k: v.clone() for k, v in init.items()}
    losses, vals = [], []
    for s in range(LAYERS):
        mine = {k: v.requires_grad_(True) for k, v in params.items()
                if k.startswith((f"layers.{s}.", f"norms.{s}.", f"heads.{s}."))}
        opt = torch.optim.Adam(mine.values(), lr=lr, weight_decay=wd)
        best, best_state = -1.0, None
        for r in range(ROUNDS):
            x_in = x
            if dropout:
                keep = keep_mask(ids, x.shape[1], dropout, 0, s * ROUNDS + r, s)
                x_in = x * keep / (1.0 - dropout)
            logits, _ = dense_stage(arch, params, s, op, x_in)
            loss = F.cross_entropy(logits[tr], y[tr])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            with torch.no_grad():
                val = float((dense_stage(arch, params, s, op, x)[0][va].argmax(1) == y[va]).float().mean())
            vals.append(val)
            if val > best:
                best, best_state = val, {k: v.detach().clone() for k, v in mine.items()}
        for k in mine:
            params[k] = best_state[k]
        with torch.no_grad():
            x = dense_stage(arch, params, s, op, x)[1]
    return losses, vals, params


@pytest.fixture(scope="module")
def init_params(shards):
    """The model's initial parameters per arch (a fresh model's)."""
    return {arch: initial_params(shards(CSBM, 1), *retexo_sets(arch, 0.0)) for arch in ("gcn", "sage")}


@pytest.mark.parametrize("dropout", [0.0, 0.5])
@pytest.mark.parametrize("arch", ["gcn", "sage"])
def test_one_rank_equals_dense_stagewise_training(arch, dropout, shards, init_params, tmp_path):
    recs = train_here(shards(CSBM, 1), tmp_path / "run", *retexo_sets(arch, dropout), config=None)
    losses, vals, final = dense_retexo(arch, init_params[arch], dropout=dropout)
    assert [r["stage"] for r in recs] == [e // ROUNDS for e in range(LAYERS * ROUNDS)]
    assert [r["loss"] for r in recs] == pytest.approx(losses, rel=2e-5)
    assert [r["val_acc"] for r in recs] == pytest.approx(vals, abs=1.5 / 600)
    assert losses[ROUNDS] != pytest.approx(losses[ROUNDS - 1], rel=1e-3)   # a new stage started
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["model"]
    for k, v in final.items():                           # every stage ends at its best state
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5)


# -- R ranks against 1 rank; bytes -------------------------------------------------------------

def halo_rows(shard_dir, ranks: int) -> int:
    from hpcgnn.data.shard import read_shard
    return sum(read_shard(shard_dir / f"part-{r:05d}.h5").n_halo for r in range(ranks))


def stage_param_counts(arch: str) -> list[int]:
    dims = [FEATS] + [HIDDEN] * (LAYERS - 1) + [CLASSES]
    conv = [(a * b * (2 if arch == "sage" else 1) + b) for a, b in zip(dims[:-1], dims[1:])]
    head = 2 * HIDDEN + HIDDEN * CLASSES + CLASSES                  # LayerNorm + Linear
    return [c + (head if s < LAYERS - 1 else 0) for s, c in enumerate(conv)]


@pytest.fixture(scope="module")
def one_rank(shards, tmp_path_factory):
    """1-rank runs with dropout 0.5 (the masks of halo rows are keyed by global id)."""
    runs = {}
    for arch in ("gcn", "sage"):
        runs[arch] = train_here(shards(CSBM, 1), tmp_path_factory.mktemp(f"one-{arch}") / "run",
                                *retexo_sets(arch, 0.5), config=None)
    return runs


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,arch", [(2, "gcn"), (3, "sage"), (4, "gcn")])
def test_ranks_equal_one_rank_and_bytes_per_stage(ranks, arch, shards, one_rank, tmp_path):
    shard_dir = shards(CSBM, ranks, "metis")
    check_ok(train(ranks, shard_dir, tmp_path / "run", *retexo_sets(arch, 0.5), timeout=180))
    got, want = read_metrics(tmp_path / "run"), one_rank[arch]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=2e-5)
    assert [r["test_acc"] for r in got] == pytest.approx([r["test_acc"] for r in want], abs=1.5 / 2100)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    halo = halo_rows(shard_dir, ranks)
    widths = [FEATS] + [HIDDEN] * (LAYERS - 1)
    counts = stage_param_counts(arch)
    assert [rec["stage"] for rec in summary["stages"]] == list(range(LAYERS))   # every stage, once
    for s, rec in enumerate(summary["stages"]):
        assert rec["exchange_bytes"] == halo * widths[s] * 4
        assert rec["allreduce_bytes"] == (counts[s] + 1) * 4 * ranks * ROUNDS
    assert summary["bytes_sent"] == halo * sum(widths) * 4 > 0
    sent = [r["bytes_sent"] for r in got]                          # once per stage, at its start
    assert [e for e, b in enumerate(sent) if b] == [s * ROUNDS for s in range(LAYERS)]
    if ranks == 2:
        check_predict(arch, shard_dir, tmp_path, summary)


def check_predict(arch, shard_dir, tmp_path, summary):
    """``hpcgnn predict`` of the finished run: the dense stack with the checkpoint's weights."""
    from hpcgnn.predict import read_predictions
    proc = run_mpi(2, ["-m", "hpcgnn", "predict", "--run", str(tmp_path / "run"), "--shards",
                       str(shard_dir), "--out", str(tmp_path / "pred")], timeout=120)
    check_ok(proc)
    pred = read_predictions(tmp_path / "pred")
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["model"]
    op, g = operator(arch)
    x = torch.from_numpy(g.dense_features())
    with torch.no_grad():
        for s in range(LAYERS - 1):
            x = dense_stage(arch, state, s, op, x)[1]
        logits = dense_stage(arch, state, LAYERS - 1, op, x)[0]
    np.testing.assert_allclose(pred["embedding"], x.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(pred["logits"], logits.numpy(), rtol=1e-4, atol=1e-5)
    test = g.test_idx
    assert float((pred["pred"][test] == g.labels[test]).mean()) == pytest.approx(summary["test_acc"])


# -- resume -------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_resume_mid_stage_and_at_a_boundary_equals_the_uninterrupted_run(shards, tmp_path):
    """2-bit stochastic rounding on every stage's exchange: a resume rebuilds the stage's input
    through the finished stages' exchanges, which must reproduce the same rows."""
    shard_dir = shards(CSBM, 2, "random")
    sched = tmp_path / "q.toml"
    sched.write_text('codec = "quant"\nbits = 2\ncompress_last_layer = true\n')
    table = tmp_path / "table.toml"              # stage l exchanges at epoch 3 l: ratio 3, 2, 1
    table.write_text('codec = "truncate"\nkind = "table"\ncompress_last_layer = true\n' + "".join(
        f"[[phase]]\nuntil_epoch = {3 * (s + 1)}\nratio = {r}\n" for s, r in enumerate(TABLE)))
    # one launch (start-up dominates): the straight run, then stop at 4 (inside stage 1), resume
    # and stop at 6 (stage 2 starts next), resume to the end — all through the CLI's main()
    check_ok(run_mpi(2, [__file__, str(shard_dir), str(tmp_path), str(sched), str(table)],
                     timeout=300))
    assert [r["epoch"] for r in read_metrics(tmp_path / "stop4")] == list(range(4))
    predict_refuses_unfinished(tmp_path / "stop6", shards(CSBM, 1), tmp_path / "pred")
    assert [r["epoch"] for r in read_metrics(tmp_path / "part")] == list(range(9))
    assert untimed(tmp_path / "part") == untimed(tmp_path / "full")     # per_rank's bytes too
    sf, sp_ = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("full", "part"))
    assert sp_["stages"] == sf["stages"] and sp_["bytes_sent"] == sf["bytes_sent"]
    assert sf["bytes_sent"] < sf["bytes_full"]                     # the codec compressed them
    # the table schedule, train.lr = 0.3: stage l's one exchange takes the ratio of its first
    # epoch 3 l (truncate: width / ratio channels of each halo row); stage 0's best round is
    # its second, the third scores lower, so the run stopped after 2 epochs must finish the
    # stage with the best state its checkpoint holds
    sf, sp_ = (json.loads((tmp_path / d / "summary.json").read_text())
               for d in ("best-full", "best-part"))
    widths = [FEATS] + [HIDDEN] * (LAYERS - 1)
    assert [r["exchange_bytes"] for r in sf["stages"]] == \
        [halo_rows(shard_dir, 2) * int(w / r) * 4 for w, r in zip(widths, TABLE)]
    val = [r["val_acc"] for r in read_metrics(tmp_path / "best-full")]
    assert sf["stages"][0]["best_epoch"] == 1 and val[2] < val[1], val   # the case's premise
    assert untimed(tmp_path / "best-part") == untimed(tmp_path / "best-full")
    assert sp_["stages"] == sf["stages"]


def predict_refuses_unfinished(run_dir, shard_dir, out):
    """In-process (1 rank): predict's start-up on a RETEXO run stopped inside its training."""
    from argparse import Namespace

    from hpcgnn.comm.context import CommContext
    from hpcgnn.predict import build_predictor
    from hpcgnn.train.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match=r"stopped after 6 of 9 epochs \(stage 2 of 3\).*--resume"):
        build_predictor(CommContext.from_world("cpu"), Namespace(run=run_dir, shards=shard_dir, out=out))


# -- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("sets,match", [
    (("train.epochs=200",), r"train.epochs = 200 .*set train.epochs = 400"),
    (("model.arch=gat", "train.epochs=400"), r"model.arch = 'gat'.*retexo.*'gcn' and 'sage'"),
    (("train.epochs=400", "train.staleness=1"), r"train.staleness = 1"),
    (("train.epochs=400", "parallel.algorithm=1.5d"), r"parallel.algorithm = '1.5d'"),
    (("train.rounds_per_layer=0",), r"train.rounds_per_layer = 0"),
])
def test_bad_retexo_configs_name_key_and_fix(sets, match):
    from hpcgnn.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["train.method=retexo", *sets])
    with pytest.raises(ConfigError, match=r"train.method = 'lazy'.*'full' or 'retexo'"):
        load_config(None, ["train.method=lazy"])


def test_learned_codec_is_refused(shards, tmp_path):
    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.schedule import load_schedule
    from hpcgnn.train.build import prepare_trainer
    sched = tmp_path / "l.toml"
    sched.write_text('codec = "learned"\nkind = "constant"\nratio = 2.0\ncompress_last_layer = true\n')
    cfg = load_config(None, list(SETS))
    with pytest.raises(ValueError, match="'learned' codec does not combine with train.method"):
        prepare_trainer(CommContext.from_world("cpu"), cfg, shards(CSBM, 1), tmp_path / "run",
                        load_schedule(sched))


def _resume_worker(shard_dir: str, out: str, schedule: str, table: str) -> None:
    """On every rank: the straight run into OUT/full; OUT/part stopped at 4, resumed and
    stopped at 6 (its metrics then copied to OUT/stop6 for predict), resumed to the end; with
    the ``table`` schedule and train.lr = 0.3, the straight run into OUT/best-full, OUT/best-part
    stopped at 2 and resumed."""
    import shutil
    from pathlib import Path

    from hpcgnn.__main__ import main
    from mpi4py import MPI
    base = ["train", "--shards", shard_dir, "--schedule", schedule]
    for s in retexo_sets("gcn", 0.5):
        base += ["--set", s]
    out = Path(out)
    assert main(base + ["--out", str(out / "full")]) == 0
    assert main(base + ["--out", str(out / "part"), "--stop-after", "4"]) == 0
    if MPI.COMM_WORLD.rank == 0:
        shutil.copytree(out / "part", out / "stop4")
    assert main(base + ["--out", str(out / "part"), "--resume", "--stop-after", "6"]) == 0
    if MPI.COMM_WORLD.rank == 0:
        shutil.copytree(out / "part", out / "stop6")
    MPI.COMM_WORLD.Barrier()
    assert main(base + ["--out", str(out / "part"), "--resume"]) == 0
    base[base.index(schedule)] = table
    base += ["--set", "train.lr=0.3"]      # OUT/best-*: stopped after stage 0's best round
    assert main(base + ["--out", str(out / "best-full")]) == 0
    assert main(base + ["--out", str(out / "best-part"), "--stop-after", "2"]) == 0
    assert main(base + ["--out", str(out / "best-part"), "--resume"]) == 0


if __name__ == "__main__":
    import sys
    _resume_worker(*sys.argv[1:5])
