"""``bench/paired.py``'s statistics: the per-round ratios of each schedule to the first, their
geometric mean and its 95 % Student-t interval, and the rounds that never reached accuracy. On
hand-written rounds; the runs themselves need an idle machine and are not a test."""
import importlib.util
import math
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_paired", Path(__file__).resolve().parents[1] / "bench" / "paired.py")
paired = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(paired)

T975_DF2 = 4.302652729911275          # Student's t, 97.5 % quantile, 2 degrees of freedom (tables)


def test_geometric_mean_and_interval_of_ratios():
    st = paired.ratio_stats([0.5, 2.0, 1.0])
    assert st["geomean"] == pytest.approx(1.0) and st["median"] == 1.0
    assert (st["min"], st["max"], st["below_1"], st["n"]) == (0.5, 2.0, 1, 3)
    half = T975_DF2 * math.log(2.0) / math.sqrt(3)        # sd of (-ln 2, ln 2, 0) is ln 2
    assert st["ci95"] == pytest.approx([math.exp(-half), math.exp(half)])


def test_no_ratio_no_statistics():
    assert paired.ratio_stats([None, None]) is None
    assert "ci95" not in paired.ratio_stats([1.2])


def test_each_schedule_against_the_first_round_by_round():
    def run(step, wall, tta=None):
        return {"epoch_s": step, "epoch_wall_s": wall, "tta_s": tta, "tta_wall_s": tta}
    rounds = [{"full": run(1.0, 2.0, 4.0), "b": run(1.1, 2.0, 2.0)},
              {"full": run(2.0, 3.0, 4.0), "b": run(2.2, 1.5, None)}]
    got = paired.compare(rounds, ["full", "b"])["b"]
    assert got["step"]["geomean"] == pytest.approx(1.1) and got["step"]["below_1"] == 0
    assert got["wall"]["geomean"] == pytest.approx(math.sqrt(0.5))
    assert got["tta"]["n"] == 1 and got["tta"]["geomean"] == pytest.approx(0.5)
    assert got["tta_never"] == 1
    assert got["rss"] is None                       # runs without the figure: no ratio
    # a full-communication variant (the same model) is the target where plain full did not run
    keep = [{k.replace("full", "full@keep"): v for k, v in rnd.items()} for rnd in rounds]
    assert paired.compare(keep, ["full@keep", "b"])["b"]["tta"]["geomean"] == pytest.approx(0.5)
    assert paired.accuracy_reference(["b", "full@keep", "full"]) == "full"
    assert paired.accuracy_reference(["b", "full~unlimited"]) is None
    # without full communication among the schedules there is no accuracy target
    rounds = [{k.replace("full", "a"): v for k, v in rnd.items()} for rnd in rounds]
    assert "tta" not in paired.compare(rounds, ["a", "b"])["b"]


def test_any_schedule_as_baseline_and_one_table_each():
    def run(step, seed=0):
        return {"epoch_s": step, "epoch_wall_s": 2 * step, "seed": seed}
    rounds = [{"a": run(1.0), "b": run(2.0), "c": run(4.0)},
              {"a": run(1.0, 1), "b": run(2.0, 1), "c": run(2.0, 1)}]
    against_b = paired.compare(rounds, ["a", "b", "c"], "b")
    assert set(against_b) == {"a", "c"}
    assert against_b["a"]["step"]["geomean"] == pytest.approx(0.5)
    assert against_b["c"]["wall"]["geomean"] == pytest.approx(math.sqrt(2.0))
    args = type("Args", (), dict(schedules=["a", "b", "c"], dataset="d", partitioner="random",
                                 ranks=4, rate="1", epochs=10, eval_every=2, seeds_vary=True,
                                 seed=0))
    md = paired.to_markdown(rounds, {"a": paired.compare(rounds, args.schedules), "b": against_b},
                            args)
    assert "Against `a`" in md and "Against `b`" in md
    assert "| c | step | 1.414" in md and "| a | step | 0.500" in md


def test_step_against_max_of_compute_and_wire_per_round():
    # 1 Gbit/s: 12.5 MB an epoch is 0.1 s on the wire; 2.5 MB is 0.02 s
    def run(step, mb, codec=0.0):
        return {"epoch_s": step, "epoch_wall_s": step, "bytes_per_epoch": mb * 1e6,
                "codec_s": codec, "seed": 0}
    got = {"floor": run(0.05, 12.5), "floor@s1": run(0.08, 12.5),
           "full@s1": run(0.12, 12.5), "quant4-all": run(0.06, 2.5, codec=0.005)}
    got["full@s1~unlimited"] = run(0.09, 12.5)        # the same bytes, no rate: compute + sockets
    paired.add_vs_max(got, "1")
    assert "wire_s" not in got["floor"] and "vs_max" not in got["floor@s1"]   # floors send nothing
    assert "wire_s" not in got["full@s1~unlimited"]                           # nor is it rated
    assert got["full@s1"]["vs_max_tcp"] == pytest.approx(0.12 / 0.1)
    got["full@s1~unlimited"]["epoch_s"] = 0.11                                # compute-bound
    paired.add_vs_max(got, "1")
    assert got["full@s1"]["vs_max_tcp"] == pytest.approx(0.12 / 0.11)
    assert "vs_max_tcp" not in got["quant4-all"]                              # none ran for it
    assert got["full@s1"]["wire_s"] == pytest.approx(0.1)
    assert got["full@s1"]["vs_max"] == pytest.approx(0.12 / 0.1)               # wire-bound
    assert got["full@s1"]["vs_max_stale"] == pytest.approx(0.12 / 0.1)
    assert got["quant4-all"]["vs_max"] == pytest.approx(0.06 / 0.055)          # compute-bound
    assert "vs_max_stale" not in got["quant4-all"]                             # not stale
    got = {"full": run(0.2, 12.5)}
    paired.add_vs_max(got, "shm")                                               # no rate: no wire
    assert "wire_s" not in got["full"]
    args = type("Args", (), dict(schedules=["floor", "floor@s1", "full@s1"], dataset="d",
                                 partitioner="random", ranks=2, rate="1", epochs=10, eval_every=2,
                                 seeds_vary=False, seed=0))
    rounds = []
    for stale_step in (0.11, 0.13):
        rnd = {"floor": run(0.05, 12.5), "floor@s1": run(0.08, 12.5), "full@s1": run(stale_step, 12.5)}
        paired.add_vs_max(rnd, "1")
        rounds.append(rnd)
    md = paired.to_markdown(rounds, {}, args)
    assert "the stale floor" in md
    assert f"| full@s1 | 100.0 | {math.sqrt(1.1 * 1.3):.3f}" in md
