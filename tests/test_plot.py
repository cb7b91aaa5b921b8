"""``hpcgnn plot``: a real PNG of two real runs (one under a VARCO schedule on 2 ranks), and a
clear error for a missing run directory or a missing matplotlib."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import check_ok, run_together, train_here

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _plot(*args):
    return subprocess.run([sys.executable, "-m", "hpcgnn", "plot", *map(str, args)],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def runs_on_2(shards, tmp_path_factory):
    """Two 12-epoch Cora runs on 2 ranks, in one job: ``varco`` (the shipped VARCO schedule)
    and ``auto`` (``kind = "auto"``)."""
    root = tmp_path_factory.mktemp("plot-runs")
    (root / "auto.toml").write_text('kind = "auto"\nobjective = "bytes"\n')
    for proc in run_together(2, [(["train", "--shards", shards("cora", 2), "--out", root / name,
                                   "--config", "configs/cora.toml", "--set", "train.epochs=12",
                                   "--schedule", schedule], {})
                                 for name, schedule in (("varco", "configs/schedules/varco.toml"),
                                                        ("auto", root / "auto.toml"))], root):
        check_ok(proc)
    return root


@pytest.mark.mpi
def test_plot_writes_a_png_of_overlaid_runs(shards, runs_on_2, tmp_path):
    mpl_image = pytest.importorskip("matplotlib.image")
    train_here(shards("cora", 1), tmp_path / "full", "train.epochs=12", "train.eval_every=3")
    out = tmp_path / "runs.png"
    proc = _plot(runs_on_2 / "varco", tmp_path / "full", "--out", out)
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 30_000
    img = mpl_image.imread(out)
    assert img.shape[:2] == (900, 1600) and img[..., :3].std() > 0.05    # drawn, not blank
    assert not list(tmp_path.glob(".runs.png.tmp-*"))
    from hpcgnn.plot import _series, read_metrics
    series = _series(read_metrics(tmp_path / "full"))               # the validation loss drawn
    assert list(series["eval_epoch"]) == [2, 5, 8, 11]
    assert np.isfinite(series["val_loss"]).all() and series["val_loss"][-1] < series["val_loss"][0]


def test_plot_errors(tmp_path, monkeypatch):
    proc = _plot(tmp_path / "nowhere", "--out", tmp_path / "x.png")
    assert proc.returncode == 2 and "nowhere/metrics.jsonl: not found" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x.png").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"epoch": 0, "loss": 1.0, "ratio": [1.0], "bytes_sent": 0}\n')
    from hpcgnn.plot import PlotError, plot_runs
    monkeypatch.setitem(sys.modules, "matplotlib", None)                # as if not installed
    with pytest.raises(PlotError, match=r"pip install 'hpcgnn\[plot\]'"):
        plot_runs([tmp_path / "run"], tmp_path / "x.png")


def test_series_of_a_run_without_val_loss():
    """Runs written before ``val_loss`` existed: NaN, which the loss panel leaves out."""
    from hpcgnn.plot import _series
    recs = [{"epoch": e, "loss": 1.0 - 0.1 * e, "ratio": [1.0], "bytes_sent": 10,
             "train_acc": 0.5, "val_acc": 0.4, "test_acc": 0.3} for e in range(3)]
    s = _series(recs)
    assert s["val_loss"].shape == (3,) and np.isnan(s["val_loss"]).all()
    recs[1]["val_loss"] = 0.7
    assert np.isfinite(_series(recs)["val_loss"]).tolist() == [False, True, False]
    recs[2]["loss"] = recs[2]["val_loss"] = None        # a diverged epoch: null in metrics.jsonl
    s = _series(recs)
    assert s["loss"].dtype == float and np.isnan(s["loss"]).tolist() == [False, False, True]
    assert np.isfinite(s["val_loss"]).tolist() == [False, True, False]


@pytest.mark.mpi
def test_plot_draws_auto_decisions(shards, runs_on_2, tmp_path):
    """A ``kind = "auto"`` run fills the bottom-right panel (bits and budget); a run without
    it leaves that panel blank."""
    mpl_image = pytest.importorskip("matplotlib.image")
    from hpcgnn.plot import _auto_series, read_metrics
    train_here(shards("cora", 1), tmp_path / "full", "train.epochs=12")
    dirs = {"auto": runs_on_2 / "auto", "full": tmp_path / "full"}
    records = read_metrics(dirs["auto"])
    series = _auto_series(records)
    # a check after epoch e decides for e + 1 on; epoch 0 runs with the start's bits
    assert list(series["epoch"]) == [1, 6, 11] and set(series["bits"]) == {
        (0, "forward"), (0, "backward"), (1, "forward"), (1, "backward")}
    start = records[0]["auto"]["start"]["bits"]
    checks = [r for r in records if "auto" in r]
    for (layer, direction), pts in series["bits"].items():
        assert pts[0] == (0, start[f"{layer}/{direction}"])
        assert [p[0] for p in pts[1:]] == [1, 6, 11]
        assert [p[1] for p in pts[1:]] == [next(e["bits"] for e in r["auto"]["exchanges"]
                                                if (e["layer"], e["direction"]) == (layer, direction))
                                           for r in checks]
    corner = {}
    for name, runs in (("auto", ["full", "auto"]), ("plain", ["full"])):
        proc = _plot(*(dirs[r] for r in runs), "--out", tmp_path / f"{name}.png")
        assert proc.returncode == 0, proc.stderr
        corner[name] = mpl_image.imread(tmp_path / f"{name}.png")[500:850, 1150:1550, :3].std()
    assert corner["auto"] > 0.05 and corner["plain"] < 0.01


@pytest.mark.mpi
def test_plot_leaves_out_a_record_torn_by_a_kill(runs_on_2, tmp_path):
    """A job killed while writing an epoch record (and not resumed yet) leaves a partial last
    line; the plot draws the whole records and says so. A bad line elsewhere is still refused."""
    import shutil
    pytest.importorskip("matplotlib")
    run = tmp_path / "killed"
    shutil.copytree(runs_on_2 / "varco", run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 12, "loss": 1.2')
    proc = _plot(run, "--out", tmp_path / "k.png")
    assert proc.returncode == 0, proc.stderr
    assert "the last line is not a whole record (torn by a kill?)" in proc.stderr
    from hpcgnn.plot import PlotError, read_metrics
    assert [r["epoch"] for r in read_metrics(run)] == list(range(12))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", *lines[1:12]]) + "\n")
    with pytest.raises(PlotError, match="not JSON lines"):
        read_metrics(run)
