"""``hpcgnn plot RUN_DIR [RUN_DIR ...] --out FILE.png``: one figure of one or more runs, overlaid.

Panels (one colour per run, legend = run directory): loss (training solid, validation dashed
where ``metrics.jsonl`` has ``val_loss``), and accuracy (test solid, validation dashed), against
the epoch and against the cumulative bytes the training exchanged (halo rows, or a CAGNET run's
blocks; all ranks, forward + backward, from ``metrics.jsonl``'s ``bytes_sent``); the compression ratio of
every layer against the epoch (one line style per layer); and, for runs with
``kind = "auto"``, the bits in force per layer and direction from epoch 0 on (line style per
layer, circles forward, crosses backward; 32 = fp32) with its budget (dotted, right axis, log),
each drawn from the epoch a check's decision applies to (the one after the check).
Headless (matplotlib's Agg backend); matplotlib is the optional extra
``pip install 'hpcgnn[plot]'``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from hpcgnn.log import get_logger

LAYER_STYLES = ("-", "--", ":", "-.")


class PlotError(ValueError):
    """A run directory or an environment the plot cannot use; names the file and the fix."""


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's epoch records; a last line torn by a kill during its write (a job killed at
    its time limit, not yet resumed) is left out with a warning."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path}: not found; pass run directories written by `hpcgnn train`")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if lines and not _is_json(lines[-1]):
        get_logger().warning("%s: the last line is not a whole record (torn by a kill?); "
                             "left out", path)
        lines.pop()
    try:
        return [json.loads(line) for line in lines]
    except ValueError as exc:
        raise PlotError(f"{path}: not JSON lines ({exc}); was it written by `hpcgnn train`?") from exc


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotError("hpcgnn plot needs matplotlib, which is not installed; install it with "
                        "`pip install 'hpcgnn[plot]'` (or `pip install matplotlib`)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _labels(run_dirs: list[Path]) -> list[str]:
    """The directory names, or parent/name where names repeat."""
    names = [p.name for p in run_dirs]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in run_dirs]


def _series(records: list[dict]) -> dict[str, np.ndarray]:
    """Arrays per key: epoch, loss, cumulative MB; eval epochs, their accuracies and validation
    losses (NaN where a record has none: runs written before ``val_loss`` existed)."""
    evals = [r for r in records if "test_acc" in r]
    mb = np.cumsum([r["bytes_sent"] for r in records]) / 1e6
    at = {r["epoch"]: i for i, r in enumerate(records)}
    return {"epoch": np.array([r["epoch"] for r in records]), "loss": np.array([r["loss"] for r in records], dtype=float),
            "mb": mb, "ratio": np.array([r["ratio"] for r in records], dtype=float),
            "eval_epoch": np.array([r["epoch"] for r in evals]),
            "eval_mb": np.array([mb[at[r["epoch"]]] for r in evals]),
            "test": np.array([r["test_acc"] for r in evals], dtype=float),     # null: NaN, a gap
            "val": np.array([r["val_acc"] for r in evals], dtype=float),
            "val_loss": np.array([r.get("val_loss", np.nan) for r in evals], dtype=float)}


def _auto_series(records: list[dict]) -> dict | None:
    """``kind = "auto"``'s bits in force per (layer, direction) and its budget, against the
    epoch they apply from: a check after epoch ``e`` decides for epoch ``e + 1`` on, and what
    epoch 0 sent is its record's ``start`` (absent: fp32, as before ``start`` existed). Points
    past the run's last epoch are left out."""
    checks = [r for r in records if "auto" in r]
    if not checks:
        return None
    last = records[-1]["epoch"]
    bits: dict[tuple[int, str], list[tuple[int, int]]] = {}
    epochs, budget = [], []
    for r in checks:
        start = r["auto"].get("start")
        if start:
            for key, b in start["bits"].items():
                layer, direction = key.split("/")
                bits.setdefault((int(layer), direction), []).append((r["epoch"], b))
        if r["epoch"] + 1 > last:
            continue
        epochs.append(r["epoch"] + 1)
        budget.append(r["auto"]["budget"])
        for e in r["auto"]["exchanges"]:
            bits.setdefault((e["layer"], e["direction"]), []).append((r["epoch"] + 1, e["bits"]))
    return {"epoch": np.array(epochs),
            "budget": np.array([b if np.isfinite(b) else np.nan for b in budget], dtype=float),
            "bits": bits}


def _draw_auto(ax, budget_ax, auto: dict, label: str, color) -> None:
    for (layer, direction), pts in sorted(auto["bits"].items()):
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color=color,
                linestyle=LAYER_STYLES[layer % len(LAYER_STYLES)],
                marker="o" if direction == "forward" else "x", markersize=3,
                label=f"{label} layer {layer} {direction}")
    budget_ax.plot(auto["epoch"], auto["budget"], color=color, linestyle=":", alpha=0.7)


def _draw(axes, s: dict, label: str, color) -> None:
    (loss_e, acc_e, ratio_e), (loss_b, acc_b, _) = axes
    for ax, x, ex in ((loss_e, s["epoch"], s["eval_epoch"]), (loss_b, s["mb"], s["eval_mb"])):
        ax.plot(x, s["loss"], color=color, label=label)
        if np.isfinite(s["val_loss"]).any():
            ax.plot(ex, s["val_loss"], color=color, linestyle="--", label=f"{label} val")
    for ax, ex in ((acc_e, s["eval_epoch"]), (acc_b, s["eval_mb"])):
        ax.plot(ex, s["test"], color=color, label=f"{label} test")
        ax.plot(ex, s["val"], color=color, linestyle="--", label=f"{label} val")
    for layer in range(s["ratio"].shape[1] if s["ratio"].ndim == 2 else 0):
        ratio_e.plot(s["epoch"], s["ratio"][:, layer], color=color,
                     linestyle=LAYER_STYLES[layer % len(LAYER_STYLES)], label=f"{label} layer {layer}")


def _decorate(axes) -> None:
    titles = (("loss (train solid, val dashed)", "accuracy (test solid, val dashed)",
               "compression ratio per layer"),
              ("loss", "accuracy", ""))
    for row, xlabel in ((0, "epoch"), (1, "cumulative MB exchanged in training (all ranks)")):
        for col, ax in enumerate(axes[row]):
            if ax.get_visible():
                ax.set_title(titles[row][col], fontsize=10)
                ax.set_xlabel(xlabel)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
    axes[0][2].set_yscale("log", base=2)


def _decorate_auto(ax, budget_ax) -> None:
    ax.set_title('kind = "auto": bits per layer and direction; budget (dotted)', fontsize=10)
    ax.set_xlabel("epoch")
    ax.set_ylabel("bits (32 = fp32)")
    ax.set_yscale("log", base=2)
    ax.set_yticks([1, 2, 4, 8, 32], ["1", "2", "4", "8", "32"])
    budget_ax.set_yscale("log")
    budget_ax.set_ylabel("error budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Draw ``run_dirs`` into the PNG ``out`` (written to a temporary name, then renamed)."""
    run_dirs, out = [Path(p) for p in run_dirs], Path(out)
    records = [read_metrics(p) for p in run_dirs]           # every error before drawing
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    autos = [_auto_series(recs) for recs in records]
    auto_ax = axes[1][2]
    budget_ax = auto_ax.twinx() if any(autos) else None
    auto_ax.set_visible(budget_ax is not None)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (recs, label) in enumerate(zip(records, _labels(run_dirs))):
        if recs:
            _draw(axes, _series(recs), label, colors[i % len(colors)])
        if autos[i]:
            _draw_auto(auto_ax, budget_ax, autos[i], label, colors[i % len(colors)])
    _decorate(axes)
    if budget_ax is not None:
        _decorate_auto(auto_ax, budget_ax)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
    return out
