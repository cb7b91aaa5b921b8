"""Does a posted ``Ialltoallv`` cross the link while the ranks compute? A probe of Open MPI's
TCP path alone, without the training around it.

    python bench/overlap.py [--ranks 2] [--rate 2] [--mb 5] [--chunks 20] [--every 0 1 3 6 9]
                            [--reps 5] [--variant default eager deep]

Behind the emulated link of ``bench/network.py`` (``--rate`` Gbit/s on a token bucket in a
network namespace; needs root), every rank posts ``--mb`` MB to each peer, computes
``--chunks`` chunks of float32 matrix products (about 2 ms each here) with an ``MPI_Test``
after every ``--every``-th chunk (0: none), then waits. Per setting: the compute alone (the
longest rank), the end (compute plus what was left of the transfer), the transfer alone (a
blocking ``Alltoallv`` of the same bytes) and in how many rank-repetitions the transfer had
finished at a test. Variants: Open MPI's defaults, ``eager`` (8 MiB eager limit and fragment:
no rendezvous), ``deep`` (64 fragments in flight instead of 3 sent and 4 received).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# bench/network.py as a module, without putting bench/ on sys.path (as bench/paired.py does)
_SPEC = importlib.util.spec_from_file_location("bench_network", Path(__file__).resolve().parent / "network.py")
network = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(network)

VARIANTS = {"default": {}, "eager": network.PROGRESS_ENV["eager"], "deep": network.PROGRESS_ENV["deep"]}


def rank_main(mb: float, chunks: int, every: int, reps: int) -> None:
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    r, p = comm.rank, comm.size
    n = int(mb * 1e6 / 4)
    send, recv = np.ones(n * p, np.float32), np.empty(n * p, np.float32)
    counts = [0 if q == r else n for q in range(p)]
    displs = [q * n for q in range(p)]
    spec = ([send, counts, displs, MPI.FLOAT], [recv, counts, displs, MPI.FLOAT])
    a = np.random.default_rng(r).random((256, 256), dtype=np.float32)

    def chunk():
        for _ in range(4):
            a @ a

    t0 = time.perf_counter()
    for _ in range(20):
        chunk()
    chunk_s = (time.perf_counter() - t0) / 20
    runs = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        req, done = comm.Ialltoallv(*spec), None
        for c in range(chunks):
            chunk()
            if every and (c + 1) % every == 0 and done is None and req.Test():
                done = time.perf_counter() - t0
        compute = time.perf_counter() - t0
        if done is None:
            req.Wait()
        runs.append((compute, time.perf_counter() - t0, done))
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(3):
        comm.Alltoallv(*spec)
    wire = (time.perf_counter() - t0) / 3
    got = comm.gather((runs, wire, chunk_s))
    if r == 0:
        med = statistics.median
        print(json.dumps({
            "mb_per_peer": mb, "chunks": chunks, "every": every,
            "chunk_ms": 1e3 * med(g[2] for g in got),
            "compute_ms": 1e3 * med(max(g[0][i][0] for g in got) for i in range(reps)),
            "end_ms": 1e3 * med(max(g[0][i][1] for g in got) for i in range(reps)),
            "transfer_alone_ms": 1e3 * max(g[1] for g in got),
            "finished_at_a_test": sum(x[2] is not None for g in got for x in g[0]),
            "of": reps * len(got)}), flush=True)


def launch(args, every: int, variant: str) -> dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    inner = [str(mpiexec), "-n", str(args.ranks), "--oversubscribe", sys.executable, __file__,
             "--rank", str(args.mb), str(args.chunks), str(every), str(args.reps)]
    cmd = network.behind_link(inner, args.rate)
    env = {**os.environ, **network.MPI_ENV, **network.TCP_ENV, **VARIANTS[variant]}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"bench/overlap.py: {variant}, every {every}: failed\n{proc.stderr[-2000:]}")
    return {"variant": variant, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rate", default="2", help="Gbit/s")
    ap.add_argument("--mb", type=float, default=5.0, help="MB to each peer")
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--every", type=int, nargs="+", default=[0, 1, 3, 6, 9])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variant", nargs="+", default=["default", "eager"], choices=sorted(VARIANTS))
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/overlap.py: the link emulation needs root (unshare -n, tc)")
    rows = []
    for variant in args.variant:
        for every in args.every:
            rows.append(launch(args, every, variant))
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"{args.ranks} ranks, {args.rate} Gbit/s, {args.mb:g} MB to each peer, {args.chunks} "
             f"chunks of compute, {args.reps} repetitions (medians); {os.cpu_count()} cores.", "",
             "| variant | test every (chunks) | chunk (ms) | compute (ms) | end (ms) | transfer alone (ms) | finished at a test |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['every'] or 'never'} | {r['chunk_ms']:.2f} | "
                     f"{r['compute_ms']:.1f} | {r['end_ms']:.1f} | {r['transfer_alone_ms']:.1f} | "
                     f"{r['finished_at_a_test']}/{r['of']} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        out = Path(args.out)
        out.with_name(out.name + ".md").write_text(table)
        out.with_name(out.name + ".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
