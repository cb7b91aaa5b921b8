"""``train.eval_codec = "train"``: evaluation exchanges through the training schedule's codecs,
built for the rows evaluation sends. A stale layer's training steps exchange its input, while
evaluation exchanges synchronously (the transformed rows where that is narrower), so the codec
of an evaluation must be made for the synchronous width: made for the input width, a channel
codec kept too many channels (silently less compression than the schedule says) or more
channels than the row has (a ValueError in the first evaluation, after training had begun).
The last evaluation's figures are those of the whole-graph model of the checkpoint fed the
truncated rows (``test_directed_methods.eval_through_codecs``), on 2 ranks of an undirected
graph here."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import check_ok, read_metrics, train_together  # noqa: E402

from hpcgnn.data.shard import read_shard  # noqa: E402

GRAPH = "csbm:nodes=600,classes=4,degree=6,features=48,seed=5"
HIDDEN, CLASSES, RATIO = 16, 4, 4
# 48 features > 2 x 16 hidden and 16 > 2 x 4 classes: a synchronous layer transforms first and
# sends 16 and 4 channels; a stale layer's training steps send their inputs, 48 and 16 wide
SYNC_WIDTHS = (HIDDEN, CLASSES)
SCHEDULE = f'codec = "truncate"\nkind = "constant"\nratio = {RATIO}.0\ncompress_last_layer = true\n'


def eval_bytes_by_hand(shard_dir: Path, ranks: int, layers: tuple[int, ...]) -> int:
    """One evaluation's bytes: every boundary row of ``layers``, truncated to
    ``max(1, w // RATIO)`` fp32 channels of its synchronous width ``w``."""
    rows = sum(int(read_shard(shard_dir / f"part-{p:05d}.h5").send_counts.sum())
               for p in range(ranks))
    return rows * sum(4 * max(1, SYNC_WIDTHS[i] // RATIO) for i in layers)


@pytest.mark.mpi
@pytest.mark.parametrize("arch", ["gcn", "gat"])
def test_stale_evaluation_codecs_fit_the_synchronous_rows(arch, shards, tmp_path):
    ranks = 2
    shard_dir = shards(GRAPH, ranks, "metis")
    (tmp_path / "s.toml").write_text(SCHEDULE)
    base = [f"model.arch={arch!r}", f"model.hidden={HIDDEN}", "model.layers=2", "train.epochs=2",
            "train.eval_codec='train'"]
    runs = {"sync": base + ["train.eval_features='exchange'"],
            "stale": base + ["train.staleness=1", "train.eval_features='exchange'"],
            "stale-kept": base + ["train.staleness=1"]}          # the first layer on kept rows
    procs = train_together(ranks, [(shard_dir, tmp_path / name, sets, {},
                                    ("--schedule", str(tmp_path / "s.toml")))
                                   for name, sets in runs.items()], tmp_path / "work")
    for proc in procs:
        check_ok(proc)
    both = eval_bytes_by_hand(shard_dir, ranks, (0, 1))
    want = {"sync": both, "stale": both, "stale-kept": eval_bytes_by_hand(shard_dir, ranks, (1,))}
    for name in runs:
        assert [r["eval_bytes"] for r in read_metrics(tmp_path / name)] == [want[name]] * 2, name
    # the figures: the whole-graph model of the checkpoint fed the first max(1, w // 4) channels
    # of each halo row (the first layer's exact rows where kept), as test_directed_methods does
    from test_directed_methods import eval_through_codecs, split_figures
    arrays = graph_arrays(GRAPH)
    truncate = (1.0, "truncate", 32, RATIO)
    for name in runs:
        last = read_metrics(tmp_path / name)[-1]
        state = torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)["model"]
        codecs = [None if name == "stale-kept" else truncate, truncate]
        got = split_figures(eval_through_codecs(arch, codecs, state, arrays, shard_dir,
                                                last["epoch"]), arrays)
        for key in ("train_acc", "val_acc", "test_acc"):
            assert last[key] == pytest.approx(got[key], abs=1e-9), (name, key)
        assert last["val_loss"] == pytest.approx(got["val_loss"], rel=1e-6), name


def graph_arrays(spec: str) -> dict:
    """The npz-style arrays of a dataset spec (``test_directed.as_graph``'s input)."""
    from hpcgnn.data.datasets import load_dataset
    g = load_dataset(spec)
    return {"num_nodes": g.num_nodes, "adj_indptr": g.indptr, "adj_indices": g.indices,
            "features": np.asarray(g.dense_features(), np.float32), "labels": g.labels,
            "train_idx": g.train_idx, "val_idx": g.val_idx, "test_idx": g.test_idx}


def quant_row_bytes(width: int, bits: int) -> int:
    """The documented wire size of one row: fp32, or lo (4) + step (2) + packed codes."""
    return 4 * width if bits == 32 else 6 + -(-width * bits // 8)


@pytest.mark.mpi
def test_auto_evaluation_uses_the_codecs_its_epoch_trained_with(shards, tmp_path):
    """``kind = "auto"`` decides at a check after the epoch's step: an evaluation of that epoch
    through the training codecs must send what the step sent, not the next epoch's decision
    (the bits in force: the start's for epochs 0..every, then the last check's before it)."""
    ranks, every = 2, 5
    shard_dir = shards(GRAPH, ranks, "random")
    (tmp_path / "auto.toml").write_text(f'kind = "auto"\nobjective = "bytes"\nevery = {every}\n')
    sets = [f"model.hidden={HIDDEN}", "model.layers=2", "train.epochs=40", "train.lr=0.05",
            "train.eval_codec='train'", "train.eval_every=1"]
    check_ok(train_together(ranks, [(shard_dir, tmp_path / "run", sets, {},
                                     ("--schedule", str(tmp_path / "auto.toml")))],
                            tmp_path / "work")[0])
    metrics = read_metrics(tmp_path / "run")
    rows = sum(int(read_shard(shard_dir / f"part-{p:05d}.h5").send_counts.sum())
               for p in range(ranks))
    changed = 0
    for r, in_force in bits_in_force(metrics):
        want = rows * sum(quant_row_bytes(SYNC_WIDTHS[i], in_force[f"{i}/forward"])
                          for i in range(2))
        assert r["eval_bytes"] == want, (r["epoch"], r["eval_bytes"], want)
        if "auto" in r:
            new = decision(r)
            changed += any(new[k] != in_force[k] for k in new if k.endswith("forward"))
    assert changed, "the run must change a forward decision at some check"


def decision(line: dict) -> dict:
    """The bits a ``kind = "auto"`` check decided, by ``"layer/direction"``."""
    return {f"{e['layer']}/{e['direction']}": e["bits"] for e in line["auto"]["exchanges"]}


def bits_in_force(metrics: list[dict]):
    """``(line, bits)`` of every metrics line of a ``kind = "auto"`` run: the bits each exchange
    (``"layer/direction"``) trained and evaluated with at that epoch, from the records alone:
    the start's (epoch 0's ``auto.start``) up to the first check, then from the epoch after
    each check that check's decision."""
    in_force = dict(next(r for r in metrics if "auto" in r)["auto"]["start"]["bits"])
    for r in metrics:
        yield r, in_force
        if "auto" in r:                  # from the next epoch on: this check's decision
            in_force = decision(r)
