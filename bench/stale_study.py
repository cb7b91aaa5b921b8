"""Staleness study (accuracy): synchronous training against PipeGCN-style staleness 1 and 2,
with and without smoothing, with and without Sylvie's 1-bit quantisation of every exchange.

    python bench/stale_study.py run [--seeds 0 1 2] [--parts 4] [--work runs/stale-study]
        [--datasets cora sbm] [--partitioners random] [--methods s1 s1-q1] [--runs FILE]
    python bench/stale_study.py report [--runs FILE ...]   # bench/results/stale.md

Cora and Citeseer (Kipf & Welling's GCN: 16 hidden, 200 epochs, row-normalised features) and a
50k-node contextual SBM (GCN, 64 hidden, 100 epochs), METIS and random parts. (Until
2026-11-23 this said 20k while the runs used the 50k graph of ``bench/study.py``, which took
precedence over this file's spec under the same name; the spec below is the one that ran.) Every run is a
real MPI run; the runs of one shard set share one ``mpiexec`` launch (``bench/study.py``'s
batch mode). Accuracy only: time is measured by ``bench/network.py`` on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study  # noqa: E402  (bench/study.py: shard sets, batch launches, TOML writing)

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "bench" / "results" / "stale_runs.jsonl"
KW = {"model": {"arch": "gcn", "hidden": 16, "layers": 2, "dropout": 0.5},
      "data": {"normalize_features": True},
      "train": {"epochs": 200, "lr": 0.01, "weight_decay": 5e-4, "eval_every": 1}}
SBM = {"model": {"arch": "gcn", "hidden": 64, "layers": 2, "dropout": 0.5},
       "train": {"epochs": 100, "lr": 0.01, "weight_decay": 5e-4, "eval_every": 1}}
DATASETS = {"cora": ("cora", KW), "citeseer": ("citeseer", KW),
            "sbm": ("csbm:nodes=50000,classes=8,degree=10,homophily=0.7,features=128,signal=0.8,seed=0", SBM)}
# method -> (staleness, smoothing, schedule)
METHODS = {"sync": (0, 0.0, "full"), "sync-q1": (0, 0.0, "quant1-all"),
           "s1": (1, 0.0, "full"), "s1-m": (1, 0.95, "full"), "s2": (2, 0.0, "full"),
           "s2-m": (2, 0.95, "full"), "s1-q1 (Sylvie)": (1, 0.0, "quant1-all"),
           "s1-m-q1": (1, 0.95, "quant1-all")}


def launch(jobs: list[dict], parts: int, work: Path, tag: str) -> None:
    """One mpiexec (bench/study.py's batch mode) trains every job of one shard set in turn."""
    listing = work / f"jobs-{tag}.json"
    listing.write_text(json.dumps(jobs))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(parts), "--oversubscribe",
           sys.executable, "-m", "mpi4py", str(Path(study.__file__).resolve()), "batch", str(listing)]
    with open(work / "batch.log", "a") as log:
        subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                       timeout=7200, check=True)


def run(args) -> None:
    work, runs = Path(args.work), Path(args.runs)
    done = {json.loads(line)["id"] for line in runs.read_text().splitlines()} if runs.is_file() else set()
    for name, (spec, base) in DATASETS.items():
        if args.datasets and name not in args.datasets:
            continue
        for part in ("random", "metis"):
            if args.partitioners and part not in args.partitioners:
                continue
            study.DATASETS[name] = {"spec": spec, "config": base}      # this file's spec
            shards = study.shard_dir(work, name, args.parts, part)
            jobs = []
            for method, (s, m, sched) in METHODS.items():
                if args.methods and method.split()[0] not in args.methods:
                    continue
                for seed in args.seeds:
                    rid = f"{name}|{part}|{args.parts}|{method}|{seed}"
                    if rid in done:
                        continue
                    cfg = {**base, "train": {**base["train"], "staleness": s, "smoothing": m}}
                    path = work / "configs" / f"{name}-{method.split()[0]}.toml"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(study.to_toml(cfg))
                    out = work / "runs" / rid.replace("|", "-").replace(" ", "")
                    jobs.append({"id": rid, "shards": str(shards), "config": str(path), "seed": seed,
                                 "schedule": str(REPO / "configs" / "schedules" / f"{sched}.toml"),
                                 "out": str(out)})
            if jobs:
                launch(jobs, args.parts, work, f"{name}-{part}")
            for job in jobs:
                summary = json.loads((Path(job["out"]) / "summary.json").read_text())
                rec = {"id": job["id"], "test_acc": summary["test_acc"],
                       "bytes_ratio": summary["bytes_sent"] / max(summary["bytes_full"], 1)}
                with open(runs, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(job["id"], rec, flush=True)


def report(files: list[str]) -> None:
    runs = [json.loads(line) for p in files for line in Path(p).read_text().splitlines() if line]
    cells: dict = {}
    for r in runs:
        name, part, parts, method, _ = r["id"].split("|")
        cells.setdefault((name, part, parts), {}).setdefault(method, []).append(r)
    methods = [m for m in METHODS if any(m in by for by in cells.values())]
    lines = ["Test accuracy at the best validation epoch, mean ± std over seeds, and the difference "
             "to synchronous full communication (pt); bytes relative to fp32.", "",
             "| graph | parts | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for (name, part, parts), by in cells.items():
        sync = statistics.mean(r["test_acc"] for r in by.get("sync", [{"test_acc": float("nan")}]))
        row = []
        for method in methods:
            rs = by.get(method, [])
            if not rs:
                row.append("—")
                continue
            accs = [r["test_acc"] for r in rs]
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            mean = statistics.mean(accs)
            delta = "" if method == "sync" else f" ({100 * (mean - sync):+.1f})"
            row.append(f"{100 * mean:.1f} ± {100 * sd:.1f}{delta}, {100 * rs[0]['bytes_ratio']:.0f} %")
        lines.append(f"| {name} | {parts} {part} | " + " | ".join(row) + " |")
    text = "\n".join(lines) + "\n"
    out = REPO / "bench" / "results" / "stale.md"
    if out.is_file() and "\n## " in out.read_text():     # the hand-written sections after the table
        text += "\n## " + out.read_text().split("\n## ", 1)[1]
    out.write_text(text)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--parts", type=int, default=4)
    r.add_argument("--work", default=str(REPO / "runs" / "stale-study"))
    r.add_argument("--datasets", nargs="+", choices=list(DATASETS), help="default: all")
    r.add_argument("--partitioners", nargs="+", choices=["random", "metis"], help="default: both")
    r.add_argument("--methods", nargs="+", choices=[m.split()[0] for m in METHODS], help="default: all")
    r.add_argument("--runs", default=str(RUNS), help="the JSON-lines file the records go to")
    rep = sub.add_parser("report")
    rep.add_argument("--runs", nargs="+", default=[str(RUNS)])
    args = ap.parse_args()
    run(args) if args.cmd == "run" else report(args.runs)


if __name__ == "__main__":
    main()
