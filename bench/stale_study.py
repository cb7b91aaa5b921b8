"""Staleness study (accuracy): synchronous training against PipeGCN's bounded staleness (s = 1, 2;
the layer input exchanged before dropout, current weights, late halo gradients added into the
owners' boundary rows: ``hpcgnn/comm/stale.py``) and Sylvie (1-bit ``quant1-all`` + s = 1)
against synchronous 1-bit, on METIS and random parts, over seeds; and Adam's ``train.betas``.

    python bench/stale_study.py run [--seeds 0 1 2] [--parts 4] [--work runs/stale-study]
        [--datasets cora citeseer csbm20k] [--partitioners random metis]
        [--methods sync s1 ...] [--runs FILE]
    python bench/stale_study.py report [--runs FILE ...] [--out FILE.md]

Graphs (``DATASETS``): Cora and Citeseer (Kipf & Welling's GCN: 16 hidden, row-normalised
features) and ``csbm20k``, the held-out 20k-node contextual SBM of issue 22's bar and of
``bench/network.py`` (``SBM_SPEC``: 8 classes, 128 features, ``seed=11``; GCN 64 hidden);
200 epochs each, evaluation every epoch. A shard set's directory carries a hash of its
dataset spec, so no other spec under the same name is ever reused (the old script read the
50k graph of ``bench/study.py`` under the name ``sbm``).

Methods (``METHODS``): ``sync`` (s = 0), ``s1``, ``s2``, ``s1-m`` (PipeGCN's smoothing 0.95),
``sync-q1`` (1-bit every layer, both directions, s = 0), ``sylvie`` (``sync-q1`` + s = 1);
a ``-b7`` / ``-b5`` suffix sets Adam's ``train.betas = [0.7, 0.999]`` / ``[0.5, 0.999]``.

Every run is a real MPI run; the runs of one shard set share one ``mpiexec`` launch
(``bench/study.py``'s batch mode). Each finished run appends one record (test accuracy at the
best validation epoch, final, best validation, bytes, the validation and loss curves, the
commit) to ``--runs``; ``run`` skips runs already recorded, so it resumes. Accuracy only:
time is measured by ``bench/network.py`` on an idle machine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hpcgnn
import study  # noqa: E402  (bench/study.py: batch launches, TOML writing)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SBM_SPEC = "csbm:nodes=20000,classes=8,degree=10,homophily=0.7,features=128,signal=0.8,seed=11"
PLANETOID = {"model": {"arch": "gcn", "hidden": 16, "layers": 2, "dropout": 0.5},
             "data": {"normalize_features": True},
             "train": {"epochs": 200, "lr": 0.01, "weight_decay": 5e-4, "eval_every": 1}}
SBM = {"model": {"arch": "gcn", "hidden": 64, "layers": 2, "dropout": 0.5},
       "train": {"epochs": 200, "lr": 0.01, "weight_decay": 5e-4, "eval_every": 1}}
DATASETS = {"csbm20k": (SBM_SPEC, SBM), "cora": ("cora", PLANETOID),
            "citeseer": ("citeseer", PLANETOID)}
BETAS = {"": None, "-b7": [0.7, 0.999], "-b5": [0.5, 0.999]}
# method -> (staleness, smoothing, schedule)
BASE = {"sync": (0, 0.0, "full"), "s1": (1, 0.0, "full"), "s2": (2, 0.0, "full"),
        "s1-m": (1, 0.95, "full"), "sync-q1": (0, 0.0, "quant1-all"),
        "sylvie": (1, 0.0, "quant1-all")}
METHODS = {f"{m}{b}": (*spec, betas) for b, betas in BETAS.items() for m, spec in BASE.items()}
DEFAULT_METHODS = list(BASE)
BASELINE = {"s1": "sync", "s2": "sync", "s1-m": "sync", "sylvie": "sync-q1", "sync-q1": "sync"}


def shard_dir(work: Path, name: str, spec: str, parts: int, partitioner: str) -> Path:
    """Preprocess once per (spec, parts, partitioner); reused when ``preprocess verify`` passes."""
    tag = hashlib.sha256(spec.encode()).hexdigest()[:8]
    out = work / "shards" / f"{name}-{tag}-{partitioner}-{parts}"
    ok = subprocess.run([sys.executable, "-m", "preprocess", "verify", "-q", str(out)],
                        capture_output=True, cwd=REPO).returncode == 0
    if not ok:
        subprocess.run([sys.executable, "-m", "preprocess", "-q", "--dataset", spec, "--parts",
                        str(parts), "--partitioner", partitioner, "--out", str(out), "--force"],
                       check=True, cwd=REPO)
    return out


def launch(jobs: list[dict], parts: int, work: Path, tag: str) -> None:
    """One mpiexec (bench/study.py's batch mode) trains every job of one shard set in turn."""
    listing = work / f"jobs-{tag}.json"
    listing.write_text(json.dumps(jobs))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(parts), "--oversubscribe",
           sys.executable, "-m", "mpi4py", str(Path(study.__file__).resolve()), "batch", str(listing)]
    with open(work / "batch.log", "a") as log:
        subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=REPO,
                       timeout=4 * 3600, check=True)


def config_for(work: Path, name: str, method: str) -> Path:
    """The run config of ``method`` on dataset ``name`` (written once)."""
    s, m, _, betas = METHODS[method]
    base = DATASETS[name][1]
    train = {**base["train"], "staleness": s, "smoothing": m}
    if betas is not None:
        train["betas"] = betas
    path = work / "configs" / f"{name}-{method}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(study.to_toml({**base, "train": train}))
    return path


def jobs_for(args, name: str, part: str, done: set[str]) -> list[dict]:
    spec = DATASETS[name][0]
    shards = shard_dir(Path(args.work), name, spec, args.parts, part)
    jobs = []
    for method in args.methods:
        sched = REPO / "configs" / "schedules" / f"{METHODS[method][2]}.toml"
        for seed in args.seeds:
            rid = f"{name}|{part}|{args.parts}|{method}|{seed}"
            if rid not in done:
                jobs.append({"id": rid, "shards": str(shards), "seed": seed, "schedule": str(sched),
                             "config": str(config_for(Path(args.work), name, method)),
                             "out": str(Path(args.work) / "runs" / rid.replace("|", "-"))})
    return jobs


def _rounded(value, digits: int):
    """A metrics value rounded; null (a non-finite loss, as the metrics sink writes it) kept."""
    return None if value is None else round(value, digits)


def record(job: dict, runs: Path, rev: str) -> dict:
    """One finished run -> one line of ``runs``."""
    out = Path(job["out"])
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    rec = {"id": job["id"], "commit": rev, "test_acc": summary["test_acc"],
           "final_test_acc": summary["final_test_acc"], "best_val_acc": summary["best_val_acc"],
           "best_epoch": summary.get("best_epoch"),
           "bytes_ratio": summary["bytes_sent"] / max(summary["bytes_full"], 1),
           "val_curve": [_rounded(r.get("val_acc"), 4) for r in rows if "val_acc" in r],
           "loss_curve": [_rounded(r["loss"], 5) for r in rows]}
    with open(runs, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def run(args) -> None:
    work, runs = Path(args.work), Path(args.runs)
    work.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["id"] for line in runs.read_text().splitlines() if line} \
        if runs.is_file() else set()
    rev = study.commit()
    for name in args.datasets:
        for part in args.partitioners:
            jobs = jobs_for(args, name, part, done)
            if not jobs:
                continue
            print(f"{name} {part}: {len(jobs)} runs", flush=True)
            launch(jobs, args.parts, work, f"{name}-{part}")
            for job in jobs:
                rec = record(job, runs, rev)
                print(job["id"], f"test {rec['test_acc']:.4f}", flush=True)


# -- the report ------------------------------------------------------------------------------
def cells_of(files: list[str]) -> dict:
    """{(graph, partitioner, parts): {method: [records]}}."""
    cells: dict = {}
    for p in files:
        for line in Path(p).read_text().splitlines():
            if line:
                r = json.loads(line)
                name, part, parts, method, _ = r["id"].split("|")
                cells.setdefault((name, part, parts), {}).setdefault(method, []).append(r)
    return cells


def mean_sd(rs: list[dict], key: str = "test_acc") -> tuple[float, float]:
    vals = [100 * r[key] for r in rs]
    return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def baseline_of(method: str) -> str:
    """The synchronous run a method is compared with: the same betas, except that a
    synchronous run with other betas is compared with the default betas."""
    for suffix in BETAS:
        if suffix and method.endswith(suffix):
            bare = method[:-len(suffix)]
            return bare if bare in ("sync", "sync-q1") else BASELINE.get(bare, "sync") + suffix
    return BASELINE.get(method, "sync")


def cell_text(by: dict, method: str) -> str:
    rs = by.get(method, [])
    if not rs:
        return "—"
    mean, sd = mean_sd(rs)
    base = by.get(baseline_of(method))
    delta = "" if method in ("sync",) or not base else f" ({mean - mean_sd(base)[0]:+.1f})"
    return f"{mean:.1f} ± {sd:.1f}{delta}"


def report(files: list[str], out: Path) -> str:
    cells = cells_of(files)
    methods = [m for m in METHODS if any(m in by for by in cells.values())]
    revs = sorted({r["commit"] for by in cells.values() for rs in by.values() for r in rs})
    lines = [f"Test accuracy (%) at the best validation epoch, mean ± std over seeds "
             f"({', '.join(sorted({r['id'].split('|')[4] for by in cells.values() for rs in by.values() for r in rs}))}); "
             f"in brackets the difference (pt) to the synchronous run it is measured against "
             f"(`sylvie` against `sync-q1`, the others against `sync`; a `-b7`/`-b5` method against "
             f"the synchronous run with the same `train.betas`, and `sync-bN` against `sync`). "
             f"Commit {', '.join(revs)}.", "",
             "| graph | parts | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for (name, part, parts), by in sorted(cells.items()):
        lines.append(f"| {name} | {parts} {part} | " + " | ".join(cell_text(by, m) for m in methods) + " |")
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--parts", type=int, default=4)
    r.add_argument("--work", default=str(REPO / "runs" / "stale-study"))
    r.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=list(DATASETS))
    r.add_argument("--partitioners", nargs="+", choices=["random", "metis"],
                   default=["random", "metis"])
    r.add_argument("--methods", nargs="+", choices=list(METHODS), default=DEFAULT_METHODS)
    r.add_argument("--runs", required=True, help="the JSON-lines file the records go to")
    rep = sub.add_parser("report")
    rep.add_argument("--runs", nargs="+", required=True)
    rep.add_argument("--out", required=True, help="the Markdown table to write")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        print(report(args.runs, Path(args.out)))


if __name__ == "__main__":
    main()
