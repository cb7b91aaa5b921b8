"""Distributed preprocessing benchmark: peak RSS per rank, edge cut and wall time of
``--partitioner ptscotch`` on P ranks, against the one-process METIS path on the same graph.

    # P ranks (each generates its rows of the sliced R-MAT; PT-Scotch across the ranks)
    mpirun -n 4 python -m mpi4py bench/preprocess_dist.py --scale 21 --parts 16
    # the one-process METIS path on the same graph (no mpirun)
    python bench/preprocess_dist.py --scale 21 --parts 16 --one-process

Prints one JSON object (rank 0): peak RSS of every rank (``ru_maxrss``, MiB), wall time, the
``meta.json`` edge cut. ``--dataset SPEC`` replaces the R-MAT (e.g. ``h5:FILE``).
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

# This folder holds a preprocess.py: keep it off the import path (the package comes first).
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _one_process(spec: str, parts: int, out: Path) -> dict:
    from hpcgnn.data.datasets import load_dataset
    from preprocess import partition_graph, write_shards
    t0 = time.perf_counter()
    graph = load_dataset(spec)
    meta = write_shards(graph, partition_graph(graph, parts, "metis"), out, partitioner="metis",
                        seed=0, force=True, num_parts=parts)
    return {"ranks": 1, "path": "one-process metis", "wall_s": round(time.perf_counter() - t0, 1),
            "peak_rss_mib": [round(_peak_mib())], "edge_cut": meta["edge_cut"],
            "num_edges": meta["num_edges"]}


def _distributed(spec: str, parts: int, out: Path, partitioner: str) -> dict | None:
    from mpi4py import MPI

    from preprocess.dist_run import run_distributed
    comm = MPI.COMM_WORLD
    comm.Barrier()
    t0 = time.perf_counter()
    meta = run_distributed(comm, spec, parts, partitioner, str(out), 0, True, False)
    wall = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    peaks = comm.gather(round(_peak_mib()), root=0)
    if comm.rank:
        return None
    return {"ranks": comm.size, "path": f"distributed {partitioner}", "wall_s": round(wall, 1),
            "peak_rss_mib": peaks, "edge_cut": meta["edge_cut"], "num_edges": meta["num_edges"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=20)
    ap.add_argument("--parts", type=int, default=16)
    ap.add_argument("--dataset", help="instead of rmat-sliced:scale=S")
    ap.add_argument("--partitioner", default="ptscotch", choices=("ptscotch", "random"))
    ap.add_argument("--one-process", action="store_true", help="the one-process METIS path")
    ap.add_argument("--out", type=Path, help="shard directory (default: a temporary one)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    spec = args.dataset or f"rmat-sliced:scale={args.scale}"
    tmp = Path(tempfile.mkdtemp(prefix="hpcgnn-bench-"))
    if not args.one_process:                        # every rank writes into rank 0's folder
        from mpi4py import MPI
        shutil.rmtree(tmp, ignore_errors=True)
        tmp = Path(MPI.COMM_WORLD.bcast(str(tmp) if MPI.COMM_WORLD.rank == 0 else None))
        tmp.mkdir(exist_ok=True)
    out = args.out or tmp / "shards"
    try:
        result = (_one_process(spec, args.parts, out) if args.one_process
                  else _distributed(spec, args.parts, out, args.partitioner))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if result is not None:
        result.update(dataset=spec, parts=args.parts, max_peak_rss_mib=max(result["peak_rss_mib"]))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
