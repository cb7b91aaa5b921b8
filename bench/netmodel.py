"""The network model: what a training epoch costs on a link, calibrated on the CPU
cluster-network runs (bench/network.py) and projected to GPU clusters.

One formula for every case:

    epoch = K + max(C, W) + eps * min(C, W) + alpha * m        W = B / (eta * rate)

``C`` compute (everything but the codec and the link), ``K`` codec time, ``B`` the bytes that
cross the link, ``m`` messages (peers x exchanges), ``rate`` the link's nominal bit rate.
Constants: ``eta`` the share of the nominal rate the bytes get, ``alpha`` seconds per message,
``eps`` the part of the shorter of compute and wire that is *not* hidden behind the longer.

- The emulated link of bench/network.py is ONE token bucket on the loopback that all ranks
  share: ``B`` is the bytes of all ranks, and ranks that compute while others send hide part
  of each other's time (``eps`` < 1 even for synchronous exchanges). Calibrated here. The
  bucket (``tbf ... burst 1mb``) lets up to 1 MiB pass at once and refills at the rate while
  the ranks compute, so ``W`` there is that of a token bucket fed the epoch's exchanges in
  order (``bucket_wire_time``): an exchange under the tokens it finds costs no wire time, which
  is most of a 2-bit exchange at 1 Gbit/s. A cluster's link has no such allowance.
- A cluster gives each GPU its own link (full duplex): ``B`` is the bytes of the busiest rank
  (the larger of sent and received), and a synchronous exchange hides nothing: ``eps = 1``,
  i.e. ``epoch = C + K + W + alpha m``. With staleness the exchange of epoch t overlaps its
  compute: ``eps`` = the stale path's leak (0 = perfect overlap).

Subcommands:

    python bench/netmodel.py calibrate [--runs FILE ...] [--combine median]  # fit; table of errors
    python bench/netmodel.py halos [--dataset SPEC] [--parts 256] [--ranks 8 16 ... 256]
    python bench/netmodel.py project [--rates 25 50 100 200] [--gpu-log FILE] [--plot PNG]
    python bench/netmodel.py remeasure [--rounds 3]           # root, idle machine: new CPU runs
    python bench/netmodel.py validate --constants FIT.json --runs NEW.json ...   # held-out check

``calibrate`` reads runs of bench/network.py (OUT.json). Inputs per run, all measured apart from
the link: ``C`` = the same schedule's epoch over shared memory (``shm``, same sweep) less its
codec time (``--compute tcp``: its epoch over the TCP loopback without a rate limit instead);
``K`` = the run's own codec time; ``B`` = its bytes per epoch; ``m`` = exchanges per epoch x
(R - 1) (random parts: every pair of ranks exchanges). ``--combine median`` takes files
that are rounds of one grid (``remeasure`` writes them) and uses each cell's medians. VARCO schedules are left out
(their bytes change during the run while the table reports one median epoch).
``validate`` predicts runs the constants were not fitted on (new rounds of the grid, measured
after the fit) with those constants unchanged: the 15 % check as a prediction, not a fit.
``halos`` partitions a graph ONCE into ``--parts`` METIS parts and derives R ranks by merging
consecutive parts (as ``hpcgnn/data/merge.py`` runs R ranks on a K-part set): the halo rows,
send rows and peers of every rank. ``project`` turns them into bytes with the codecs' own byte
counts and the model's layer widths, and into wire time with the calibrated constants. GPU
compute and codec times come from ``--gpu-log`` (JSON: ``{"compute_s": {"R": s},
"codec_s": {"schedule": {"R": s}}}``, measured on the GPUs of the projection); absent ones print
"open". It never estimates them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))       # the repository's packages before bench/'s (bench/preprocess.py)
RESULTS = REPO / "bench" / "results"
RUNS = [RESULTS / "network.json", RESULTS / "network-stale-2core.json"]
GBIT = 1e9 / 8                       # bytes per second in one Gbit/s
# bench/network.py's GCN 128 -> 64 -> 8 (cSBM 20k, 8 classes): both layers transform first, so
# an epoch's exchanges carry rows of these widths, in step order (layer 0 forward, layer 1
# forward, layer 1 backward, layer 0 backward); a stale step exchanges layer 1's 64-wide input,
# forward and backward (layer 0's input crosses once, at epoch 0).
CALIB_WIDTHS = (64, 8, 8, 64)
CALIB_STALE_WIDTHS = (64, 64)
BUCKET_BYTES = 1 << 20               # bench/network.py's tbf "burst 1mb" (tc: 1024^2 bytes)
TC_UNITS = {"kb": 1 << 10, "k": 1 << 10, "mb": 1 << 20, "m": 1 << 20, "gb": 1 << 30, "g": 1 << 30,
            "b": 1}


def tc_bytes(size: str) -> int:
    """``tc``'s size (``1mb``, ``128kb``, ``4096``) in bytes (its units are powers of 1024)."""
    text = str(size).strip().lower()
    digits = text.rstrip("kmgb")
    unit = text[len(digits):] or "b"
    if not digits.replace(".", "", 1).isdigit() or unit not in TC_UNITS:
        raise ValueError(f"not a tc size: {size!r} (e.g. 1mb, 128kb, 4096)")
    return int(float(digits) * TC_UNITS[unit])


def calib_widths(stale: bool) -> tuple:
    """Row widths of a calibration run's exchanges in an epoch, in step order."""
    return CALIB_STALE_WIDTHS if stale else CALIB_WIDTHS
# ogbn-products' size (2,449,029 nodes, 61.86M undirected edges; 47 classes, edge homophily 0.81).
# METIS (pymetis's 64-bit build, two balance constraints) needs ~11 GB at this size; HALF, the
# same degree on half the nodes, is the largest tried that stays under 10 GiB (the default).
PRODUCTS = "csbm:nodes=2449029,classes=47,degree=50.52,homophily=0.81,features=8,signal=1.0,seed=0"
HALF = "csbm:nodes=1224515,classes=47,degree=50.52,homophily=0.81,features=8,signal=1.0,seed=0"


@dataclass(frozen=True)
class Constants:
    """The model's constants (see the module docstring)."""

    eta: float          # share of the nominal rate the bytes get
    eps: float          # non-hidden share of min(compute, wire) on the emulated shared link
    alpha: float        # seconds per message
    eps_stale: float    # the same for the stale (pipelined) path
    overlap: str = "shared"   # shared: one eps for every rank count; per-rank: eps x 4 / R
    rate_bound: bool = False  # an epoch takes at least its bytes' time at eta x rate (RATE_BOUND)
    compute: str = "shm"      # the run that gives C: COMPUTES


RATE_BOUND = """With ``rate_bound``, no epoch is predicted shorter than its bytes take at ``eta`` x the
rate (plus the messages' latency): the bucket lends tokens that refill at the rate, so over
an epoch the link moves at most ``rate x epoch`` bytes. Without it, the overlap ``eps`` and the
bucket's allowance can together predict an epoch under that, as they did for the 8-rank 1- and
2-bit runs at 0.5 Gbit/s (2026-11-28)."""

COMPUTES = {"shm": "shm", "tcp": "none"}
"""Which run of the same schedule, ranks and sweep gives a link run's compute ``C`` (its epoch
less its codec time), by the rate it ran at. ``shm``: over shared memory (the model until
2026-11-28). ``tcp``: over the same TCP loopback with no rate limit (``--rates none``), which
pays the sockets' CPU that every link run pays and shared memory does not: on 2 cores that CPU
is taken from the ranks' compute. (On 2026-11-28 the 4-rank Sylvie runs over shared memory took
longer than the same schedule behind every rated link.)"""

OVERLAPS = ("shared", "per-rank")
"""How ``eps`` depends on the rank count on the emulated link. ``per-rank``: ``eps`` is its value
at 4 ranks and falls as ``4 / R``: the ranks share 2 cores, a rank waiting on the link yields its
core (Open MPI yields when oversubscribed), and at 8 ranks twice as many others can use it."""


def epoch_time(C: float, K: float, W: float, m: float, alpha: float, eps: float) -> float:
    """``K + max(C, W) + eps * min(C, W) + alpha * m`` seconds."""
    return K + max(C, W) + eps * min(C, W) + alpha * m


def wire_time(nbytes: float, rate_gbit: float, eta: float) -> float:
    """Seconds for ``nbytes`` at ``eta`` x the nominal ``rate_gbit``."""
    return nbytes / (eta * rate_gbit * GBIT)


def bucket_wire_time(nbytes: float, widths: tuple, gap: float, rate_gbit: float, eta: float,
                     burst: float = BUCKET_BYTES) -> float:
    """Wire seconds of one epoch through a token bucket of ``burst`` bytes (the emulated link:
    Linux ``tbf``): the epoch's ``nbytes`` split over its exchanges in proportion to their row
    widths, ``gap`` seconds of work between consecutive exchanges. An exchange's first bytes go
    out at once while the bucket holds tokens, the rest at the rate; the bucket refills at the
    rate between exchanges, up to ``burst``. Steady state (a few epochs simulated)."""
    rate = eta * rate_gbit * GBIT
    total_w = float(sum(widths))
    tokens, wire = burst, 0.0
    for _ in range(4):
        wire = 0.0
        for w in widths:
            b = nbytes * w / total_w
            wire += max(0.0, b - tokens) / rate
            tokens = min(burst, max(0.0, tokens - b) + rate * gap)
    return wire


# -- calibration on the CPU runs -----------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """One measured run and the model's inputs for it."""

    source: str
    ranks: int
    rate: float
    schedule: str
    measured: float     # median epoch, s
    compute: float      # C: the schedule's shm (or unlimited TCP: COMPUTES) epoch less its codec time
    codec: float        # K: the run's codec time per epoch
    nbytes: float       # B: bytes per epoch, all ranks
    messages: int       # m
    burst: float = BUCKET_BYTES   # the emulated link's token bucket, bytes (0: not modelled)

    @property
    def widths(self) -> tuple:
        return calib_widths(self.stale)

    @property
    def stale(self) -> bool:
        return "@s" in self.schedule


def codec_seconds(r: dict) -> float:
    """Median codec seconds per epoch of a bench/network.py result (older files: share x epoch)."""
    return r["codec_s"] if "codec_s" in r else r["codec_share"] * r["epoch_s"]


def load_runs(paths: list[Path], combine: str = "last", burst: float | None = None,
              stale_bytes: str = "step", compute: str = "shm") -> list[Run]:
    """The runs of bench/network.py files the model can take. ``combine``: ``last`` (a later
    file's run of a cell wins: newer sweeps replace older ones) or ``median`` (the files are
    repeated rounds of one grid: each input and the measured epoch are the median over the
    rounds that have the cell, each round's compute taken from its own shared-memory run).
    ``burst``: the link's token bucket in bytes for every file (0: the model without it);
    ``None``: each file's own (``bench/network.py --burst``, recorded since 2026-11-27; 1 MiB,
    the only size before). ``stale_bytes``: ``STALE_BYTES``; ``compute``: ``COMPUTES``."""
    if stale_bytes not in STALE_BYTES:
        raise ValueError(f"stale_bytes must be one of {STALE_BYTES}, got {stale_bytes!r}")
    if compute not in COMPUTES:
        raise ValueError(f"compute must be one of {tuple(COMPUTES)}, got {compute!r}")
    cells: dict[tuple, list[Run]] = {}
    for path in paths:
        sweep = json.loads(Path(path).read_text())
        results = sweep["results"]
        bucket = tc_bytes(sweep.get("burst", "1mb")) if burst is None else burst
        for key, r in results.items():
            run = _run(path, key, r, results, stale_bytes, compute)
            if run is not None:
                run = replace(run, burst=bucket)
                cells.setdefault((run.ranks, run.rate, run.schedule), []).append(run)
    if combine == "last":
        runs = [rounds[-1] for rounds in cells.values()]
    elif combine == "median":
        runs = [_median_run(rounds) for rounds in cells.values()]
    else:
        raise ValueError(f"combine must be 'last' or 'median', got {combine!r}")
    return sorted(runs, key=lambda r: (r.stale, r.ranks, r.rate, r.schedule))


def _median_run(rounds: list[Run]) -> Run:
    """One cell's rounds as one run: the median of every measured input."""
    first = rounds[0]
    med = lambda f: statistics.median(getattr(r, f) for r in rounds)  # noqa: E731
    source = first.source if len(rounds) == 1 else f"median of {len(rounds)}"
    return Run(source, first.ranks, first.rate, first.schedule, med("measured"), med("compute"),
               med("codec"), med("nbytes"), first.messages, first.burst)


def _run(path: Path, key: str, r: dict, results: dict, stale_bytes: str = "step",
         compute: str = "shm") -> Run | None:
    ranks, rate, schedule = key.split("|")
    ref = results.get(f"{ranks}|{COMPUTES[compute]}|{schedule}")    # gives C
    usable = rate not in ("shm", "none") and schedule.partition("@")[0] != "floor" and ref is not None
    if not usable or schedule.startswith("varco") or not _current(path, schedule):
        return None
    nbytes = step_bytes(key, r, results) if stale_bytes == "step" else r["bytes_per_epoch"]
    if nbytes is None:
        return None
    return Run(Path(path).stem, int(ranks), float(rate), schedule, r["epoch_s"],
               ref["epoch_s"] - codec_seconds(ref), codec_seconds(r), nbytes,
               len(calib_widths("@s" in schedule)) * (int(ranks) - 1))


STALE_BYTES = ("step", "mean")
"""Which bytes of a run the model takes. ``step``: a step's, as the median step (``epoch_s``,
epochs 1 on) sent them (``step_bytes``). ``mean``: ``bytes_per_epoch`` as recorded, the mean
over every epoch: the model until 2026-11-28, which for a stale run counted the first layer's
input rows that cross once, in epoch 0, into every epoch (47 % more than a Sylvie step's bytes
in the 40-epoch rounds)."""


def step_bytes(key: str, r: dict, results: dict) -> float | None:
    """The bytes one training step sends (all ranks), as the median step sent them:
    ``bytes_per_step`` where the sweep recorded it (``bench/network.py`` since 2026-11-28).
    Before, a sweep recorded the mean over every epoch alone, the same for a synchronous run of
    constant bytes; a stale run's epoch 0 also sends the first layer's input rows, once, so its
    step's bytes are those of the synchronous run of the same schedule in the same sweep (the
    same halo rows) times the ratio of the two steps' row bytes, from the schedule's own codecs
    (``CALIB_STALE_WIDTHS`` on layer 1 against ``CALIB_WIDTHS``); None without that run."""
    if "bytes_per_step" in r:
        return r["bytes_per_step"]
    ranks, rate, schedule = key.split("|")
    base, _, method = schedule.partition("@")
    if not method.startswith("s"):
        return r["bytes_per_epoch"]
    sync = results.get(f"{ranks}|{rate}|{base}")
    if sync is None:
        return None
    return sync["bytes_per_epoch"] * _row_bytes(base, stale=True) / _row_bytes(base, stale=False)


def _row_bytes(schedule: str, stale: bool) -> int:
    """Bytes one halo row costs a step of the calibration GCN (128 -> 64 -> 8) under
    ``schedule`` (a constant one), summed over the step's exchanges: layer 0 forward and
    backward at 64 channels and layer 1's at 8 (synchronous), or layer 1's input, 64 channels,
    both ways (stale)."""
    from hpcgnn.codecs.base import backward_codec
    from hpcgnn.schedule import load_schedule
    policy = load_schedule(REPO / "configs" / "schedules" / f"{schedule}.toml").bind(100, 2)
    rows, total = 1 << 20, 0
    exchanges = ((1, CALIB_STALE_WIDTHS[0]),) if stale else ((0, CALIB_WIDTHS[0]), (1, CALIB_WIDTHS[1]))
    for layer, w in exchanges:
        fwd = policy.forward_codec(1, layer, 2, w)
        bwd = backward_codec(fwd, policy.backward_codec(1, layer, 2, w))
        total += _bytes(fwd, rows, w) + _bytes(bwd, rows, w)
    return total


def _current(path: Path, schedule: str) -> bool:
    """Stale runs measured before the stale path's dropout fix (11cfc35: network.json, debdecd)
    are not what the code runs now."""
    return not ("@s" in schedule and Path(path).name == "network.json")


def predict(run: Run, c: Constants) -> float:
    eps = c.eps_stale if run.stale else c.eps
    if c.overlap == "per-rank":
        eps *= 4 / run.ranks
    if run.burst:
        gap = (run.compute + run.codec) / len(run.widths)
        wire = bucket_wire_time(run.nbytes, run.widths, gap, run.rate, c.eta, run.burst)
    else:
        wire = wire_time(run.nbytes, run.rate, c.eta)
    t = epoch_time(run.compute, run.codec, wire, run.messages, c.alpha, eps)
    if c.rate_bound:
        t = max(t, wire_time(run.nbytes, run.rate, c.eta) + c.alpha * run.messages)
    return t


def fit(runs: list[Run], overlap: str = "shared", rate_bound: bool = False,
        compute: str = "shm") -> Constants:
    """Least squares on log(predicted / measured): eta, eps, alpha on the synchronous runs,
    then eps_stale alone on the stale runs (eta and alpha kept); ``overlap``: ``OVERLAPS``;
    ``rate_bound``: ``RATE_BOUND``; ``compute``: which runs gave the runs' ``C`` (``COMPUTES``),
    recorded with the constants so that ``validate`` takes new runs' ``C`` the same way."""
    from scipy.optimize import least_squares
    sync = [r for r in runs if not r.stale]

    def residual(p, rs, stale=None):
        c = (Constants(p[0], p[1], p[2], p[1], overlap, rate_bound) if stale is None
             else Constants(*stale, p[0], overlap, rate_bound))
        return [math.log(predict(r, c) / r.measured) for r in rs]

    p = least_squares(residual, [1.0, 0.5, 1e-4], args=(sync,),
                      bounds=([0.1, 0.0, 0.0], [10.0, 1.0, 0.05])).x
    stale = [r for r in runs if r.stale]
    e = 1.0
    if stale:
        e = least_squares(residual, [0.5], args=(stale, tuple(p)), bounds=([0.0], [1.0])).x[0]
    return Constants(float(p[0]), float(p[1]), float(p[2]), float(e), overlap, rate_bound, compute)


def errors(runs: list[Run], c: Constants) -> list[float]:
    return [predict(r, c) / r.measured - 1 for r in runs]


def calibrate(args) -> None:
    compute = getattr(args, "compute", "shm")
    runs = load_runs([Path(p) for p in args.runs], args.combine, args.burst,
                     getattr(args, "stale_bytes", "step"), compute)
    if not runs:
        sys.exit(f"netmodel: no usable runs in {args.runs} (a link run needs a run of the same "
                 f"schedule in the same file at rate {COMPUTES[compute]!r}, which gives its compute)")
    bound = getattr(args, "rate_bound", False)
    c = fit(runs, args.overlap, bound, compute)
    held_out = _held_out(runs, args.overlap, bound, compute)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(
        {"constants": asdict(c), "runs": [asdict(r) | {"predicted": predict(r, c)} for r in runs],
         "held_out": held_out, "sources": [str(p) for p in args.runs],
         "stale_bytes": getattr(args, "stale_bytes", "step")}, indent=1))
    table = calibration_markdown(runs, c, held_out)
    out.with_suffix(".md").write_text(table)
    print(table)
    if args.plot:
        plot_calibration(runs, c, Path(args.plot))


def plot_calibration(runs: list[Run], c: Constants, out: Path) -> None:
    """Predicted against measured epoch, one point per run, the 15 % band shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for i, rate in enumerate(sorted({r.rate for r in runs})):
        for stale, mark in ((False, "o"), (True, "^")):
            pts = [(1e3 * r.measured, 1e3 * predict(r, c)) for r in runs
                   if r.rate == rate and r.stale == stale]
            if pts:
                ax.scatter(*zip(*pts), color=f"C{i}", marker=mark, s=22,
                           label=f"{rate:g} Gbit/s{', stale' if stale else ''}")
    lo, hi = 40, 700
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs, color="grey", lw=0.8)
    ax.fill_between(xs, 0.85 * xs, 1.15 * xs, color="grey", alpha=0.15, label="within 15 %")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured epoch (ms)",
           ylabel="predicted epoch (ms)", title="network model on the CPU cluster-network runs")
    ticks = [50, 100, 200, 500]
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
        axis.set_major_formatter(matplotlib.ticker.FixedFormatter([str(t) for t in ticks]))
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _held_out(runs: list[Run], overlap: str = "shared", rate_bound: bool = False,
              compute: str = "shm") -> dict | None:
    """Fit without the 8-rank runs, predict them: the model's reach beyond its fitting set."""
    four, eight = [r for r in runs if r.ranks != 8], [r for r in runs if r.ranks == 8 and not r.stale]
    if not eight or not any(not r.stale for r in four):
        return None
    c = fit(four, overlap, rate_bound, compute)
    errs = errors(eight, c)
    return {"constants": asdict(c), "worst": max(map(abs, errs)),
            "runs": [f"{r.ranks}|{r.rate:g}|{r.schedule}" for r in eight], "errors": errs}


def calibration_markdown(runs: list[Run], c: Constants, held_out: dict | None) -> str:
    errs = errors(runs, c)
    worst = max(range(len(runs)), key=lambda i: abs(errs[i]))
    lines = [f"Constants: eta = {c.eta:.3f} (share of the nominal rate), eps = {c.eps:.3f} "
             f"(synchronous, shared link), alpha = {1e3 * c.alpha:.3f} ms per message, "
             f"eps_stale = {c.eps_stale:.3f}"
             f"{'; eps at 4 ranks, x 4 / R' if c.overlap == 'per-rank' else ''}"
             f"{'; never under the bytes at eta x rate' if c.rate_bound else ''}; token bucket "
             f"{', '.join(f'{b / 2**20:g} MiB' for b in sorted({r.burst for r in runs}) if b) or 'not modelled'}.", "",
             f"Worst relative error {100 * abs(errs[worst]):.1f} % ({_name(runs[worst])}); "
             f"{sum(abs(e) <= 0.15 for e in errs)} of {len(runs)} runs within 15 %; mean "
             f"|error| {100 * statistics.mean(map(abs, errs)):.1f} %.", ""]
    if held_out:
        lines += [f"Fitted without the 8-rank runs, the model predicts them with a worst error of "
                  f"{100 * held_out['worst']:.1f} %.", ""]
    lines += ["| source | ranks | link (Gbit/s) | schedule | C (ms) | K (ms) | MB / epoch | "
              "measured (ms) | predicted (ms) | error |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r, e in zip(runs, errs):
        lines.append(f"| {r.source} | {r.ranks} | {r.rate:g} | {r.schedule} | {1e3 * r.compute:.1f} | "
                     f"{1e3 * r.codec:.1f} | {r.nbytes / 1e6:.2f} | {1e3 * r.measured:.1f} | "
                     f"{1e3 * predict(r, c):.1f} | {100 * e:+.1f} % |")
    return "\n".join(lines) + "\n"


def validate(args) -> None:
    """Predict ``--runs`` with the constants of an earlier ``calibrate`` (unchanged), and say how
    many are within 15 %; beside it, what a fit on these runs alone would give."""
    fitted = json.loads(Path(args.constants).read_text())
    c = Constants(**fitted["constants"])
    bursts = {r.get("burst") for r in fitted.get("runs", [])}
    burst = bursts.pop() if len(bursts) == 1 else None   # the fit's bucket (0: not modelled)
    # the new runs' bytes as the fit took its runs' (a fit from before the choice: the mean)
    stale_bytes = getattr(args, "stale_bytes", None) or fitted.get("stale_bytes", "mean")
    runs = load_runs([Path(p) for p in args.runs], args.combine, burst, stale_bytes, c.compute)
    if not runs:
        sys.exit(f"netmodel: no usable runs in {args.runs} (a link run needs a run of the same "
                 f"schedule at rate {COMPUTES[c.compute]!r}, which gave the fit's compute)")
    used = set(map(str, fitted.get("sources", [])))
    reused = [p for p in args.runs if str(p) in used]
    if reused:
        sys.exit(f"netmodel: {', '.join(reused)} fitted the constants of {args.constants}; "
                 f"validate takes runs measured apart from the fit")
    errs = errors(runs, c)
    refit = fit(runs, c.overlap, c.rate_bound, c.compute)
    refit_errs = errors(runs, refit)
    head = [f"Constants of `{args.constants}` (fitted on {', '.join(fitted.get('sources', [])) or '?'}), "
            f"unchanged, predicting {len(runs)} runs of {', '.join(map(str, args.runs))} "
            f"({args.combine} over the files):", "",
            f"**Held out: worst relative error {100 * max(map(abs, errs)):.1f} %; "
            f"{sum(abs(e) <= 0.15 for e in errs)} of {len(runs)} runs within 15 %; mean |error| "
            f"{100 * statistics.mean(map(abs, errs)):.1f} %.**", "",
            f"Refitted on these runs alone (same form): eta {refit.eta:.3f}, eps {refit.eps:.3f}, "
            f"alpha {1e3 * refit.alpha:.3f} ms, eps_stale {refit.eps_stale:.3f}; worst "
            f"{100 * max(map(abs, refit_errs)):.1f} %, {sum(abs(e) <= 0.15 for e in refit_errs)} "
            f"of {len(runs)} within 15 %.", ""]
    table = "\n".join(head) + "\n" + calibration_markdown(runs, c, None)
    out = Path(args.out)
    out.with_suffix(".md").write_text(table)
    out.with_suffix(".json").write_text(json.dumps(
        {"constants": asdict(c), "constants_file": str(args.constants), "sources": list(map(str, args.runs)),
         "runs": [asdict(r) | {"predicted": predict(r, c), "error": e} for r, e in zip(runs, errs)],
         "refit": asdict(refit), "refit_errors": refit_errs}, indent=1))
    print(table)
    if args.plot:
        plot_calibration(runs, c, Path(args.plot))


def _name(r: Run) -> str:
    return f"{r.ranks} ranks, {r.rate:g} Gbit/s, {r.schedule}"


# -- halo sizes on real partitions -----------------------------------------------------------------
def rank_halos(indptr: np.ndarray, indices: np.ndarray, part: np.ndarray, group: int,
               chunk: int = 1 << 22) -> dict:
    """Per rank of ``R = parts / group`` ranks (rank r = parts r*group .. r*group+group-1):
    ``recv`` halo rows (distinct remote in-neighbours of its rows), ``send`` rows it sends
    (summed over peers: a row goes to every rank that needs it), ``peers`` ranks it receives
    from, ``owned`` rows. ``indptr``/``indices``: CSR, row i lists the sources of i's messages.
    Works through ``chunk`` rows at a time (bounded temporaries on a 124M-edge graph)."""
    n = len(part)
    rank = (part // group).astype(np.int32)
    R = int(rank.max()) + 1
    chunks = [_cut_keys(indptr, indices, rank, lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
    keys = np.unique(np.concatenate([k for k, _ in chunks]))             # (receiver, row)
    pair = (keys // n) * R + rank[keys % n]                                # receiver x owner
    del keys
    counts = np.bincount(pair, minlength=R * R).reshape(R, R)            # [receiver, owner]
    return {"recv": counts.sum(1).tolist(), "send": counts.sum(0).tolist(),
            "peers": (counts > 0).sum(1).tolist(), "owned": np.bincount(rank, minlength=R).tolist(),
            "cut_edges": int(sum(c for _, c in chunks))}


def _cut_keys(indptr, indices, rank, lo: int, hi: int) -> tuple[np.ndarray, int]:
    """Distinct ``receiver * n + source`` of the edges into rows lo..hi that cross ranks, and
    how many edges cross."""
    src = indices[indptr[lo]:indptr[hi]]
    dst = np.repeat(rank[lo:hi], np.diff(indptr[lo:hi + 1]).astype(np.int64))
    cut = dst != rank[src]
    return np.unique(dst[cut].astype(np.int64) * len(rank) + src[cut]), int(cut.sum())


def halos(args) -> None:
    from hpcgnn.data.datasets import load_dataset
    from preprocess import partition_graph
    graph = load_dataset(args.dataset)
    print(f"{args.dataset}: {graph.num_nodes:,} nodes, {len(graph.indices):,} directed edges",
          flush=True)
    part = partition_graph(graph, args.parts, "metis", seed=args.seed)
    out = {"dataset": args.dataset, "parts": args.parts, "partitioner": "metis", "seed": args.seed,
           "num_nodes": graph.num_nodes, "num_edges": len(graph.indices), "ranks": {}}
    for R in args.ranks:
        if args.parts % R:
            sys.exit(f"netmodel halos: --ranks {R} does not divide --parts {args.parts}")
        h = rank_halos(graph.indptr, graph.indices, part, args.parts // R)
        out["ranks"][str(R)] = h
        print(f"R = {R}: halo rows per rank max {max(h['recv']):,} mean "
              f"{statistics.mean(h['recv']):,.0f}, peers max {max(h['peers'])}", flush=True)
    Path(args.out).write_text(json.dumps(out))


# -- projection ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    """The projected model: layer dims, as the app picks exchanged widths (``choose_order``)."""

    in_dim: int = 100
    hidden: int = 256
    layers: int = 3
    classes: int = 47

    def dims(self) -> list[int]:
        return [self.in_dim] + [self.hidden] * (self.layers - 1) + [self.classes]

    def exchanges(self) -> list[tuple[int, bool]]:
        """(width, has a backward exchange) per layer: the first layer's input needs no gradient."""
        from hpcgnn.nn.layers import choose_order
        d = self.dims()
        return [(choose_order(a, b, i > 0)[1], i > 0) for i, (a, b) in enumerate(zip(d[:-1], d[1:]))]

    def params(self) -> int:
        d = self.dims()
        return sum(a * b + b for a, b in zip(d[:-1], d[1:]))


def rank_bytes(send_rows: int, recv_rows: int, schedule: Path, model: Model) -> tuple[int, int, int]:
    """(bytes sent, bytes received, exchanges) of one rank in one epoch under ``schedule``
    (constant schedules), from the codecs' own byte counts."""
    from hpcgnn.codecs.base import backward_codec
    from hpcgnn.schedule import load_schedule
    policy = load_schedule(schedule).bind(100, model.layers)
    sent = got = n = 0
    for layer, (w, backward) in enumerate(model.exchanges()):
        fwd = policy.forward_codec(99, layer, model.layers, w)
        sent, got, n = sent + _bytes(fwd, send_rows, w), got + _bytes(fwd, recv_rows, w), n + 1
        if backward:
            bwd = backward_codec(fwd, policy.backward_codec(99, layer, model.layers, w))
            sent, got, n = sent + _bytes(bwd, recv_rows, w), got + _bytes(bwd, send_rows, w), n + 1
    return sent, got, n


def _bytes(codec, rows: int, width: int) -> int:
    """Bytes of ``rows`` rows in one block; refuses codecs whose bytes are not linear in rows
    (the halos file keeps per-rank totals, not per-peer blocks)."""
    one = sum(codec.byte_counts([rows], width))
    if one != sum(codec.byte_counts([rows // 2, rows - rows // 2], width)):
        raise SystemExit(f"netmodel: codec {codec.name} is not linear in rows; project it per "
                         f"peer block")
    return one


def project_rows(halo: dict, rates: list[float], schedules: list[str], model: Model, c: Constants,
                 gpu: dict) -> list[dict]:
    """One row per (ranks, rate, schedule): wire and epoch time (open without GPU inputs)."""
    rows, schedules = [], list(dict.fromkeys(["full", *schedules]))
    for R, h in sorted(halo["ranks"].items(), key=lambda kv: int(kv[0])):
        per_rank = {s: [rank_bytes(sd, rc, REPO / "configs" / "schedules" / f"{s}.toml", model)
                        for sd, rc in zip(h["send"], h["recv"])] for s in schedules}
        codec_in = max((s + g) / 2 for s, g, _ in per_rank["full"])   # fp32 bytes a codec handles
        for rate in rates:
            for s in schedules:
                row = _row(int(R), rate, s, per_rank[s], h["peers"], model, c, gpu)
                rows.append(row | {"codec_in_bytes": codec_in})
    return rows


def _row(R: int, rate: float, schedule: str, per_rank: list, peers: list, model: Model, c: Constants,
         gpu: dict) -> dict:
    ar_bytes = 2 * (R - 1) / R * 4 * model.params()                     # ring allreduce per rank
    wire = max(wire_time(max(s, g), rate, c.eta) + c.alpha * n * p
               for (s, g, n), p in zip(per_rank, peers))
    wire += wire_time(ar_bytes, rate, c.eta) + c.alpha * 2 * (R - 1)
    C = gpu.get("compute_s", {}).get(str(R))
    K = gpu.get("codec_s", {}).get(schedule, {}).get(str(R), 0.0 if schedule == "full" else None)
    known = C is not None and K is not None
    return {"ranks": R, "rate": rate, "schedule": schedule, "wire_s": wire,
            "bytes_max": max(max(s, g) for s, g, _ in per_rank),
            "sync_s": C + K + wire if known else None,
            "stale_s": epoch_time(C, K, wire, 0, 0, c.eps_stale) if known else None}


def projection_markdown(rows: list[dict], halo: dict, model: Model, c: Constants, codec_floor: dict,
                        alpha_from: str) -> str:
    full = {(r["ranks"], r["rate"]): r["wire_s"] for r in rows if r["schedule"] == "full"}
    lines = [f"Graph `{halo['dataset']}` ({halo['num_nodes']:,} nodes, {halo['num_edges']:,} directed "
             f"edges), METIS {halo['parts']} parts merged into R ranks; GCN "
             f"{'-'.join(map(str, model.dims()))} (exchanged widths "
             f"{[w for w, _ in model.exchanges()]}); one link per GPU, full duplex, CUDA-aware "
             f"(no staging copies); eta = {c.eta:.3f} (calibrated on the CPU runs), alpha = "
             f"{1e3 * c.alpha:.3f} ms per message ({alpha_from}). Epoch = C + K + W "
             f"(synchronous), K + max(C, W) + {c.eps_stale:.2f} min(C, W) (stale); C and K are "
             f"the GPU's and 'open' without a GPU log. Codec budget = W(full) - "
             f"W(schedule): compression pays only if the codec costs less per epoch, i.e. encodes "
             f"and decodes the busiest GPU's fp32 halo rows at the 'needed' rate or faster.", "",
             "| GPUs | link (Gbit/s) | schedule | MB / epoch (busiest GPU) | wire W (ms) | "
             "codec budget (ms) | codec GB/s needed | H100 codec, lower bound (ms) | pays? | "
             "epoch sync (ms) | epoch stale (ms) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        budget = full[(r["ranks"], r["rate"])] - r["wire_s"]
        floor = codec_floor.get(r["schedule"])
        pays = "no" if floor is not None and budget < floor else "open"
        need = f"{r['codec_in_bytes'] / budget / 1e9:.1f}" if budget > 0 else "∞"
        if r["schedule"] == "full":
            pays, shown, need = "—", "—", "—"
        else:
            shown = f"{1e3 * budget:.2f}"
        lines.append(f"| {r['ranks']} | {r['rate']:g} | {r['schedule']} | {r['bytes_max'] / 1e6:.1f} | "
                     f"{1e3 * r['wire_s']:.2f} | {shown} | {need} | "
                     f"{'—' if floor is None else f'{1e3 * floor:.1f}'} | {pays} | "
                     f"{_ms(r['sync_s'])} | {_ms(r['stale_s'])} |")
    return "\n".join(lines) + "\n"


def _ms(s: float | None) -> str:
    return "open" if s is None else f"{1e3 * s:.1f}"


def codec_lower_bounds(path: Path, schedules: list[str], model: Model) -> dict:
    """Per schedule, a LOWER bound of its codec seconds per epoch on the GPU of ``path`` (a
    bench/codecs.py result): per exchange, the measured encode + decode of the largest block
    measured (codec time does not fall with more rows), times the epoch's exchanges."""
    if not path.is_file():
        return {}
    res = json.loads(path.read_text())["results"]
    n = sum(1 + b for _, b in model.exchanges())
    bits = {"quant8-all": 8, "quant4-all": 4, "quant2-all": 2, "quant1-all": 1}
    out = {}
    for s in schedules:
        if s in bits:
            rows = [r for r in res if r["codec"] == f"quant({bits[s]})"]
            big = max(rows, key=lambda r: (r["rows"] * r["width"], -r["encode_ms"]))
            out[s] = n * (big["encode_ms"] + big["decode_ms"]) / 1e3
    return out


def project(args) -> None:
    c = Constants(**json.loads(Path(args.constants).read_text())["constants"])
    if args.alpha is not None:           # the calibrated latency is TCP's on an oversubscribed host
        c = replace(c, alpha=args.alpha)
    halo = json.loads(Path(args.halos).read_text())
    gpu = json.loads(Path(args.gpu_log).read_text()) if args.gpu_log else {}
    model = Model()
    rows = project_rows(halo, args.rates, args.schedules, model, c, gpu)
    floors = codec_lower_bounds(Path(args.codecs_log), args.schedules, model)
    alpha_from = "given with --alpha" if args.alpha is not None else "calibrated on the CPU runs"
    table = projection_markdown(rows, halo, model, c, floors, alpha_from)
    out = Path(args.out)
    out.with_suffix(".md").write_text(table)
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "constants": asdict(c),
                                                    "codec_lower_bound_s": floors}, indent=1))
    print(table)
    if args.plot:
        plot_projection(rows, floors, Path(args.plot))


def plot_projection(rows: list[dict], floors: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    rates = sorted({r["rate"] for r in rows})
    scheds = list(dict.fromkeys(r["schedule"] for r in rows))
    full = {(r["ranks"], r["rate"]): r["wire_s"] for r in rows if r["schedule"] == "full"}
    for rate, style in zip(rates, ("-", "--", "-.", ":")):
        for i, s in enumerate(scheds):
            pts = sorted((r["ranks"], r["wire_s"]) for r in rows
                         if r["rate"] == rate and r["schedule"] == s)
            kw = {"color": f"C{i}", "ls": style, "marker": "o", "ms": 3,
                  "label": f"{s}, {rate:g} Gbit/s"}
            a.plot(*zip(*pts), **kw)
            if s != "full":
                b.plot([p[0] for p in pts], [1e3 * (full[(R, rate)] - w) for R, w in pts], **kw)
    if floors:
        low = min(floors.values())
        b.axhline(1e3 * low, color="grey", lw=0.8)
        b.text(8, 1e3 * low * 1.08, "H100 quant codec per epoch, measured at 20k rows: a lower bound",
               fontsize=7, color="grey")
    a.set_yscale("log")
    a.set_ylabel("wire time per epoch W (s)")
    b.set_ylabel("codec budget W(full) - W(schedule) (ms)")
    b.set_yscale("log")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (one link each)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def summary(args) -> None:
    """The docs' table: a few rows of the bandwidth-only projection (``--alpha 0``) beside the
    same rows with the calibrated latency."""
    bw = json.loads(Path(args.bandwidth).read_text())["rows"]
    lat = {_key(r): r for r in json.loads(Path(args.latency).read_text())["rows"]}
    full = {(r["ranks"], r["rate"]): r["wire_s"] for r in bw if r["schedule"] == "full"}
    lines = ["| GPUs | link (Gbit/s) | schedule | MB / epoch, busiest GPU | W, bandwidth only (ms) | "
             "W, calibrated latency (ms) | codec budget (ms) | codec GB/s needed |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in bw:
        if r["ranks"] in args.ranks and r["rate"] in args.rates and r["schedule"] in args.schedules:
            budget = full[(r["ranks"], r["rate"])] - r["wire_s"]
            extra = ("—", "—") if r["schedule"] == "full" else (
                f"{1e3 * budget:.1f}", f"{r['codec_in_bytes'] / budget / 1e9:.1f}")
            lines.append(f"| {r['ranks']} | {r['rate']:g} | {r['schedule']} | "
                         f"{r['bytes_max'] / 1e6:.0f} | {1e3 * r['wire_s']:.1f} | "
                         f"{1e3 * lat[_key(r)]['wire_s']:.0f} | "
                         f"{extra[0]} | {extra[1]} |")
    print("\n".join(lines))


def _key(r: dict) -> tuple:
    return r["ranks"], r["rate"], r["schedule"]


# -- re-measuring on an idle machine ------------------------------------------------------------
REMEASURE_FORM = {"overlap": "per-rank", "rate_bound": True}
"""The model ``remeasure`` fits: ``eps`` x 4 / R with the rate bound, ``C`` from the unlimited TCP
runs where the rates include ``none`` (else from shared memory). Fitted on six rounds
(2026-11-28c, d) it predicted all 48 cells of five later rounds within 15 % (docs/network-model.md)."""
REMEASURE_SCHEDULES = ["full", "quant4-all", "quant2-all", "quant1-all", "sample-all",
                       "sample-quant2-all", "full@s1", "quant1-all@s1"]


def remeasure(args) -> None:
    """bench/network.py for the calibration grid (4 and 8 ranks; 0.5, 1, 10 Gbit/s, unlimited TCP
    (``none``, whose runs give the compute) and shm), ``--rounds`` times one after another
    (OUT-r1, OUT-r2, ...: the same schedule's step moves by 15-30 % between runs minutes apart on
    a small machine), then ``calibrate`` on the medians over the rounds in the form that passed
    the blind test of 2026-11-28e (``REMEASURE_FORM``)."""
    out = Path(args.out)
    files = []
    for i in range(1, args.rounds + 1):
        part = out.with_name(f"{out.name}-r{i}")
        cmd = [sys.executable, str(REPO / "bench" / "network.py"), "--ranks", "4", "8", "--rates",
               *args.rates, "--schedules", *REMEASURE_SCHEDULES, "--epochs",
               str(args.epochs), "--eval-every", "50", "--out", str(part)]
        print("running:" if not args.dry_run else "would run:", " ".join(cmd), flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=True, cwd=REPO, env=os.environ)
        files.append(str(part.with_suffix(".json")))
    if args.dry_run:
        return
    refit(files, args.rates, out.with_name(out.name + "-model"))


def refit(files: list[str], rates: list[str], out: Path, plot: bool = True) -> None:
    """``calibrate`` on the medians of ``files`` in ``REMEASURE_FORM`` -> OUT.{md,json[,png]}."""
    form = dict(REMEASURE_FORM, compute="tcp" if "none" in rates else "shm")
    calibrate(argparse.Namespace(runs=files, combine="median", burst=None, **form, out=str(out),
                                 plot=str(out.with_suffix(".png")) if plot else None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("--runs", nargs="+", default=[str(p) for p in RUNS])
    c.add_argument("--out", default=str(RESULTS / "netmodel-calibration"))
    c.add_argument("--plot", default=None, help="PNG of predicted against measured epochs")
    c.add_argument("--combine", choices=["last", "median"], default="last",
                   help="a cell in several files: the last file's run (newer sweeps replace older) "
                        "or the median over them (the files are rounds of one grid)")
    c.add_argument("--overlap", choices=OVERLAPS, default="shared",
                   help="eps on the emulated link: one for every rank count, or falling as 4 / R")
    c.add_argument("--burst", type=tc_bytes, default=None,
                   help="the emulated link's token bucket, tc units, for every file (default: each "
                        "file's recorded --burst, 1mb where none is); 0: not modelled")
    c.add_argument("--rate-bound", action="store_true",
                   help="no epoch predicted under its bytes' time at eta x rate (see RATE_BOUND)")
    c.add_argument("--compute", choices=tuple(COMPUTES), default="shm",
                   help="the run that gives a link run's compute C: shm (shared memory) or tcp (the "
                        "same TCP loopback without a rate limit, rate 'none'; see COMPUTES)")
    c.add_argument("--stale-bytes", choices=STALE_BYTES, default="step",
                   help="step: a stale run's bytes as its median step sent them (default); mean: "
                        "over every epoch, epoch 0's one-time first-layer rows included (the model "
                        "before 2026-11-28)")
    h = sub.add_parser("halos")
    h.add_argument("--dataset", default=HALF, help=f"default: half of ogbn-products' size; {PRODUCTS} "
                   f"needs ~11 GB for METIS")
    h.add_argument("--parts", type=int, default=256)
    h.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--out", default=str(RESULTS / "netmodel-halos.json"))
    p = sub.add_parser("project")
    p.add_argument("--halos", default=str(RESULTS / "netmodel-halos.json"))
    p.add_argument("--constants", default=str(RESULTS / "netmodel-calibration.json"))
    p.add_argument("--rates", type=float, nargs="+", default=[25, 50, 100, 200])
    p.add_argument("--schedules", nargs="+", default=["full", "quant4-all", "quant2-all", "quant1-all"])
    p.add_argument("--alpha", type=float, default=None,
                   help="seconds per message instead of the calibrated one (e.g. 0: bandwidth only)")
    p.add_argument("--gpu-log", help="JSON of GPU compute/codec seconds per epoch (see the docstring)")
    p.add_argument("--codecs-log", default=str(RESULTS / "gpu" / "h100-2026-11-26" / "codecs-cuda.json"))
    p.add_argument("--out", default=str(RESULTS / "netmodel-projection"))
    p.add_argument("--plot", default=None, help="PNG of wire time and codec budget against GPUs")
    t = sub.add_parser("summary")
    t.add_argument("--bandwidth", default=str(RESULTS / "netmodel-projection-alpha0.json"))
    t.add_argument("--latency", default=str(RESULTS / "netmodel-projection.json"))
    t.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 128, 256])
    t.add_argument("--rates", type=float, nargs="+", default=[25, 100, 200])
    t.add_argument("--schedules", nargs="+", default=["full", "quant2-all", "quant1-all"])
    r = sub.add_parser("remeasure")
    r.add_argument("--out", default=str(RESULTS / "network-calib"))
    r.add_argument("--rounds", type=int, default=3, help="sweeps of the whole grid (default 3)")
    r.add_argument("--epochs", type=int, default=40, help="epochs per run (default 40)")
    r.add_argument("--rates", nargs="+", default=["0.5", "1", "10", "none", "shm"],
                   help="link rates of the grid (default 0.5 1 10 none shm; without none the fit "
                        "takes the compute from shm)")
    r.add_argument("--dry-run", action="store_true", help="print the benchmark command(s) only")
    v = sub.add_parser("validate")
    v.add_argument("--constants", required=True, help="JSON written by calibrate (its constants and sources)")
    v.add_argument("--runs", nargs="+", required=True, help="bench/network.py files not in the fit")
    v.add_argument("--combine", choices=["last", "median"], default="median")
    v.add_argument("--out", default=str(RESULTS / "netmodel-validation"))
    v.add_argument("--plot", default=None, help="PNG of predicted against measured epochs")
    v.add_argument("--stale-bytes", choices=STALE_BYTES, default=None,
                   help="as for calibrate (default: the fit's own; mean for a fit from before the option)")
    args = ap.parse_args()
    {"calibrate": calibrate, "validate": validate, "halos": halos, "project": project, "summary": summary,
     "remeasure": remeasure}[args.cmd](args)


if __name__ == "__main__":
    main()
