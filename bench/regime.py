"""The regime table of the parallel algorithms: words moved and epoch time of the halo exchange,
CAGNET 1.5D (c = 2), 2D and 3D, on a METIS-parted cSBM and a randomly parted R-MAT, at P = 4, 8,
9 and 16 ranks, on shared memory and at 1 Gbit/s; and, per graph and link, which wins at each P.

    python bench/regime.py [--ranks 4 8 9 16] [--rates shm 1] [--epochs 50]
                           [--out bench/results/regime]        # needs root for the 1 Gbit/s link
    python bench/regime.py --words-only                        # bytes only: 1 epoch, shm, no timing
    python bench/regime.py --csbm SPEC --rmat SPEC ...         # other graphs (e.g. tiny ones)
    python bench/regime.py --closed-form 64 256 1024           # closed forms only, no run

Every run is ``bench/network.py``'s (``launch``: a real ``mpiexec`` training run, the link
emulated there), with its 2-layer GCN (64 hidden); each algorithm trains on the shard set it
needs (``network.part_count``: halo P parts, 1.5D P/2, 2D q, 3D q^2), and a rank count it cannot
use is skipped (2D at 8, 3D at 4, 9 and 16, 1.5D at 9). Words are 4-byte words per epoch over all
ranks, training only, forward and backward: ``counted`` is what the run's exchanges reported,
``closed form`` the formula of the algorithm's module from the shard set's ``meta.json``. Epoch
time is the median training step; ``wall`` the mean wall-clock per epoch with evaluation (the
step plus, at the last epoch, the one evaluation; ``network.summarise``). Results: ``OUT.json``
and ``OUT.md``. Run the timed table on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import network  # noqa: E402

from hpcgnn.comm.cagnet import spmm_bytes_15d  # noqa: E402
from hpcgnn.comm.cagnet2d import spmm_bytes  # noqa: E402
from hpcgnn.data.shard import read_meta  # noqa: E402
from hpcgnn.nn.layers import choose_order  # noqa: E402

GRAPHS = {"csbm-metis": (network.DEFAULT_SPEC, "metis"),
          "rmat-random": ("rmat:scale=14,edge_factor=16,features=128,classes=8,seed=1", "random")}
ALGORITHMS = ("full", "full@1.5d-c2", "full@2d", "full@3d")
HIDDEN = 64                                # network.RUN_TOML's model


def spmm_widths(meta: dict) -> list[tuple[int, bool]]:
    """(exchanged width, whether its backward runs) of each layer of network.py's GCN."""
    dims = [int(meta["feature_dim"])] + [HIDDEN] * (network.LAYERS - 1) + [int(meta["num_classes"])]
    out = []
    for layer, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        transform_first, width = choose_order(a, b, layer > 0)
        out.append((width, layer > 0 or transform_first))
    return out


def closed_form_words(name: str, shards: Path, ranks: int) -> int:
    """Words per epoch of algorithm ``name`` on this shard set and rank count (the formulas
    of ``hpcgnn.comm.cagnet`` / ``cagnet2d``; halo: 4 f bytes per halo row and exchange)."""
    meta = read_meta(shards)
    n, k = int(meta["num_nodes"]), int(meta["num_parts"])
    nnz = int(meta["num_edges"]) + n                                 # GCN: the self-loops
    halo_rows = sum(int(p["num_halo"]) for p in meta["parts"])
    alg, total = network.algorithm(name), 0
    for width, backward in spmm_widths(meta):
        for bwd in ((False, True) if backward else (False,)):
            if alg == "halo":
                total += 4 * width * halo_rows
            elif alg == "1.5d":
                c = network.method(name)[2]
                total += spmm_bytes_15d(k, c, n, width)
            else:
                q = round(ranks ** (1 / (2 if alg == "2d" else 3)))
                total += spmm_bytes(q, 1 if alg == "2d" else q, n, nnz, width, bwd)
    return total // 4


def run_one(graph: str, ranks: int, rate: str, name: str, args) -> dict | None:
    spec, partitioner = args.specs[graph]
    parts = network.part_count(name, ranks)
    if parts is None:
        return None
    root = Path(args.work) / graph
    root.mkdir(parents=True, exist_ok=True)
    config = root / "run.toml"
    config.write_text(network.RUN_TOML.format(epochs=args.epochs, seed=0, eval_every=args.epochs,
                                              layers=network.LAYERS))
    shards = network.shard_set(spec, parts, root, partitioner)
    run_dir = root / f"r{ranks}-{rate}-{name}"
    t0 = time.perf_counter()
    network.launch(ranks, shards, name, rate, run_dir, config, args.timeout, args.epochs)
    res = network.summarise(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"graph": graph, "ranks": ranks, "rate": rate, "algorithm": network.algorithm(name),
            "name": name, "parts": parts, "epoch_s": res["epoch_s"],
            "epoch_wall_s": res["epoch_wall_s"], "train_wall_s": res["train_wall_s"],
            "words_counted": statistics.mean(r["bytes_sent"] for r in rows) / 4,
            "words_closed_form": closed_form_words(name, shards, ranks),
            "test_acc": res["test_acc"], "wall_s": time.perf_counter() - t0}


def closed_forms(args) -> list[dict]:
    """Closed-form words per epoch at ``args.closed_form`` rank counts, from shard sets
    preprocessed for them (nothing trains): where the words cross over past the run sizes."""
    rows = []
    for graph in args.graphs:
        spec, partitioner = args.specs[graph]
        root = Path(args.work) / graph
        for ranks in args.closed_form:
            for name in ALGORITHMS:
                parts = network.part_count(name, ranks)
                if parts is not None:
                    shards = network.shard_set(spec, parts, root, partitioner)
                    rows.append({"graph": graph, "ranks": ranks, "parts": parts,
                                 "algorithm": network.algorithm(name),
                                 "words_closed_form": closed_form_words(name, shards, ranks)})
    return rows


def closed_form_markdown(rows: list[dict]) -> str:
    lines = ["| graph | P | algorithm | parts | words per epoch (closed form) |",
             "|---|---:|---|---:|---:|"]
    lines += [f"| {r['graph']} | {r['ranks']} | {r['algorithm']} | {r['parts']} | "
              f"{r['words_closed_form']:,} |" for r in rows]
    best = {}
    for r in rows:
        key = (r["graph"], r["ranks"])
        if key not in best or r["words_closed_form"] < best[key]["words_closed_form"]:
            best[key] = r
    lines += [""] + [f"- {g}, P={p}: fewest words {r['algorithm']}" for (g, p), r in best.items()]
    return "\n".join(lines) + "\n"


def winners(results: list[dict], timed: bool) -> list[str]:
    """Per graph and link, at each P: the fastest algorithm (timed: by step and by wall-clock
    with evaluation) and the one moving fewest words."""
    lines = []
    for graph in GRAPHS:
        for rate in dict.fromkeys(r["rate"] for r in results):
            cells = []
            for p in sorted({r["ranks"] for r in results}):
                rs = [r for r in results if (r["graph"], r["rate"], r["ranks"]) == (graph, rate, p)]
                if not rs:
                    continue
                few = min(rs, key=lambda r: r["words_counted"])["algorithm"]
                fast = min(rs, key=lambda r: r["epoch_s"])["algorithm"] if timed else "—"
                walled = [r for r in rs if r.get("epoch_wall_s") is not None]
                wall = min(walled, key=lambda r: r["epoch_wall_s"])["algorithm"] if (timed and walled) else "—"
                cells.append(f"P={p}: fastest step {fast}, wall-clock {wall}, fewest words {few}")
            if cells:
                lines.append(f"- {graph}, link {rate}: " + "; ".join(cells))
    return lines


def to_markdown(results: list[dict], args, timed: bool) -> str:
    head = (f"GCN 2 layers, {HIDDEN} hidden, {args.epochs} epoch(s); words: 4-byte words per "
            f"epoch over all ranks (training, forward + backward); epoch: the median training "
            f"step; wall: the mean wall-clock per epoch with evaluation (one, at the last epoch); "
            f"vs halo: the halo exchange's time over this one's; {os.cpu_count()} cores.")
    lines = [head, "", "| graph | P | link | algorithm | parts | words counted | closed form | "
             "epoch (ms) | vs halo | wall (ms) | vs halo |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(r: dict, halo: dict | None, key: str) -> tuple[str, str]:
        if not timed or r.get(key) is None:          # words only, or a result from before `wall`
            return "—", "—"
        vs = f"{halo[key] / r[key]:.2f}x" if halo and halo.get(key) is not None else "—"
        return f"{1e3 * r[key]:.1f}", vs

    for r in results:
        halo = next((x for x in results if x["algorithm"] == "halo" and
                     (x["graph"], x["ranks"], x["rate"]) == (r["graph"], r["ranks"], r["rate"])), None)
        step = " | ".join(cell(r, halo, "epoch_s"))
        wall = " | ".join(cell(r, halo, "epoch_wall_s"))
        lines.append(f"| {r['graph']} | {r['ranks']} | {r['rate']} | {r['algorithm']} | "
                     f"{r['parts']} | {r['words_counted']:,.0f} | {r['words_closed_form']:,} | "
                     f"{step} | {wall} |")
    return "\n".join(lines + ["", *winners(results, timed)]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 9, 16])
    ap.add_argument("--rates", nargs="+", default=["shm", "1"])
    ap.add_argument("--graphs", nargs="+", default=list(GRAPHS), choices=list(GRAPHS))
    ap.add_argument("--csbm", default=GRAPHS["csbm-metis"][0], help="the cSBM's spec (METIS parts)")
    ap.add_argument("--rmat", default=GRAPHS["rmat-random"][0], help="the R-MAT's spec (random parts)")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--words-only", action="store_true",
                    help="1 epoch on shared memory: the words columns only (no timing)")
    ap.add_argument("--closed-form", type=int, nargs="+", metavar="P",
                    help="only the closed-form words at these rank counts (preprocessing, no run)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--work", default=str(network.REPO / "runs" / "regime"))
    ap.add_argument("--out", default=str(network.REPO / "bench" / "results" / "regime"))
    args = ap.parse_args()
    args.specs = {"csbm-metis": (args.csbm, "metis"), "rmat-random": (args.rmat, "random")}
    if args.words_only:
        args.epochs, args.rates = 1, ["shm"]
        args.out += "-words"
    if args.closed_form:
        table = closed_form_markdown(closed_forms(args))
        Path(args.out + "-closed-form.md").write_text(table)
        print(table)
        return
    if os.geteuid() != 0 and any(r != "shm" for r in args.rates):
        sys.exit("bench/regime.py: the link emulation needs root (unshare -n, tc); use --rates shm")
    results = []
    for graph in args.graphs:
        for ranks in args.ranks:
            for rate in args.rates:
                for name in ALGORITHMS:
                    res = run_one(graph, ranks, rate, name, args)
                    if res is not None:
                        results.append(res)
                        print(f"{graph} P={ranks} {rate} {res['algorithm']}: "
                              f"{res['words_counted']:,.0f} words (closed form "
                              f"{res['words_closed_form']:,}), step {1e3 * res['epoch_s']:.1f} ms, "
                              f"wall {1e3 * res['epoch_wall_s']:.1f} ms", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = to_markdown(results, args, timed=not args.words_only)
    out.with_suffix(".md").write_text(table)
    out.with_suffix(".json").write_text(json.dumps({"load_average": os.getloadavg()[0],
                                                   "results": results}, indent=1))
    print(table)


if __name__ == "__main__":
    main()
