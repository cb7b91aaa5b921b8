"""The VARCO study: full communication vs fixed ratios vs variable schedules, and beyond.

    python bench/study.py run [--phase paper|parts|sbm|beyond|all] [--work runs/study]
    python bench/study.py report                 # table + plots from bench/results/study_runs.jsonl
    python bench/study.py ship                   # winning schedules -> configs/schedules/

Issue 23's re-run on the current codecs, with ``auto`` (``kind = "auto"``) as a column: Cora,
Citeseer, cSBM-50k x METIS, random x 4, 8 ranks x seeds 0-2, into its own result files
(``--tag``: ``bench/results/study-TAG_runs.jsonl``, ``study-TAG.md``):

    python bench/study.py run --tag auto-2core-DATE --phase auto-full auto auto-bytes auto-others
    python bench/study.py report --tag auto-2core-DATE

Every training is a real MPI run of the real trainer (``hpcgnn.__main__.main(["train", ...])``):
the runs of one shard set share one ``mpiexec`` launch (``python -m mpi4py bench/study.py batch
JOBS.json``), because on a small machine starting K ranks of Python + torch costs far more than
a Cora training. Each finished run appends one record (summary, curve, codec time share) to
``bench/results/study_runs.jsonl``; ``run`` skips runs already recorded, so it resumes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
RUNS_FILE = RESULTS / "study_runs.jsonl"
SHIPPED = REPO / "configs" / "schedules"

# --- what is run -------------------------------------------------------------------------

DATASETS = {
    "cora": {"spec": "cora", "config": {
        "model": {"arch": "gcn", "hidden": 128, "layers": 2, "dropout": 0.5},
        "data": {"normalize_features": True},
        "train": {"epochs": 100, "lr": 0.01, "weight_decay": 5e-4, "eval_every": 5}}},
    "citeseer": {"spec": "citeseer", "config": {
        "model": {"arch": "gcn", "hidden": 128, "layers": 2, "dropout": 0.5},
        "data": {"normalize_features": True},
        "train": {"epochs": 100, "lr": 0.01, "weight_decay": 5e-4, "eval_every": 5}}},
    "sbm": {"spec": "csbm:nodes=50000,classes=8,degree=10,homophily=0.7,features=128,signal=0.8",
            "config": {
                "model": {"arch": "gcn", "hidden": 128, "layers": 2, "dropout": 0.5},
                "train": {"epochs": 100, "lr": 0.01, "weight_decay": 5e-4, "eval_every": 5}}},
}
FIXED_RATIOS = (2, 4, 8, 16, 32, 64, 128)
FULL = {"codec": "none", "kind": "constant", "ratio": 1.0}


def fixed(ratio: float) -> dict:
    return {"codec": "truncate", "kind": "constant", "ratio": float(ratio)}


def varco(slope: float, codec: str = "truncate", **extra) -> dict:
    return {"codec": codec, "kind": "linear", "max_ratio": 128.0, "min_ratio": 1.0,
            "slope": float(slope), **extra}


PAPER = {"full": FULL, **{f"fixed-{r}": fixed(r) for r in FIXED_RATIOS},
         **{f"varco-s{s}": varco(s) for s in (5, 2, 10)}}

# Past the paper: codec combinations and schedules aimed at <= 10 % of full bytes.
BEYOND = {
    "varco-s5+q4": varco(5, "truncate+quant", bits=4),
    "quant1-all": {"codec": "quant", "kind": "constant", "ratio": 32.0,
                   "compress_last_layer": True},
    "quant2-all": {"codec": "quant", "kind": "constant", "ratio": 16.0,
                   "compress_last_layer": True},
    "quant-1to4-all": {"codec": "quant", "kind": "linear", "max_ratio": 32.0, "min_ratio": 8.0,
                       "slope": 1.0, "compress_last_layer": True},
    "varco16-q8-all": {"codec": "truncate+quant", "bits": 8, "kind": "linear",
                       "max_ratio": 128.0, "min_ratio": 16.0, "slope": 5.0,
                       "compress_last_layer": True},
    "varco4-q8-all": {"codec": "truncate+quant", "bits": 8, "kind": "linear",
                      "max_ratio": 128.0, "min_ratio": 4.0, "slope": 5.0,
                      "compress_last_layer": True},
    "sample4-q4-all": {"codec": "sample+quant", "bits": 4, "kind": "constant", "ratio": 4.0,
                       "compress_last_layer": True},
    "varco-s5+bwdq1": {**varco(5), "backward": {"codec": "quant", "kind": "constant",
                                                "ratio": 32.0}},
}

# (phase, dataset, parts, partitioner, methods, seeds)
PAPER_EXTRA = {"varco-s5-learned": varco(5, "learned"), "varco-s5-random": varco(5, "random"),
               # the last layer compressed too: a 2-layer GCN then has no exact exchange left
               "fixed-128-all": {**fixed(128), "compress_last_layer": True},
               "varco-s5-all": {**varco(5), "compress_last_layer": True}}
ALL_LAYERS = ["full", "fixed-128-all", "varco-s5-all"]
QUANT_ALL = ["quant1-all", "quant2-all", "quant-1to4-all"]
PLAN = [  # most important first, so a cut-short study still has its headline
    ("paper", "cora", 4, "metis", list(PAPER), [0]),
    ("sbm", "sbm", 4, "metis", ["full", "fixed-8", "fixed-128", "varco-s5"], [0]),
    ("beyond", "cora", 4, "metis", [*BEYOND, *PAPER_EXTRA], [0]),
    ("beyond", "sbm", 4, "metis", ["winners:1"], [0]),
    ("all-layers", "sbm", 4, "metis", ALL_LAYERS, [0]),
    ("seeds", "cora", 4, "metis", ["full", "varco-s5", "winners:2", "quant1-all", "quant2-all"],
     [1]),
    # METIS cuts the cSBM along its classes (few, mostly heterophilous, cut edges); random
    # parts are where the halo carries the signal
    ("random", "sbm", 4, "random", ["full", "fixed-128", "varco-s5", *ALL_LAYERS, "winners:1"],
     [0]),
    ("random", "cora", 4, "random", ["full", "fixed-128", "varco-s5", *ALL_LAYERS, "winners:1"],
     [0]),
    *[("parts", "cora", p, part, ["full", "fixed-128", "varco-s5"], [0])
      for p, part in ((2, "metis"), (8, "metis"), (2, "random"), (8, "random"), (16, "metis"),
                      (16, "random"))],
    # more parts on the cSBM where the halo carries the signal (random parts)
    *[("parts", "sbm", p, "random", ["full", "fixed-128-all", "varco-s5-all", "quant2-all"], [0])
      for p in (8, 16)],
    # truncation that never relaxes fails on random parts; unbiased quantisation of every
    # channel is the robust way under 10 %
    *[("robust", ds, 4, part, QUANT_ALL, [0]) for ds, part in
      (("cora", "random"), ("sbm", "random"), ("sbm", "metis"))],
]
# issue 23: the closed loop (kind = "auto", its defaults) against full communication on every
# cell, then the paper's schedule and the shipped quantisers beside them
AUTO = {"auto": {"kind": "auto"},
        # the most auto compresses under its budget (fewest bytes; no time model): the
        # budget's own accuracy, where shared memory makes the time objective send fp32
        "auto-bytes": {"kind": "auto", "objective": "bytes"},
        "quant4-all": {"codec": "quant", "kind": "constant", "ratio": 8.0,
                       "compress_last_layer": True}}
AUTO_CELLS = [(ds, parts, part) for ds in ("cora", "citeseer", "sbm")
              for part in ("metis", "random") for parts in (4, 8)]
PLAN += [(phase, ds, parts, part, methods, [0, 1, 2]) for phase, methods in
         (("auto-full", ["full"]), ("auto", ["auto"]), ("auto-bytes", ["auto-bytes"]),
          ("auto-others", ["varco-s5", "quant2-all", "quant4-all"]))
         for ds, parts, part in AUTO_CELLS]
METHODS = {**PAPER, **PAPER_EXTRA, **BEYOND, **AUTO}


def use_tag(tag: str | None) -> None:
    """Read and write ``study-TAG_runs.jsonl`` / ``study-TAG.md`` / ``.csv`` (None: the
    original ``study_runs.jsonl`` / ``study.md``)."""
    global RUNS_FILE, TABLE_STEM
    RUNS_FILE = RESULTS / (f"study-{tag}_runs.jsonl" if tag else "study_runs.jsonl")
    TABLE_STEM = f"study-{tag}" if tag else "study"


TABLE_STEM = "study"


def run_id(dataset: str, parts: int, partitioner: str, method: str, seed: int) -> str:
    return f"{dataset}-{partitioner}-{parts}-{method}-s{seed}"


# --- files ---------------------------------------------------------------------------------


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v) if isinstance(v, str) else repr(v)


def to_toml(table: dict, prefix: str = "") -> str:
    """A small TOML writer for flat keys and nested tables (what schedules and configs use)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for k, v in table.items():
        if isinstance(v, dict):
            lines += ["", f"[{prefix}{k}]", to_toml(v, f"{prefix}{k}.")]
    return "\n".join(lines).strip() + "\n"


def shard_dir(work: Path, dataset: str, parts: int, partitioner: str) -> Path:
    """Preprocess once (reused when ``preprocess verify`` passes)."""
    out = work / "shards" / f"{dataset}-{partitioner}-{parts}"
    ok = subprocess.run([sys.executable, "-m", "preprocess", "verify", "-q", str(out)],
                        capture_output=True).returncode == 0
    if not ok:
        subprocess.run([sys.executable, "-m", "preprocess", "-q", "--dataset",
                        DATASETS[dataset]["spec"], "--parts", str(parts), "--partitioner",
                        partitioner, "--out", str(out), "--force"], check=True)
    return out


def recorded() -> set[str]:
    if not RUNS_FILE.is_file():
        return set()
    return {json.loads(line)["id"] for line in RUNS_FILE.read_text().splitlines() if line}


def load_runs() -> list[dict]:
    return [json.loads(line) for line in RUNS_FILE.read_text().splitlines() if line]


# --- running -------------------------------------------------------------------------------


def jobs_for(work: Path, dataset: str, parts: int, partitioner: str, methods: list[str],
             seeds: list[int], done: set[str]) -> list[dict]:
    shards = shard_dir(work, dataset, parts, partitioner)
    config = work / "configs" / f"{dataset}.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(to_toml(DATASETS[dataset]["config"]))
    jobs = []
    for method in methods:
        schedule = work / "schedules" / f"{method}.toml"
        schedule.parent.mkdir(parents=True, exist_ok=True)
        schedule.write_text(to_toml(METHODS[method]))
        for seed in seeds:
            rid = run_id(dataset, parts, partitioner, method, seed)
            if rid not in done:
                jobs.append({"id": rid, "dataset": dataset, "parts": parts,
                             "partitioner": partitioner, "method": method, "seed": seed,
                             "shards": str(shards), "config": str(config),
                             "schedule": str(schedule), "out": str(work / "runs" / rid)})
    return jobs


def launch(jobs: list[dict], parts: int, work: Path) -> None:
    """One mpiexec for all ``jobs`` (same shard set), then record each finished run."""
    listing = work / f"jobs-{jobs[0]['id']}.json"
    listing.write_text(json.dumps(jobs))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(parts), "--oversubscribe",
           sys.executable, "-m", "mpi4py", str(Path(__file__).resolve()), "batch", str(listing)]
    t0 = time.perf_counter()
    with open(work / "batch.log", "a") as log:
        subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                       timeout=3600, check=True)
    print(f"  {len(jobs)} runs on {parts} ranks in {time.perf_counter() - t0:.0f} s", flush=True)
    for job in jobs:
        record(job)


COMMIT_FILE = "study-commit.txt"
"""Written beside a run's summary by ``batch``: the commit the run trained with."""


def commit() -> str:
    """The commit runs train with now: HEAD, ``+dirty`` where tracked files other than the
    results (which every recorded run appends to) differ from it."""
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    clean = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", ".",
                            ":(exclude)bench/results"]).returncode == 0
    return head if clean else head + "+dirty"


def batch(listing: str) -> None:
    """Inside mpiexec: train every job of the listing in turn through the CLI entry point. A
    finished run is reused only if it trained with the commit of now (a batch that crashed
    half-way resumes; a run left from an older commit trains again rather than being recorded
    as this one's)."""
    from mpi4py import MPI

    from hpcgnn.__main__ import main as hpcgnn_main
    now = MPI.COMM_WORLD.bcast(commit() if MPI.COMM_WORLD.Get_rank() == 0 else None)
    for job in json.loads(Path(listing).read_text()):
        out = Path(job["out"])
        stamp = out / COMMIT_FILE
        if ((out / "summary.json").is_file() and stamp.is_file()
                and stamp.read_text().strip() == now):
            continue
        code = hpcgnn_main(["train", "--shards", job["shards"], "--config", job["config"],
                            "--schedule", job["schedule"], "--out", job["out"], "--force",
                            "--set", f"train.seed={job['seed']}"])
        if code:
            raise SystemExit(code)
        if MPI.COMM_WORLD.Get_rank() == 0:
            stamp.write_text(now + "\n")


def record(job: dict) -> None:
    """Summary + curve + codec time share of a finished run -> one line of RUNS_FILE."""
    out = Path(job["out"])
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sent = full = 0
    curve = []
    for r in rows:
        sent, full = sent + r["bytes_sent"], full + r["bytes_full"]
        if "test_acc" in r:
            curve.append([r["epoch"], r["val_acc"], r["test_acc"], sent])
    shares = [r["codec_s"] / r["epoch_s"] for r in rows if r["epoch_s"] > 0]
    rec = {k: job[k] for k in ("id", "dataset", "parts", "partitioner", "method", "seed")}
    stamp = out / COMMIT_FILE                # the commit it trained with, not HEAD's now
    rec["commit"] = stamp.read_text().strip() if stamp.is_file() else "unknown"
    rec.update({k: summary[k] for k in ("test_acc", "final_test_acc", "best_val_acc",
                                        "bytes_sent", "bytes_full", "epoch_time_s_median")})
    rec.update({"byte_share": summary["bytes_sent"] / summary["bytes_full"],
                "codec_share": statistics.median(shares), "ratios": rows[0]["ratio"],
                "curve": curve, "schedule": METHODS[job["method"]]})
    with open(RUNS_FILE, "a") as f:
        f.write(json.dumps(rec) + "\n")


def cora_candidates(count: int, tolerance: float = 1.0) -> list[str]:
    """The beyond-the-paper methods worth more runs: on Cora (4 METIS parts, seed 0), those within
    ``tolerance`` points of full by bytes, then the rest by accuracy."""
    rows = [r for r in table_rows([r for r in load_runs() if r["seed"] == 0])
            if (r["dataset"], r["partitioner"], r["parts"]) == ("cora", "metis", 4)
            and r["method"] in BEYOND]
    rows.sort(key=lambda r: (r["delta_vs_full"] < -tolerance, r["byte_share_pct"]
                             if r["delta_vs_full"] >= -tolerance else -r["delta_vs_full"]))
    return [r["method"] for r in rows[:count]]


def resolve(methods: list[str]) -> list[str]:
    """Expand ``winners:N`` entries (chosen from the results so far)."""
    out = []
    for m in methods:
        out += cora_candidates(int(m.split(":")[1])) if m.startswith("winners:") else [m]
    return list(dict.fromkeys(out))


def run(phases: list[str], work: Path) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    for ph, dataset, parts, partitioner, methods, seeds in PLAN:
        if "all" not in phases and ph not in phases:
            continue
        methods = resolve(methods)
        jobs = jobs_for(work, dataset, parts, partitioner, methods, seeds, recorded())
        print(f"[{ph}] {dataset} {partitioner} {parts} parts: {len(jobs)} runs to do", flush=True)
        if jobs:
            launch(jobs, parts, work)


# --- reporting -----------------------------------------------------------------------------


def grouped(runs: list[dict]) -> dict[tuple, list[dict]]:
    """Runs by (dataset, partitioner, parts, method), seeds together."""
    out: dict[tuple, list[dict]] = {}
    for r in runs:
        out.setdefault((r["dataset"], r["partitioner"], r["parts"], r["method"]), []).append(r)
    return out


def _order(key: tuple) -> tuple:
    """Table order: dataset, partitioner, parts, then methods as listed in METHODS."""
    dataset, part, parts, method = key
    return dataset, part, parts, list(METHODS).index(method)


def table_rows(runs: list[dict]) -> list[dict]:
    groups = grouped(runs)
    rows = []
    for (dataset, part, parts, method), rs in sorted(groups.items(), key=lambda kv: _order(kv[0])):
        accs = [100 * r["test_acc"] for r in rs]
        base = groups.get((dataset, part, parts, "full"))
        full_acc = statistics.mean(100 * r["test_acc"] for r in base) if base else float("nan")
        rows.append({"dataset": dataset, "partitioner": part, "parts": parts, "method": method,
                     "seeds": len(rs), "test_acc": statistics.mean(accs),
                     "test_acc_sd": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                     "delta_vs_full": statistics.mean(accs) - full_acc,
                     "byte_share_pct": 100 * statistics.mean(r["byte_share"] for r in rs),
                     "codec_share_pct": 100 * statistics.median(r["codec_share"] for r in rs)})
    return rows


TABLE_NOTE = """# VARCO study (`python bench/study.py run && python bench/study.py report`)

2-layer GCN, hidden 128, dropout 0.5, Adam lr 0.01, weight decay 5e-4, evaluated every 5 epochs;
test accuracy at the best validation epoch. Cora, Citeseer: row-normalised features, 100 epochs. sbm:
`{sbm}`, 100 epochs; on it a 2-layer MLP of the features alone reaches
20.0 % test accuracy, logistic regression on 1- and 2-hop propagated features 55.0 % and 85.4 %
(single process, torch, 150 epochs): the neighbours carry the signal.
Bytes are totals over ranks, forward and backward, training steps only; "bytes vs full" is
`bytes_sent / bytes_full` (fp32 for the same exchanges). Codec share: median over epochs of
`codec_s / epoch_s`, measured on a shared 2-core machine with the ranks oversubscribed (shares
are indicative). Methods: `bench/study.py` (`PAPER`, `PAPER_EXTRA`, `BEYOND`); `-all` = the
last layer compressed too. Seeds > 1: mean ± sd.

"""


def write_table(rows: list[dict], commits: list[str] = ()) -> None:
    keys = list(rows[0])
    csv = [",".join(keys)] + [",".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k])
                                       for k in keys) for r in rows]
    (RESULTS / f"{TABLE_STEM}.csv").write_text("\n".join(csv) + "\n")
    md = ["| dataset | partitioner | parts | method | seeds | test acc % | Δ vs full (pt) | "
          "bytes vs full % | codec share of epoch % |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        sd = f" ± {r['test_acc_sd']:.1f}" if r["seeds"] > 1 else ""
        md.append(f"| {r['dataset']} | {r['partitioner']} | {r['parts']} | {r['method']} | "
                  f"{r['seeds']} | {r['test_acc']:.1f}{sd} | {r['delta_vs_full']:+.1f} | "
                  f"{r['byte_share_pct']:.1f} | {r['codec_share_pct']:.1f} |")
    note = TABLE_NOTE.format(sbm=DATASETS["sbm"]["spec"])
    if commits:
        note += f"Runs made at commit {', '.join(commits)}.\n\n"
    (RESULTS / f"{TABLE_STEM}.md").write_text(note + "\n".join(md) + "\n" + auto_table(rows))


def winners(rows: list[dict], tolerance: float = 0.5) -> list[dict]:
    """Methods within ``tolerance`` points of full in every 4-part setting they ran in (dataset x
    partitioner), most settings first, then by their largest share of full bytes."""
    picked: dict[str, list[dict]] = {}
    for r in rows:
        if r["parts"] == 4 and r["method"] != "full" and not math.isnan(r["delta_vs_full"]):
            picked.setdefault(r["method"], []).append(r)
    ok = [{"method": m, "byte_share_pct": max(r["byte_share_pct"] for r in rs),
           "delta": min(r["delta_vs_full"] for r in rs), "settings": len(rs)}
          for m, rs in picked.items() if all(r["delta_vs_full"] >= -tolerance for r in rs)]
    return sorted(ok, key=lambda w: (-w["settings"], w["byte_share_pct"]))


def _family(method: str) -> tuple[str, str]:
    """(legend family, colour) of a method."""
    if method == "full":
        return "full communication", "black"
    if method.startswith("fixed-"):
        return "fixed ratio (truncate)", "tab:blue"
    if method in PAPER or method in PAPER_EXTRA:
        return "VARCO linear 128 -> 1", "tab:orange"
    return "beyond the paper", "tab:green"


def _mean_acc(rs: list[dict]) -> float:
    return 100 * statistics.mean(r["test_acc"] for r in rs)


def _frontier_panel(ax, runs: list[dict], dataset: str, part: str) -> None:
    """One partitioner's points: accuracy against the share of full bytes, 4 parts."""
    points = [(k, rs) for k, rs in sorted(grouped(runs).items(), key=lambda kv: _order(kv[0]))
              if (k[0], k[1], k[2]) == (dataset, part, 4)]
    seen = set()
    for i, ((_, _, _, method), rs) in enumerate(points):
        family, colour = _family(method)
        x, y = 100 * statistics.mean(r["byte_share"] for r in rs), _mean_acc(rs)
        ax.scatter(x, y, s=60, color=colour, zorder=3, label=None if family in seen else family)
        seen.add(family)
        ax.annotate(method, (x, y), textcoords="offset points", xytext=(5, 5 if i % 2 else -11),
                    fontsize=7.5, color=colour)
        if method == "full":
            ax.axhspan(y - 0.5, y + 0.5, color="grey", alpha=0.2, label="full ± 0.5 pt")
    ax.axvline(10, color="tab:red", ls="--", lw=1, label="10 % of full bytes")
    ax.set_xscale("log")
    ax.set(xlabel="total bytes exchanged, % of full communication (log)",
           title=f"{dataset}, 4 {part} parts")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def draw_frontier(runs: list[dict], dataset: str, out: Path) -> None:
    """The budget frontier: accuracy against total bytes for every method, METIS | random."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5), sharey=True)
    for ax, part in zip(axes, ("metis", "random")):
        _frontier_panel(ax, runs, dataset, part)
    axes[0].set_ylabel("test accuracy % (at best validation epoch)")
    fig.suptitle(f"{dataset}: accuracy vs communication budget (seed means)")
    fig.tight_layout()
    fig.savefig(out / f"frontier_{dataset}.png", dpi=110)
    plt.close(fig)


def draw_epochs(runs: list[dict], dataset: str, part: str, highlight: list[str],
                out: Path) -> None:
    """Test accuracy and cumulative bytes against the epoch, 4 ``part`` parts, seed 0."""
    import matplotlib.pyplot as plt
    fig, (acc_ax, byte_ax) = plt.subplots(1, 2, figsize=(13, 5.5))
    by_id = {r["id"]: r for r in runs}
    full = by_id.get(run_id(dataset, 4, part, "full", 0))
    shown = [by_id[i] for i in dict.fromkeys(run_id(dataset, 4, part, m, 0) for m in highlight)
             if i in by_id and by_id[i]["curve"]]
    for r in shown:
        method = r["method"]
        epochs = [c[0] for c in r["curve"]]
        acc_ax.plot(epochs, [100 * c[2] for c in r["curve"]], label=method, lw=1.6)
        byte_ax.plot(epochs, [100 * c[3] / full["bytes_sent"] for c in r["curve"]] if full
                     else [c[3] for c in r["curve"]], label=method, lw=1.6)
    acc_ax.set(xlabel="epoch", ylabel="test accuracy %",
               title=f"{dataset}: accuracy vs epoch (4 {part} parts)")
    byte_ax.set(xlabel="epoch", ylabel="cumulative bytes, % of full communication's total",
                title=f"{dataset}: bytes spent so far (4 {part} parts)")
    for ax in (acc_ax, byte_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    lo = min((100 * c[2] for r in shown for c in r["curve"] if c[0] >= 10), default=0)
    acc_ax.set_ylim(max(lo - 2, 0), None)
    fig.tight_layout()
    fig.savefig(out / f"epochs_{dataset}_{part}.png", dpi=110)
    plt.close(fig)


def draw_parts(runs: list[dict], dataset: str, out: Path) -> None:
    """Test accuracy against the number of parts, per method and partitioner."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5.5))
    groups = grouped(runs)
    for method in ("full", "fixed-128", "varco-s5"):
        colour = _family(method)[1]
        for part, style in (("metis", "-"), ("random", "--")):
            pts = sorted((p, _mean_acc(rs)) for (ds, pt, p, m), rs in groups.items()
                         if ds == dataset and pt == part and m == method)
            if pts:
                ax.plot(*zip(*pts), style, marker="o", color=colour, label=f"{method}, {part}")
    ax.set_xscale("log", base=2)
    ticks = sorted({p for (ds, _, p, _) in groups if ds == dataset})
    ax.set_xticks(ticks, [str(p) for p in ticks])
    ax.set(xlabel="parts (MPI ranks)", ylabel="test accuracy %",
           title=f"{dataset}: accuracy vs parts (solid METIS, dashed random)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"parts_{dataset}.png", dpi=110)
    plt.close(fig)


def draw_all(runs: list[dict], rows: list[dict], out: Path) -> None:
    best = [w["method"] for w in winners(rows)[:2]]
    shown = ["full", "fixed-128", "fixed-128-all", "varco-s5", "varco-s5-all", "varco16-q8-all",
             *best]
    for dataset in sorted({r["dataset"] for r in runs}):
        draw_frontier(runs, dataset, out)
        draw_epochs(runs, dataset, "random", shown, out)
    draw_parts(runs, "cora", out)


AUTO_COLUMNS = ("auto", "auto-bytes", "varco-s5", "quant2-all", "quant4-all")


def auto_table(rows: list[dict]) -> str:
    """Issue 23's table: per cell, full communication's accuracy and each method's difference
    (3-seed means) and share of full bytes; empty when no run of ``auto`` is in ``rows``."""
    by = {(r["dataset"], r["partitioner"], r["parts"], r["method"]): r for r in rows}
    cells = sorted({k[:3] for k in by if k[3] == "auto"})
    if not cells:
        return ""
    head = " | ".join(f"{m} Δ pt (bytes %)" for m in AUTO_COLUMNS)
    md = ["", "### `auto` beside full communication (3-seed means, test accuracy at best "
          "validation)", "", f"| dataset | partitioner | parts | full % | {head} |",
          "|---|---|---:|---:|" + "---:|" * len(AUTO_COLUMNS)]
    for cell in cells:
        full = by.get((*cell, "full"))
        line = [*map(str, cell), f"{full['test_acc']:.1f} ± {full['test_acc_sd']:.1f}"
                if full else "—"]
        for m in AUTO_COLUMNS:
            r = by.get((*cell, m))
            line.append("—" if r is None else
                        f"{r['delta_vs_full']:+.1f} ({r['byte_share_pct']:.0f})" +
                        ("" if r["seeds"] == 3 else f" [{r['seeds']} seeds]"))
        md.append("| " + " | ".join(line) + " |")
    return "\n".join(md) + "\n"


def draw_auto(runs: list[dict], out: Path) -> None:
    """Per cell: each method's test accuracy minus full's (seed means, with the seeds' range)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = grouped(runs)
    cells = sorted({k[:3] for k in groups if k[3] == "auto"})
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(cells)), 4.5))
    for j, m in enumerate(AUTO_COLUMNS):
        xs, ys, lo, hi = [], [], [], []
        for i, cell in enumerate(cells):
            rs, full = groups.get((*cell, m)), groups.get((*cell, "full"))
            if not rs or not full:
                continue
            d = [100 * r["test_acc"] - _mean_acc(full) for r in rs]
            xs.append(i + 0.15 * (j - (len(AUTO_COLUMNS) - 1) / 2))
            ys.append(statistics.mean(d))
            lo.append(ys[-1] - min(d))
            hi.append(max(d) - ys[-1])
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=2, label=m)
    ax.axhspan(-0.5, 0.5, color="grey", alpha=0.2, label="full ± 0.5 pt")
    ax.set_xticks(range(len(cells)), [f"{d}\n{p} {n}" for d, n, p in cells], fontsize=7)
    ax.set_ylabel("test accuracy − full's (pt)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{TABLE_STEM}.png", dpi=110)
    plt.close(fig)


def report() -> None:
    runs = load_runs()
    rows = table_rows(runs)
    write_table(rows, sorted({r["commit"] for r in runs if r.get("commit")}))
    if TABLE_STEM != "study":                  # a tagged study: its own table and plot only
        draw_auto(runs, RESULTS)
        print((RESULTS / f"{TABLE_STEM}.md").read_text())
        return
    best = winners(rows)
    (RESULTS / "winners.json").write_text(json.dumps(best, indent=1))
    draw_all(runs, rows, RESULTS)
    print((RESULTS / "study.md").read_text())
    print("winners (within 0.5 pt of full, 4 METIS parts):", json.dumps(best[:5], indent=1))


QUANT_NOTE = ("# With codec = 'quant' alone the ratio sets the bits: 32 -> 1, 16 -> 2, 8 -> 4, "
              "4 -> 8 (hpcgnn/codecs/build.py).\n")


def ship(count: int = 2) -> None:
    """Write the best ``count`` winners' schedules to configs/schedules/."""
    for w in json.loads((RESULTS / "winners.json").read_text())[:count]:
        text = (f"# bench/study.py winner '{w['method']}': within 0.5 pt of full communication's "
                f"test accuracy in all {w['settings']}\n# settings it ran in (Cora, cSBM-50k x "
                f"METIS, random; 4 parts) at <= {w['byte_share_pct']:.1f} % of its bytes "
                "(bench/results/study.md).\n" + (QUANT_NOTE if METHODS[w["method"]]["codec"] ==
                                                    "quant" else "")
                + to_toml(METHODS[w["method"]]))
        (SHIPPED / f"{w['method']}.toml").write_text(text)
        print("shipped", SHIPPED / f"{w['method']}.toml")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--phase", nargs="+", default=["all"],
                   choices=("all", *dict.fromkeys(p[0] for p in PLAN)))
    r.add_argument("--work", default=str(REPO / "runs" / "study"))
    r.add_argument("--tag", help="record into study-TAG_runs.jsonl (e.g. auto-2core-20250101)")
    sub.add_parser("report").add_argument("--tag", help="report study-TAG_runs.jsonl")
    sub.add_parser("ship").add_argument("--count", type=int, default=2)
    sub.add_parser("batch").add_argument("listing")
    args = ap.parse_args()
    use_tag(getattr(args, "tag", None))
    if args.cmd == "run":
        run(args.phase, Path(args.work))
    elif args.cmd == "report":
        report()
    elif args.cmd == "ship":
        ship(args.count)
    else:
        batch(args.listing)


if __name__ == "__main__":
    main()
