"""RETEXO study (accuracy and bytes): lazy message passing against full training at the same
total epochs (``train.epochs = layers * rounds_per_layer``), same model width, same optimiser.

    python bench/retexo_study.py run [--phase acc|bytes|all] [--seeds 0 1 2] [--work runs/retexo-study]
    python bench/retexo_study.py report      # bench/results/retexo.md from retexo_runs.jsonl

Both methods are exact when uncompressed: their losses on R ranks equal 1 rank's (tests), so
test accuracy does not depend on the partition or the rank count. Hence two phases:
- ``acc``: every dataset x method x seed on ONE rank (cheap);
- ``bytes``: seed 0 on 4 and 8 ranks, METIS and random parts. It gives the halo-exchange and
  all-reduce bytes (``summary.json``). On 4 METIS parts it also evaluates every epoch and checks
  that the accuracy matches the 1-rank run. The other cells evaluate only at the end, because
  bytes do not depend on evaluation.
Every run is a real ``hpcgnn train``. The runs of one shard set share one ``mpiexec`` launch,
with each job running ``hpcgnn.__main__.main`` inside it. Finished runs are appended to
``bench/results/retexo_runs.jsonl``, and ``run`` skips those already recorded.
Accuracy and bytes only: time is ``bench/network.py``'s job (``full@retexo``).
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hpcgnn
import study  # noqa: E402  (bench/study.py: shard sets, TOML writing)

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "bench" / "results" / "retexo_runs.jsonl"
# the 50k-node graph of bench/study.py: until 2026-11-23 this line named a 20k graph (seed 11), but
# study.DATASETS' "sbm" took precedence under the same name, so the recorded runs used this one
SBM_SPEC = "csbm:nodes=50000,classes=8,degree=10,homophily=0.7,features=128,signal=0.8,seed=0"
KW = {"model": {"arch": "gcn", "hidden": 16, "layers": 2, "dropout": 0.5},
      "data": {"normalize_features": True},
      "train": {"epochs": 200, "lr": 0.01, "weight_decay": 5e-4, "eval_every": 1}}
WIDE = {**KW, "model": {**KW["model"], "hidden": 256}}
SBM = {"model": {"arch": "gcn", "hidden": 64, "layers": 2, "dropout": 0.5},
       "train": {"epochs": 100, "lr": 0.01, "weight_decay": 5e-4, "eval_every": 1}}
# name -> (dataset spec, run config); Cora/Citeseer at Kipf & Welling's width 16 and at 256
DATASETS = {"cora": ("cora", KW), "cora-h256": ("cora", WIDE), "citeseer": ("citeseer", KW),
            "citeseer-h256": ("citeseer", WIDE), "sbm": (SBM_SPEC, SBM)}
METHODS = ("full", "retexo")
BYTES_RANKS, PARTITIONERS = (4, 8), ("metis", "random")
VERIFY = (4, "metis")          # the bytes cell that also checks accuracy against 1 rank


def config_for(base: dict, method: str) -> dict:
    """The run config of ``method``: RETEXO spends epochs / layers rounds on each layer."""
    if method == "full":
        return base
    rounds = base["train"]["epochs"] // base["model"]["layers"]
    return {**base, "train": {**base["train"], "method": "retexo", "rounds_per_layer": rounds}}


def jobs_for(work: Path, name: str, ranks: int, part: str, seeds: list[int], done: set,
             evaluate: bool = True) -> list[dict]:
    """``evaluate = False``: evaluation only at the end (and at RETEXO's stage ends), for
    the runs that only measure bytes."""
    spec, base = DATASETS[name]
    graph = name.split("-")[0]                      # cora-h256 trains on cora's shards
    study.DATASETS[graph] = {**study.DATASETS.get(graph, {}), "spec": spec}      # this file's spec
    shards = study.shard_dir(work, graph, ranks, part)
    jobs = []
    for method in METHODS:
        path = work / "configs" / f"{name}-{method}.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(study.to_toml(config_for(base, method)))
        for seed in seeds:
            rid = f"{name}|{part}|{ranks}|{method}|{seed}"
            if rid not in done:
                sets = [] if evaluate else [f"train.eval_every={base['train']['epochs']}"]
                jobs.append({"id": rid, "shards": str(shards), "config": str(path), "seed": seed,
                             "sets": sets, "out": str(work / "runs" / rid.replace("|", "-"))})
    return jobs


def launch(jobs: list[dict], ranks: int, work: Path) -> None:
    """One mpiexec trains every job of one shard set in turn; then each is recorded."""
    listing = work / f"jobs-{jobs[0]['id'].replace('|', '-')}.json"
    listing.write_text(json.dumps(jobs))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), "--oversubscribe",
           sys.executable, "-m", "mpi4py", str(Path(__file__).resolve()), "batch", str(listing)]
    with open(work / "batch.log", "a") as log:
        subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                       timeout=7200, check=True)
    for job in jobs:
        record(job)


def batch(listing: str) -> None:
    """Inside mpiexec: train every job of the listing through the CLI entry point."""
    from hpcgnn.__main__ import main as hpcgnn_main
    for job in json.loads(Path(listing).read_text()):
        if (Path(job["out"]) / "summary.json").is_file():
            continue
        sets = [f"train.seed={job['seed']}", *job.get("sets", [])]
        code = hpcgnn_main(["train", "--shards", job["shards"], "--config", job["config"],
                            "--out", job["out"], "--force", *[a for x in sets for a in ("--set", x)]])
        if code:
            raise SystemExit(code)


def record(job: dict) -> None:
    s = json.loads((Path(job["out"]) / "summary.json").read_text())
    losses = [json.loads(x)["loss"] for x in (Path(job["out"]) / "metrics.jsonl").read_text().splitlines()]
    rec = {"id": job["id"], **{k: s[k] for k in ("test_acc", "best_val_acc", "bytes_sent",
                                                 "bytes_full", "allreduce_bytes")},
           "stages": s.get("stages"), "last_loss": losses[-1], "evaluated": not job.get("sets")}
    with open(RUNS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(job["id"], f"test {rec['test_acc']:.4f}", f"halo {rec['bytes_sent']:,} B", flush=True)


def run(args) -> None:
    work = Path(args.work)
    done = {json.loads(x)["id"] for x in RUNS.read_text().splitlines()} if RUNS.is_file() else set()
    names = args.datasets or list(DATASETS)
    cells = []
    if args.phase in ("acc", "all"):
        cells += [(name, 1, "metis", args.seeds, True) for name in names]
    if args.phase in ("bytes", "all"):            # evaluated every epoch: 4 METIS parts (the check)
        cells += [(name, r, p, [0], (r, p) == VERIFY) for name in names for r in BYTES_RANKS
                  for p in PARTITIONERS]
    for name, ranks, part, seeds, evaluate in cells:
        jobs = jobs_for(work, name, ranks, part, seeds, done, evaluate)
        if jobs:
            launch(jobs, ranks, work)


# -- report -----------------------------------------------------------------------------------

def load() -> dict:
    runs = {}
    for line in RUNS.read_text().splitlines():
        r = json.loads(line)
        runs[r["id"]] = r
    return runs


def _mean_sd(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.mean(xs):.1f} ± {100 * sd:.1f}"


def accuracy_table(runs: dict) -> list[str]:
    lines = ["| graph | epochs | full | RETEXO | RETEXO − full (pt) | RETEXO stage 1 alone |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, (_, base) in DATASETS.items():
        acc = {m: [r for k, r in runs.items() if k.startswith(f"{name}|metis|1|{m}|")] for m in METHODS}
        if not all(acc.values()):
            continue
        full = [r["test_acc"] for r in acc["full"]]
        rx = [r["test_acc"] for r in acc["retexo"]]
        first = [r["stages"][0]["test_acc"] for r in acc["retexo"]]
        lines.append(f"| {name} | {base['train']['epochs']} | {_mean_sd(full)} | {_mean_sd(rx)} | "
                     f"{100 * (statistics.mean(rx) - statistics.mean(full)):+.1f} | {_mean_sd(first)} |")
    return lines


def bytes_table(runs: dict) -> list[str]:
    lines = ["| graph | parts | ranks | halo MB full | halo MB RETEXO | halo: full / RETEXO | "
             "all-reduce MB full | all-reduce MB RETEXO | total: full / RETEXO | "
             "test acc vs 1 rank (full, RETEXO) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name in DATASETS:
        for ranks in BYTES_RANKS:
            for part in PARTITIONERS:
                f, x = (runs.get(f"{name}|{part}|{ranks}|{m}|0") for m in METHODS)
                f1, x1 = (runs.get(f"{name}|metis|1|{m}|0") for m in METHODS)
                if not (f and x):
                    continue
                tot_f, tot_x = f["bytes_sent"] + f["allreduce_bytes"], x["bytes_sent"] + x["allreduce_bytes"]
                same = "not evaluated" if not (f1 and x1 and f.get("evaluated")) else (
                    f"{100 * (f['test_acc'] - f1['test_acc']):+.1f}, {100 * (x['test_acc'] - x1['test_acc']):+.1f} pt")
                lines.append(f"| {name} | {part} | {ranks} | {f['bytes_sent'] / 1e6:.1f} | "
                             f"{x['bytes_sent'] / 1e6:.2f} | {f['bytes_sent'] / x['bytes_sent']:.1f}x | "
                             f"{f['allreduce_bytes'] / 1e6:.1f} | {x['allreduce_bytes'] / 1e6:.1f} | "
                             f"{tot_f / tot_x:.1f}x | {same} |")
    return lines


def report() -> None:
    runs = load()
    text = "\n".join(["Test accuracy at the best validation epoch (RETEXO: of the last stage, "
                      "i.e. the trained stack), 1 rank, mean ± std over seeds:", "",
                      *accuracy_table(runs), "",
                      "Bytes over all ranks (seed 0): halo exchange (training) and gradient "
                      "all-reduce; the last column is the test-accuracy difference to the 1-rank "
                      "run of the same seed (exact methods: 0).", "", *bytes_table(runs)]) + "\n"
    out = REPO / "bench" / "results" / "retexo.md"
    out.write_text(text)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--phase", default="all", choices=("acc", "bytes", "all"))
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--datasets", nargs="+", choices=list(DATASETS))
    r.add_argument("--work", default=str(REPO / "runs" / "retexo-study"))
    sub.add_parser("report")
    sub.add_parser("batch").add_argument("listing")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    elif args.cmd == "batch":
        batch(args.listing)
    else:
        report()


if __name__ == "__main__":
    main()
