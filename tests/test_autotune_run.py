"""``kind = "auto"`` in whole training runs on real ranks: it records its decisions, its budget
never rises, the codecs it decides are the ones sent (bytes), it learns as full communication
does, and a stopped-and-resumed run equals the straight one bit for bit (losses, decisions).
This file is also the MPI worker (one launch, several trainings)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import check_ok, read_metrics, run_mpi  # noqa: E402

GRAPH = "csbm:nodes=3000,classes=4,degree=8,features=48,seed=3"
RUN = """
[model]
hidden = 16
layers = 2
[train]
epochs = 40
eval_every = 5
lr = 0.05
"""
# lr 0.05: the loss slows within the 40 epochs, so the budget falls and the codecs change
SCHEDULES = {"full": 'codec = "none"\nkind = "constant"\nratio = 1.0\n',
             "auto": 'kind = "auto"\n',
             "auto-bytes": 'kind = "auto"\nobjective = "bytes"\n'}


def _launch(ranks: int, shard_dir, tmp_path, jobs: list[str]):
    (tmp_path / "run.toml").write_text(RUN)
    for name, text in SCHEDULES.items():
        (tmp_path / f"{name}.toml").write_text(text)
    check_ok(run_mpi(ranks, [__file__, str(shard_dir), str(tmp_path), *jobs], timeout=300))


def _checks(metrics: list[dict]) -> list[dict]:
    return [r for r in metrics if "auto" in r]


@pytest.mark.mpi
def test_auto_records_decisions_budget_falls_and_learns(shards, tmp_path):
    _launch(3, shards(GRAPH, 3, "random"), tmp_path, ["full", "auto", "auto-bytes"])
    full = read_metrics(tmp_path / "full")
    reference = json.loads((tmp_path / "full" / "summary.json").read_text())
    for name in ("auto", "auto-bytes"):
        auto = read_metrics(tmp_path / name)
        checks = _checks(auto)
        assert [r["epoch"] for r in checks] == list(range(0, 40, 5))     # every = 5
        assert all(0 <= r["auto"]["seconds"] < 5 for r in checks)        # the check's own time
        budgets = [r["auto"]["budget"] for r in checks]
        assert all(a >= b for a, b in zip(budgets, budgets[1:])) and budgets[-1] < budgets[0]
        first = checks[0]["auto"]
        start = first["start"]                  # before epoch 0: the prior bound, maybe the link
        assert set(start["bits"]) == {"0/forward", "0/backward", "1/forward", "1/backward"}
        if name == "auto-bytes":                # widths 16 and 4: 2 bits' bound is 0.9 and 0.23
            assert set(start["bits"].values()) == {2} and start["samples"] == []
        else:                                   # two sizes of the link timed
            assert len(start["samples"]) == 2 and start["samples"][0][0] > start["samples"][1][0]
            # 1 bit's bound is 8.1 and 2.0 at widths 16 and 4: ruled out, so not timed
            assert all(set(e["error"]) == {"2", "4", "8", "32"} for e in start["exchanges"])
        assert first["probed"] and {(e["layer"], e["direction"]) for e in first["exchanges"]} == \
            {(0, "forward"), (0, "backward"), (1, "forward"), (1, "backward")}
        for e in first["exchanges"]:                                     # measured, and sensible
            errs = [e["error"][b] for b in ("1", "2", "4", "8")]
            assert errs == sorted(errs, reverse=True) and errs[-1] > 0 and e["error"]["32"] == 0
        for r in auto:                          # what was sent follows the decisions in force
            decided = _in_force(checks, r["epoch"])
            assert r["ratio"] == [32 / decided[(i, "forward")] for i in range(2)]
            compressed = any(b != 32 for b in decided.values())
            assert (r["bytes_sent"] < r["bytes_full"]) == compressed
        if name == "auto":                      # the steps' agreed seconds reach the checks
            steps = [r["auto"]["steps"] for r in checks]
            timed = [v for st in steps for v in (st["median_s"], st["fp32_median_s"]) if v]
            assert timed and all(0 < v <= max(r["epoch_s"] for r in auto) * 1.01 for v in timed)
            for r, st in zip(checks, steps):    # a check that overrules sends fp32 everywhere
                assert st["verdict"] in ("keep", "reference", "fp32")
                if st["verdict"] != "keep":
                    assert {e["bits"] for e in r["auto"]["exchanges"]} == {32}
        else:
            assert all("steps" not in r["auto"] for r in checks)
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["test_acc"] > 0.5 and summary["test_acc"] >= reference["test_acc"] - 0.03
        assert full[-1]["loss"] < full[0]["loss"] and auto[-1]["loss"] < auto[0]["loss"]
        # on the time objective, shared memory may make fp32 the cheapest everywhere (that is
        # its purpose); fewest bytes within the budget must compress while the budget admits it
        if name == "auto-bytes":
            assert summary["bytes_sent"] < reference["bytes_sent"]
        else:
            assert summary["bytes_sent"] <= reference["bytes_sent"]


def _in_force(checks: list[dict], epoch: int) -> dict:
    """The bits per (layer, direction) decided at the last check before ``epoch`` (epoch 0:
    those of the start, recorded in epoch 0's ``auto``)."""
    before = [r for r in checks if r["epoch"] < epoch]
    if not before:
        start = checks[0]["auto"]["start"]["bits"]
        return {(int(k.split("/")[0]), k.split("/")[1]): b for k, b in start.items()}
    return {(e["layer"], e["direction"]): e["bits"] for e in before[-1]["auto"]["exchanges"]}


@pytest.mark.mpi
def test_auto_resume_is_bit_for_bit(shards, tmp_path):
    _launch(2, shards(GRAPH, 2, "random"), tmp_path, ["auto-bytes", "auto-bytes:split"])
    straight = read_metrics(tmp_path / "auto-bytes")
    resumed = read_metrics(tmp_path / "auto-bytes-split")
    assert len(straight) == len(resumed) == 40
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r["bytes_sent"] for r in resumed] == [r["bytes_sent"] for r in straight]
    assert _decisions(resumed) == _decisions(straight)
    assert len({b for r in _checks(straight) for b in _bits(r)}) > 1   # it did change codecs


@pytest.mark.mpi
def test_auto_leaves_a_kept_first_layer_out(shards, tmp_path):
    """With ``train.keep_features`` the first layer exchanges nothing in training: the controller
    measures and decides the second layer alone, sends exactly its bytes, and resumes bit for
    bit."""
    _launch(2, shards(GRAPH, 2, "random"), tmp_path, ["auto-bytes+keep", "auto-bytes+keep:split",
                                                      "full+keep"])
    straight = read_metrics(tmp_path / "auto-bytes+keep")
    resumed = read_metrics(tmp_path / "auto-bytes+keep-split")
    full = read_metrics(tmp_path / "full+keep")
    assert {e["layer"] for r in _checks(straight) for e in r["auto"]["exchanges"]} == {1}
    start = straight[0]["auto"]["start"]                 # what epoch 0 sends, decided before it
    assert {e["layer"] for e in start["exchanges"]} == {1} and set(start["bits"]) == {"1/forward", "1/backward"}
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert _decisions(resumed) == _decisions(straight)
    assert len({b for r in _checks(straight) for b in _bits(r)}) > 1   # it did change codecs
    # epoch 0 fetches the features' halo rows uncompressed; after it, what layer 1's codec sends
    assert straight[0]["bytes_sent"] > straight[1]["bytes_sent"]
    assert all(r["bytes_sent"] < f["bytes_sent"] for r, f in zip(straight[1:], full[1:])
               if any(b < 32 for b in _bits(_last_check(straight, r["epoch"]))))


def _last_check(metrics: list[dict], epoch: int) -> dict:
    """The last check before ``epoch`` (its decision is what ``epoch`` sent)."""
    return [r for r in _checks(metrics) if r["epoch"] < epoch][-1]


def _bits(record: dict) -> list[int]:
    return [e["bits"] for e in record["auto"]["exchanges"]]


def _decisions(metrics: list[dict]) -> list:
    """What every check decided and why (timing left out: the 'bytes' objective ignores it)."""
    return [(r["epoch"], r["auto"]["budget"], r["auto"]["probed"],
             [(e["layer"], e["direction"], e["bits"], e["error"]) for e in r["auto"]["exchanges"]])
            for r in _checks(metrics)]


def _worker(shard_dir: str, out: str, jobs: list[str]) -> None:
    """Each job ``NAME`` trains schedule NAME into OUT/NAME; ``NAME:split`` stops after 17
    epochs (a check, 15, and a probe epoch, 10, behind it) and resumes into OUT/NAME-split;
    ``NAME+keep`` trains with ``train.keep_features = true``."""
    from hpcgnn.__main__ import main
    for job in jobs:
        name, _, split = job.partition(":")
        sched, _, keep = name.partition("+")         # NAME+keep: train.keep_features = true
        args = ["train", "--shards", shard_dir, "--config", f"{out}/run.toml",
                "--schedule", f"{out}/{sched}.toml", "--out", f"{out}/{name}{'-split' if split else ''}"]
        args += ["--set", "train.keep_features=true"] if keep else []
        runs = [args + ["--stop-after", "17"], args + ["--resume"]] if split else [args]
        for argv in runs:
            assert main(argv) == 0, argv


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3:])


@pytest.mark.mpi
def test_one_rank_auto_writes_strict_json(shards, tmp_path):
    """One rank exchanges nothing, so the predicted gain over fp32 is unbounded: metrics.jsonl
    holds null for it, not Python's ``Infinity`` (not JSON; jq and most readers refuse it)."""
    from conftest import train

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    (tmp_path / "auto.toml").write_text(SCHEDULES["auto"])
    (tmp_path / "run.toml").write_text(RUN)
    check_ok(train(1, shards(GRAPH, 1, "random"), tmp_path / "run", "train.epochs=15",
                   config=str(tmp_path / "run.toml"), extra=("--schedule", str(tmp_path / "auto.toml"))))
    records = [json.loads(line, parse_constant=refuse)
               for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["auto"]["steps"] for r in records if "auto" in r and "steps" in r["auto"]]
    assert steps and all(s["predicted_gain"] is None for s in steps), steps


@pytest.mark.mpi
def test_auto_start_decides_no_backward_where_the_first_layer_sends_the_features(shards, tmp_path):
    """With 48 features and 64 hidden channels the first layer exchanges the features (its
    cheaper order) and they need no gradient: it has no backward exchange. The start decided,
    timed and recorded bits for it all the same ('0/backward' in what epoch 0 'sent', and in
    every setting's signature): epoch 0's record must hold the exchanges epoch 0 made, and its
    bytes what they sent at the recorded bits."""
    from conftest import train
    from test_eval_codec import quant_row_bytes as _row_bytes

    from hpcgnn.data.shard import read_shard
    ranks, shard_dir = 2, shards(GRAPH, 2, "random")
    (tmp_path / "auto.toml").write_text(SCHEDULES["auto-bytes"])
    (tmp_path / "run.toml").write_text(RUN)
    proc = train(ranks, shard_dir, tmp_path / "run", "train.epochs=3", "model.hidden=64",
                 config=str(tmp_path / "run.toml"), extra=("--schedule", str(tmp_path / "auto.toml")))
    check_ok(proc)
    told = [line for line in (proc.stdout + proc.stderr).splitlines() if "epoch 0 sends" in line]
    # the bytes objective times nothing: the log showed a link of '0 ms + 0 ns/B (timed ...)'
    assert len(told) == 1 and "0/backward" not in told[0] and "timed" not in told[0], told
    epoch0 = read_metrics(tmp_path / "run")[0]
    start = epoch0["auto"]["start"]["bits"]
    assert set(start) == {"0/forward", "1/forward", "1/backward"}, start
    # layer 0 sends the 48 features, layer 1 its transform to the 4 classes, forward and back;
    # every row one rank sends, another receives: the same row count each way
    rows = sum(int(read_shard(shard_dir / f"part-{p:05d}.h5").send_counts.sum()) for p in range(ranks))
    fetch = rows * (_row_bytes(48, start["0/forward"]) + _row_bytes(4, start["1/forward"])
                    + _row_bytes(4, start["1/backward"]))
    assert epoch0["bytes_sent"] == fetch


@pytest.mark.mpi
def test_auto_start_says_nothing_is_sent_where_the_parts_share_no_edge(tmp_path):
    """Two parts that each own a whole component exchange no row: the start's log said
    'auto: epoch 0 sends' with nothing after it. It must say that nothing is sent, and the
    run must train with no halo byte."""
    from conftest import train
    from _graphs import two_components

    import numpy as np

    from preprocess import write_shards
    shard_dir = tmp_path / "islands"              # the triangle on part 0, the path on part 1
    write_shards(two_components(), np.array([0, 0, 0, 1, 1, 1, 1, 1]), shard_dir,
                 partitioner="metis", seed=0, force=False, num_parts=2)
    (tmp_path / "auto.toml").write_text(SCHEDULES["auto"])
    proc = train(2, shard_dir, tmp_path / "run", "train.epochs=2", "model.hidden=8",
                 extra=("--schedule", str(tmp_path / "auto.toml")))
    check_ok(proc)
    told = [line for line in (proc.stdout + proc.stderr).splitlines() if "epoch 0 sends" in line]
    assert len(told) == 1 and told[0].rstrip().endswith("no rank sends a halo row)"), told
    assert all(r["bytes_sent"] == 0 for r in read_metrics(tmp_path / "run"))
