"""Stale runs' wire figures in paired rounds measured before a step's bytes were recorded.

Until ``e83ffbd`` (2026-11-28) ``bench/network.py`` took a run's wire time from the mean bytes
over every epoch. A stale run's epoch 0 also sends the first layer's input rows, once (fp32),
so its wire time was overstated against its median step (epochs 1 on): by 2.5 % for fp32 rows
and 12 % for 4-bit rows over 60 epochs, 19 % for 1-bit rows over 100. This recomputes, from a
``bench/paired.py`` JSON, each stale run's wire from a step's bytes (``netmodel.step_bytes``:
the synchronous run of the same schedule in the same round, scaled by the row bytes of the two
steps) and its step against ``max(stale floor + codec, wire)``, beside the figures as reported:

    python bench/stale_wire.py bench/results/paired-agree-2r-2g-2core-2026-11-27.json [...]

Rounds without the synchronous run or the stale floor give no figure.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))


def _module(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


netmodel, paired = _module("netmodel"), _module("paired")


def restate(path: Path) -> list[dict]:
    """Per stale schedule of a paired JSON over a rated link: the bytes' overstatement and the
    step against max(stale floor + codec, wire), as reported and from a step's bytes."""
    data = json.loads(Path(path).read_text())
    ranks, rate = data["args"]["ranks"], data["args"]["rate"]
    rows = []
    if rate in ("shm", "none"):
        return rows
    names = [s for s in data["rounds"][0] if "@s" in s and "~" not in s and not s.startswith("floor")]
    for s in names:
        over, before, after = [], [], []
        for rnd in data["rounds"]:
            run, floor = rnd[s], rnd.get("floor@" + s.partition("@")[2])
            nbytes = netmodel.step_bytes(f"{ranks}|{rate}|{s}", run,
                                         {f"{ranks}|{rate}|{k}": v for k, v in rnd.items()})
            if nbytes is None or floor is None:
                continue
            wire = netmodel.wire_time(nbytes, float(rate), 1.0)      # at the nominal rate
            compute = floor["epoch_s"] + run.get("codec_s", 0.0)
            over.append(run["bytes_per_epoch"] / nbytes)
            before.append(run["epoch_s"] / max(compute, netmodel.wire_time(run["bytes_per_epoch"], float(rate), 1.0)))
            after.append(run["epoch_s"] / max(compute, wire))
        if after:
            rows.append({"file": Path(path).name, "schedule": s, "ranks": ranks, "rate": rate,
                         "overstated": sum(over) / len(over), "wire_s": wire,
                         "before": paired.ratio_stats(before), "after": paired.ratio_stats(after)})
    return rows


def _cell(st: dict) -> str:
    ci = f" [{st['ci95'][0]:.3f}, {st['ci95'][1]:.3f}]" if "ci95" in st else ""
    return f"{st['geomean']:.3f}x{ci} ({st['n']})"


def main() -> None:
    lines = ["| report | ranks, link | schedule | bytes as reported / a step's | step / max, as reported "
             "| step / max, a step's bytes |", "|---|---|---|---:|---|---|"]
    for p in sys.argv[1:]:
        for r in restate(Path(p)):
            lines.append(f"| {r['file']} | {r['ranks']}, {r['rate']} Gbit/s | {r['schedule']} | "
                         f"{r['overstated']:.3f} | {_cell(r['before'])} | {_cell(r['after'])} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
