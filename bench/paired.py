"""Paired, interleaved runs: is schedule B faster or slower than schedule A on this machine?

The figures of ``bench/network.py`` move by 15-30 % between sweeps minutes apart on a shared
machine (a schedule's own step, with no code change), so one sweep cannot rank two schedules
within that. This script runs the schedules in rounds, alternating their order (A B, then B A,
...), so that a slow spell of the host falls on both of a round's runs, and reports each
schedule against the first (or each of ``--baselines``) as the per-round ratio: its geometric
mean with a 95 % confidence interval (Student's t on the log ratios), the median and the range,
and in how many rounds it was below 1. Every run is ``bench/network.py``'s ``launch`` (a real ``mpiexec`` training run
behind the emulated link) with its ``summarise``.

    python bench/paired.py --ranks 4 --rate 1 --schedules full quant1-all quant1-all@s1 \\
        [--baselines full quant1-all] [--rounds 8] [--epochs 100] [--eval-every 2] [--seed 0] \\
        [--seeds-vary] [--work /tmp/paired] [--out bench/results/paired]

Ratios of the figures: ``step`` (the median training step, ``epoch_s``), ``wall`` (the mean
wall-clock per epoch with evaluation), ``rss`` (the largest rank's peak resident memory) and,
where ``full`` (or, without it, a variant ``full@OPTS``) is one of the schedules, ``tta`` (the
training time until validation accuracy reaches that round's full-communication best less
0.5 pt) and ``tta_wall`` (the same in
wall-clock with evaluation). ``--seeds-vary`` gives round ``i`` the training seed ``seed + i``
(every schedule of the round the same one), so that the time-to-accuracy ratios average over
seeds as well. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path


def _sibling(name: str):
    """``bench/NAME.py`` as a module, without putting ``bench/`` on ``sys.path`` (its
    ``preprocess.py`` would shadow the package of that name for whoever imports this)."""
    import importlib.util
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


network = _sibling("network")

FIGURES = ("step", "wall", "rss", "tta", "tta_wall")


def ratio_stats(ratios: list[float]) -> dict | None:
    """Geometric mean of ``ratios`` with its 95 % t interval, median, range, rounds below 1."""
    ratios = [r for r in ratios if r is not None and r > 0]
    if not ratios:
        return None
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    out = {"n": len(ratios), "geomean": math.exp(mean), "median": statistics.median(ratios),
           "min": min(ratios), "max": max(ratios), "below_1": sum(r < 1 for r in ratios)}
    if len(logs) > 1:
        from scipy.stats import t
        half = t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        out["ci95"] = [math.exp(mean - half), math.exp(mean + half)]
    return out


def run_rounds(args) -> list[dict]:
    """``args.rounds`` rounds of every schedule, the order reversed every other round; per round
    {schedule: summary}."""
    root = Path(args.work)
    root.mkdir(parents=True, exist_ok=True)
    rounds = []
    for i in range(args.rounds):
        seed = args.seed + i if args.seeds_vary else args.seed
        config = root / f"run-{seed}.toml"
        config.write_text(network.RUN_TOML.format(epochs=args.epochs, seed=seed,
                                                  eval_every=args.eval_every, layers=network.LAYERS))
        order = args.schedules if i % 2 == 0 else args.schedules[::-1]
        got = {}
        for sched in order:
            parts = network.part_count(sched.partition("~")[0], args.ranks)
            if parts is None:
                raise SystemExit(f"bench/paired.py: {sched} cannot run on {args.ranks} ranks")
            shards = network.shard_set(args.dataset, parts, root, args.partitioner)
            run_dir = root / f"r{args.ranks}-{args.rate}-{sched}"
            t0 = time.perf_counter()
            network.launch(args.ranks, shards, sched, args.rate, run_dir, config, args.timeout,
                           args.epochs)
            res = network.summarise(run_dir)
            res["run_s"] = time.perf_counter() - t0
            res["seed"] = seed
            got[sched] = res
            print(f"round {i} seed {seed} {sched}: step {1e3 * res['epoch_s']:.1f} ms, wall "
                  f"{1e3 * res['epoch_wall_s']:.1f} ms, test {res['test_acc']:.4f}", flush=True)
        ref = accuracy_reference(list(got))
        if ref is not None:                     # time to full communication's accuracy, this round
            target = got[ref]["best_val"] - 0.005
            for res in got.values():
                res["tta_s"] = network.time_to(res["curve"], target)
                res["tta_wall_s"] = network.time_to(res["curve"], target, wall=True)
        add_vs_max(got, args.rate)
        rounds.append(got)
    return rounds


def accuracy_reference(schedules: list[str]) -> str | None:
    """The run whose best validation accuracy (less 0.5 pt) is the round's target: ``full``,
    else the first full-communication variant (``full@OPTS``, e.g. ``full@keep``: the same
    model), else none (no time-to-accuracy figures)."""
    if "full" in schedules:
        return "full"
    return next((s for s in schedules if s.startswith("full@")), None)


def add_vs_max(got: dict, rate: str) -> None:
    """Per run of one round that sends over a rated link: its step against ``max(compute,
    wire)`` (``bench/network.py``'s ``vs_max``), compute being the round's synchronous floor
    (``floor``) plus the run's own codec, for a stale schedule also its stale floor
    (``floor@sN``, ``vs_max_stale``), and the same schedule's step without the rate limit
    (``SCHEDULE~unlimited``: its bytes cross the loopback at memory speed, so the CPU the sockets
    take on the ranks' cores is in it; ``vs_max_tcp``), where those ran in the round."""
    for sched, res in got.items():
        unrated = network.is_floor(sched) or network.is_unlimited(sched)
        wire = None if unrated else network.wire_s(res, rate)
        if wire is None:
            continue
        res["wire_s"] = wire
        for key, floor in (("vs_max", "floor"), ("vs_max_stale", network.stale_floor(sched))):
            if floor in got:
                compute = got[floor]["epoch_s"] + res.get("codec_s", 0.0)
                res[key] = res["epoch_s"] / max(compute, wire)
        reference = got.get(network.unlimited_of(sched))
        if reference is not None:
            res["vs_max_tcp"] = res["epoch_s"] / max(reference["epoch_s"], wire)


def compare(rounds: list[dict], schedules: list[str], base: str | None = None) -> dict:
    """Every other schedule against ``base`` (default: the first): per-figure ratio
    statistics."""
    key = {"step": "epoch_s", "wall": "epoch_wall_s", "rss": "peak_rss_bytes", "tta": "tta_s",
           "tta_wall": "tta_wall_s"}
    base, out = base or schedules[0], {}
    figures = [f for f in FIGURES if accuracy_reference(schedules) or not f.startswith("tta")]
    for sched in (s for s in schedules if s != base):
        out[sched] = {}
        for fig in figures:
            ratios = []
            for rnd in rounds:
                a, b = rnd[base].get(key[fig]), rnd[sched].get(key[fig])
                ratios.append(b / a if a and b else None)
            out[sched][fig] = ratio_stats(ratios)
            out[sched][fig + "_never"] = sum(r is None for r in ratios) if fig.startswith("tta") else 0
    return out


def _cell(st: dict | None) -> str:
    if st is None:
        return "—"
    ci = f" [{st['ci95'][0]:.3f}, {st['ci95'][1]:.3f}]" if "ci95" in st else ""
    return (f"{st['geomean']:.3f}{ci}; median {st['median']:.3f}, {st['min']:.2f}-{st['max']:.2f}, "
            f"below 1 in {st['below_1']}/{st['n']}")


def to_markdown(rounds: list[dict], stats: dict[str, dict], args) -> str:
    """The per-round table, then one table of ratios per baseline (``stats``: baseline ->
    ``compare``'s result)."""
    sch = args.schedules
    lines = [f"`{args.dataset}`, {args.partitioner} parts, {args.ranks} ranks, link `{args.rate}`, "
             f"GCN {network.LAYERS} x 64, {args.epochs} epochs, evaluation every {args.eval_every}; "
             f"{len(rounds)} rounds, order alternating; seeds "
             f"{'varying by round' if args.seeds_vary else args.seed}; {os.cpu_count()} cores.", "",
             "Per round: median step / mean wall-clock per epoch with evaluation (ms).", "",
             "| round | seed | " + " | ".join(sch) + " |", "|---:|---:|" + "---:|" * len(sch)]
    for i, rnd in enumerate(rounds):
        cells = [f"{1e3 * rnd[s]['epoch_s']:.1f} / {1e3 * rnd[s]['epoch_wall_s']:.1f}" for s in sch]
        lines.append(f"| {i} | {rnd[sch[0]]['seed']} | " + " | ".join(cells) + " |")
    for key, what in (("vs_max", "the synchronous floor of the round plus the run's codec"),
                      ("vs_max_stale", "the stale floor of the round plus the run's codec"),
                      ("vs_max_tcp", "the same schedule's step without the rate limit "
                                     "(`~unlimited`: the compute, the codec and the sockets' CPU)")):
        runs = [s for s in sch if any(key in rnd[s] for rnd in rounds)]
        if runs:
            lines += ["", f"Step against max(compute, wire), compute = {what}: geometric mean "
                      "over rounds [95 % CI]; median, range, rounds below 1.", "",
                      "| schedule | wire (ms, mean) | step / max |", "|---|---:|---|"]
            for s in runs:
                wire = statistics.fmean(rnd[s]["wire_s"] for rnd in rounds)
                lines.append(f"| {s} | {1e3 * wire:.1f} | "
                             f"{_cell(ratio_stats([rnd[s].get(key) for rnd in rounds]))} |")
    for base, against in stats.items():
        lines += ["", f"Against `{base}`: geometric mean of the per-round ratios [95 % CI]; "
                  "median, range, rounds in which it was below 1 (faster, or smaller).", "",
                  "| schedule | figure | ratio |", "|---|---|---|"]
        for sched, figs in against.items():
            for fig in (f for f in FIGURES if f in figs):
                never = figs.get(fig + "_never")
                if figs[fig] is None and not never:
                    continue
                note = (f" (no ratio in {never} rounds: it or the baseline never reached the "
                        f"target)" if never else "")
                lines.append(f"| {sched} | {fig} | {_cell(figs[fig])}{note} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default=network.DEFAULT_SPEC)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rate", default="1", help="Gbit/s, 'none' (TCP, unlimited) or 'shm'")
    ap.add_argument("--schedules", nargs="+", required=True,
                    help="the first is the baseline; names as bench/network.py's")
    ap.add_argument("--baselines", nargs="+", default=None,
                    help="schedules the others are set against (default: the first)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--partitioner", default="random", choices=("random", "metis"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds-vary", action="store_true", help="round i trains with seed + i")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--work", default=str(network.REPO / "runs" / "paired"))
    ap.add_argument("--out", default=str(network.REPO / "bench" / "results" / "paired"))
    args = ap.parse_args()
    if len(args.schedules) < 2 or len(set(args.schedules)) != len(args.schedules):
        ap.error("--schedules: at least two, each once")
    args.baselines = args.baselines or args.schedules[:1]
    if not set(args.baselines) <= set(args.schedules):
        ap.error("--baselines: each must be one of --schedules")
    if args.rounds < 2:
        ap.error("--rounds: at least 2 (one ratio has no interval)")
    if os.geteuid() != 0 and args.rate != "shm":
        sys.exit("bench/paired.py: the link emulation needs root (unshare -n, tc); use --rate shm")
    rounds = run_rounds(args)
    stats = {base: compare(rounds, args.schedules, base) for base in args.baselines}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = to_markdown(rounds, stats, args)
    out.with_name(out.name + ".md").write_text(table)
    slim = [{s: {k: v for k, v in r.items() if k != "curve"} for s, r in rnd.items()} for rnd in rounds]
    out.with_name(out.name + ".json").write_text(json.dumps({"args": vars(args), "rounds": slim, "stats": stats,
                                                   "load_average": os.getloadavg()[0]}, indent=1))
    print(table)


if __name__ == "__main__":
    main()
