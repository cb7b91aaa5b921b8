"""Exchange overhead at many ranks: a tiny graph, so every epoch is overhead, not arithmetic.

Trains a 2-layer GCN (8 hidden) on a small cSBM cut into P METIS parts, through the stable CLI
(``mpiexec -n P python -m mpi4py -m hpcgnn train``), and reads the median training-step time
and the time in MPI calls per epoch from ``metrics.jsonl``. ``--tree DIR`` runs another source
tree of hpcgnn with this venv (``PYTHONPATH=DIR``), so the same measurement can be taken on an
older commit, e.g. before the sparse-peer transport::

    git worktree add /tmp/before e0a037b
    python bench/exchange_overhead.py --ranks 16 32 64 --tree /tmp/before --label before
    python bench/exchange_overhead.py --ranks 16 32 64 --modes alltoallv neighbor --label after

Each epoch runs 2 forward + 1 backward halo exchanges and one gradient Allreduce. The ranks
are oversubscribed on this 2-core machine (P processes share 2 cores), so the figures are
upper bounds of what a rank's own CPU time per exchange is; compare rows of one run only.
Results are appended to ``OUT.jsonl`` and tabulated in ``OUT.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEC = "csbm:nodes={n},classes=4,degree=6,features=8,seed=1"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMP_NUM_THREADS": "1"}


def shard_set(ranks: int, work: Path) -> Path:
    out = work / f"shards-{ranks}"
    if not (out / "meta.json").is_file():
        subprocess.run([sys.executable, "-m", "preprocess", "--dataset", SPEC.format(n=100 * ranks),
                        "--parts", str(ranks), "--partitioner", "metis", "--out", str(out),
                        "--force", "-q"], check=True, cwd=REPO)
    return out


def run(ranks: int, tree: Path, mode: str | None, epochs: int, work: Path) -> dict:
    out = work / f"run-{ranks}-{tree.name}-{mode}"
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), "--oversubscribe",
           sys.executable, "-m", "mpi4py", "-m", "hpcgnn", "train", "--shards",
           str(shard_set(ranks, work)), "--out", str(out), "--force", "--device", "cpu",
           "--set", "model.hidden=8", "--set", f"train.epochs={epochs}",
           "--set", f"train.eval_every={epochs}"]
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": str(tree)}
    if mode:
        env["HPCGNN_EXCHANGE"] = mode
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    return {"ranks": ranks, "mode": mode or "default", "wall_s": wall,
            "epoch_ms": 1e3 * statistics.median(r["epoch_s"] for r in rows),
            "comm_ms": 1e3 * statistics.median(r["comm_s"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--tree", type=Path, default=REPO, help="hpcgnn source tree to run")
    ap.add_argument("--label", default="after")
    ap.add_argument("--modes", nargs="+", default=[""], help="HPCGNN_EXCHANGE values ('' = default)")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hpcgnn-exchange-overhead"))
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/exchange-overhead")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".jsonl"), "a") as f:
        for ranks in args.ranks:
            for mode in args.modes:
                row = {"label": args.label, **run(ranks, args.tree.resolve(), mode or None,
                                                  args.epochs, args.work)}
                print(json.dumps(row), flush=True)
                f.write(json.dumps(row) + "\n")
    rows = [json.loads(x) for x in args.out.with_suffix(".jsonl").read_text().splitlines()]
    lines = ["| code | ranks | exchange | median step (ms) | in MPI calls (ms) | job wall (s) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['ranks']} | {r['mode']} | {r['epoch_ms']:.1f} | "
              f"{r['comm_ms']:.1f} | {r['wall_s']:.0f} |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
