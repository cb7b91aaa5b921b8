"""Preprocessing benchmark: R-MAT (Graph500) of a given scale into METIS parts.

Times each phase (generation, METIS input, the METIS call, halo maps + writing, verify) and the
peak resident memory of each (VmHWM, reset between phases where Linux allows); reports our
overhead beyond METIS = (METIS input + halo maps + writing) / METIS call.

    python bench/preprocess.py --scale 20 --parts 16 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

# This file is named like the package it measures: keep its own folder off the import path.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from hpcgnn.data.datasets import load_dataset  # noqa: E402
from preprocess import verify_shards, write_shards  # noqa: E402
from preprocess.metis import part_kway  # noqa: E402
from preprocess.partition import metis_adjacency, metis_weights  # noqa: E402


def _peak_mib() -> float:
    """Peak RSS since the last reset (VmHWM), in MiB; falls back to ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class Phases:
    """Wall time and peak RSS of each named phase."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}

    def run(self, name: str, fn, *args, **kw):
        _reset_peak()
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        self.rows[name] = {"s": round(time.perf_counter() - t0, 2), "peak_mib": round(_peak_mib())}
        logging.info("%-14s %7.2f s  peak %6d MiB", name, self.rows[name]["s"],
                     self.rows[name]["peak_mib"])
        return out


def bench(scale: int, parts: int, edge_factor: int, features: int, out: Path) -> dict:
    ph = Phases()
    graph = ph.run("generate", load_dataset,
                   f"rmat:scale={scale},edge_factor={edge_factor},features={features}")
    csr_mib = (graph.indptr.nbytes + graph.indices.nbytes) / 2**20
    adj = ph.run("metis_input", metis_adjacency, graph)
    weights = metis_weights(graph)
    part, cut = ph.run("metis_call", part_kway, adj, parts, weights, 0)
    del adj
    ph.run("halo_write", write_shards, graph, part, out, partitioner="metis", seed=0,
           force=True, num_parts=parts)
    ph.run("verify", verify_shards, out)
    r = ph.rows
    ours = r["metis_input"]["s"] + r["halo_write"]["s"]
    return {"scale": scale, "parts": parts, "nodes": graph.num_nodes, "edges": graph.num_edges,
            "features": features, "csr_mib": round(csr_mib), "metis_edge_cut": cut,
            "phases": r, "preprocess_s": round(ours + r["metis_call"]["s"], 2),
            "overhead_vs_metis": round(ours / r["metis_call"]["s"], 3),
            "peak_rss_mib": max(row["peak_mib"] for row in r.values()),
            "shard_bytes": sum(f.stat().st_size for f in out.iterdir())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=20)
    ap.add_argument("--parts", type=int, default=16)
    ap.add_argument("--edge-factor", type=int, default=16)
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    tmp = Path(tempfile.mkdtemp(prefix="hpcgnn-bench-"))
    try:
        result = bench(args.scale, args.parts, args.edge_factor, args.features, tmp / "shards")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
