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
