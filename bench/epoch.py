"""Epoch time and memory of full-graph training: hpcgnn at 1 and 2 ranks (overlap on/off)
and PyTorch Geometric's full-graph SAGEConv on one process, in the same run.

    python bench/epoch.py [--dataset SPEC] [--epochs 5] [--dropout 0.5] [--skip-pyg]

Default graph: a contextual SBM of 1M nodes and ~20M directed edges, 128 features; model:
3-layer GraphSAGE (mean), 128 hidden; Adam; one thread per process (``OMP_NUM_THREADS=1``).
Every configuration runs in its own process (``mpiexec`` for hpcgnn, plain python for PyG);
peak memory is the process's peak resident set during training (VmHWM after a reset once the
data is loaded); epoch time is the median training step (forward + backward + gradient
allreduce + Adam), evaluation excluded; *with evaluation* is the median wall-clock of the
same epochs with one evaluation each (as ``train.eval_every = 1``: a forward without dropout
and the train/val/test accuracies, timed after the step); CPU s is the process CPU time of
the steps (the slowest rank's), which shows the work per rank even when other jobs share the
cores.
Results: ``bench/results/epoch.json`` and ``bench/results/epoch.md``. The hpcgnn ranks set the
allocators as ``hpcgnn train`` does (``HPCGNN_MALLOC``, ``hpcgnn.memory``: ``tuned`` unless the
environment says ``heap`` or ``system``); PyG's process runs with glibc's and torch's defaults,
as a PyG user's does.
``--arch gat``: 3 GAT layers (4 heads of 32, ELU, one output head, attention dropout = dropout)
against PyG's ``GATConv`` on ``edge_index`` (the only input it takes for attention).
For SAGE, PyG is given the adjacency as a torch CSR ``adj_t`` (its sparse-matmul path); its
``edge_index`` path materialises a message per edge (20M x 128 floats = 10 GB per layer)
and is only run with ``--pyg-edge-index``.
On CUDA each configuration also reports its kernel launches per epoch (torch profiler, one extra
epoch, not timed), the driver measures the device's copy bandwidth in the same run, and
``--torch-path`` adds a 1-rank run with ``HPCGNN_TRITON=0`` (the torch hash dropout and codecs
instead of the fused Triton kernels).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hpcgnn
# gpu_meter imports torch: each function imports it after ``memory.configure()`` has run (torch
# reads THP_MEM_ALLOC_ENABLE once, at its first allocation)
RESULTS = REPO / "bench" / "results"
DEFAULT_SPEC = "csbm:nodes=1000000,classes=8,degree=20,homophily=0.8,features=128,seed=0"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMP_NUM_THREADS": "1"}


# -- measurement helpers (run inside the measured process) -----------------------------------

def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the peak covers training only."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


# -- hpcgnn (under mpiexec) ------------------------------------------------------------------

GAT_HEADS = 4          # --arch gat: 3 GAT layers, 4 heads of 32 (concatenated: 128), 1 output head


def model_keys(args) -> dict:
    if args.arch == "gat":
        return {"arch": "gat", "layers": 3, "hidden": 128 // GAT_HEADS, "heads": GAT_HEADS,
                "out_heads": 1, "dropout": args.dropout, "attn_dropout": args.dropout}
    return {"arch": args.arch, "layers": 3, "hidden": 128, "dropout": args.dropout}


def run_ours(args) -> None:
    from hpcgnn import memory
    malloc = memory.configure()                  # as ``hpcgnn train`` does, before torch
    import torch
    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import build_config
    from hpcgnn.train.build import prepare_trainer
    ctx = CommContext.from_world(args.device)
    # epochs more than are run, so none run (launch counts and profile included) evaluates
    cfg = build_config({"model": model_keys(args),
                        "train": {"epochs": args.epochs + 5, "eval_every": 10**6,
                                  "overlap": bool(args.overlap)},
                        "run": {"out": args.out}}, "bench/epoch.py")
    from hpcgnn.train.launch import load_policy
    trainer = prepare_trainer(ctx, cfg, args.shards, args.out, load_policy(args.schedule))
    trainer.start()
    reset_peak_rss()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    steps, cpu, walls = [], [], []
    for epoch in range(args.epochs):
        c0 = time.process_time()
        rec, _ = trainer.run_epoch(epoch)
        cpu.append(time.process_time() - c0)
        t0 = time.perf_counter()
        trainer.evaluate(epoch)                  # every rank: what eval_every = 1 adds to the epoch
        walls.append(rec["wall_s"] + time.perf_counter() - t0)
        steps.append(rec)
    if args.profile and ctx.is_root:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            trainer.run_epoch(args.epochs)
        key = "self_cuda_time_total" if ctx.device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=15), file=sys.stderr, flush=True)
    elif args.profile:
        trainer.run_epoch(args.epochs)
    from gpu_meter import launches
    n_launch = launches(lambda: trainer.run_epoch(args.epochs + 1), ctx.device)   # every rank
    peak = ctx.comm.allreduce(peak_rss_gib(), op=__import__("mpi4py.MPI").MPI.MAX)
    gpu_peak = ctx.comm.allreduce(torch.cuda.max_memory_allocated(ctx.device) / 2**30
                                  if ctx.device.type == "cuda" else 0.0,
                                  op=__import__("mpi4py.MPI").MPI.MAX)
    cpu_s = ctx.comm.allreduce(statistics.median(cpu[1:] or cpu), op=__import__("mpi4py.MPI").MPI.MAX)
    if ctx.is_root:
        timed = steps[1:] or steps                            # the first epoch warms up
        print(json.dumps({"epoch_s": statistics.median(r["epoch_s"] for r in timed),
                          "epoch_wall_s": statistics.median(walls[1:] or walls),
                          "cpu_s": cpu_s,
                          "comm_share": statistics.median(r["comm_s"] / r["epoch_s"] for r in timed),
                          "bytes_per_epoch": steps[-1]["bytes_sent"], "peak_rss_gib": peak,
                          "gpu_peak_gib": gpu_peak, "device": str(ctx.device),
                          "launches_per_epoch": n_launch, "malloc": malloc,
                          "loss": [r["loss"] for r in steps]}), flush=True)


# -- PyTorch Geometric (one process) ---------------------------------------------------------

def run_pyg(args) -> None:
    import numpy as np
    from gpu_meter import launches
    import torch
    import torch.nn.functional as F
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv
    from hpcgnn.data.datasets import load_dataset
    torch.manual_seed(0)
    g = load_dataset(args.dataset)
    x = torch.from_numpy(g.dense_features())
    y = torch.from_numpy(g.labels)
    train = torch.from_numpy(g.train_idx)
    val, test = torch.from_numpy(g.val_idx), torch.from_numpy(g.test_idx)
    if args.pyg_edge_index or args.arch == "gat":            # GATConv takes edge_index only
        rows = np.repeat(np.arange(g.num_nodes), np.diff(g.indptr))
        adj = torch.from_numpy(np.stack([g.indices, rows]))     # (source, target)
    else:
        adj = torch.sparse_csr_tensor(torch.from_numpy(g.indptr), torch.from_numpy(g.indices),
                                      torch.ones(g.num_edges), size=(g.num_nodes, g.num_nodes))
    del g
    dev = torch.device(args.device if args.device != "auto" else
                       ("cuda" if torch.cuda.is_available() else "cpu"))
    x, y, train, val, test, adj = x.to(dev), y.to(dev), train.to(dev), val.to(dev), test.to(dev), adj.to(dev)
    dims = [x.shape[1], 128, 128, int(y.max()) + 1]
    if args.arch == "gat":     # as hpcgnn's: concatenated hidden heads, ELU, one output head
        h = GAT_HEADS
        convs = torch.nn.ModuleList([GATConv(dims[0], 128 // h, heads=h, dropout=args.dropout),
                                     GATConv(128, 128 // h, heads=h, dropout=args.dropout),
                                     GATConv(128, dims[-1], heads=1, concat=False, dropout=args.dropout)])
    elif args.arch == "gcn":   # the symmetric normalisation with self-loops, computed once
        convs = torch.nn.ModuleList(GCNConv(a, b, cached=True) for a, b in zip(dims[:-1], dims[1:]))
    else:
        convs = torch.nn.ModuleList(SAGEConv(a, b, aggr="mean") for a, b in zip(dims[:-1], dims[1:]))
    act = F.elu if args.arch == "gat" else F.relu
    convs = convs.to(dev)
    opt = torch.optim.Adam(convs.parameters(), lr=0.01, weight_decay=5e-4)
    reset_peak_rss()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times, cpu = [], []

    def step():
        h = x
        for i, conv in enumerate(convs):
            h = conv(F.dropout(h, args.dropout, training=True), adj)
            h = act(h) if i < len(convs) - 1 else h
        loss = F.cross_entropy(h[train], y[train])
        opt.zero_grad()
        loss.backward()
        opt.step()
    @torch.no_grad()
    def evaluate():                              # as hpcgnn's: no dropout, train/val/test accuracy
        h = x
        for i, conv in enumerate(convs):
            h = conv(h, adj)
            h = act(h) if i < len(convs) - 1 else h
        pred = h.argmax(dim=1)
        return [float((pred[idx] == y[idx]).float().mean()) for idx in (train, val, test)]

    walls = []
    for _ in range(args.epochs):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        sync()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        convs.eval()
        evaluate()                               # float() waits for the device
        convs.train()
        walls.append(time.perf_counter() - t0)
    print(json.dumps({"epoch_s": statistics.median(times[1:] or times), "comm_share": 0.0,
                      "epoch_wall_s": statistics.median(walls[1:] or walls),
                      "cpu_s": statistics.median(cpu[1:] or cpu),
                      "peak_rss_gib": peak_rss_gib(), "device": str(dev),
                      "launches_per_epoch": launches(step, dev),
                      "gpu_peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30
                      if dev.type == "cuda" else 0.0}), flush=True)


# -- the driver ------------------------------------------------------------------------------

def shard_set(spec: str, parts: int, root: Path, partitioner: str = "metis") -> Path:
    """Partition once, reused on later runs."""
    out = root / f"{parts}"
    if not (out / "meta.json").is_file():
        subprocess.run([sys.executable, "-m", "preprocess", "--dataset", spec, "--parts", str(parts),
                        "--partitioner", partitioner, "--out", str(out), "--force", "-q"], check=True)
    return out


def child(cmd: list[str], timeout: float = 3600, env: dict | None = None) -> dict:
    env = {**os.environ, **MPI_ENV, **(env or {})}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if "--profile" in cmd:
        print(proc.stderr[-6000:], flush=True)
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1]), "wall_s": time.perf_counter() - t0}


def drive(args) -> None:
    import torch
    from gpu_meter import copy_bandwidth
    args.copy_GB_per_s = copy_bandwidth("cuda" if args.device == "auto" and torch.cuda.is_available()
                                        else "cpu" if args.device == "auto" else args.device) / 1e9
    root = Path(args.shards_root)
    me = [sys.executable, "-m", "mpi4py", str(Path(__file__).resolve())]
    common = ["--epochs", str(args.epochs), "--dropout", str(args.dropout), "--device", args.device,
              "--arch", args.arch,
              *(["--profile"] if args.profile else [])]
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    results = {}
    wanted = [int(r) for r in args.ranks.split(",")]
    runs = [(r, o, "1", None) for r in wanted for o in ((1,) if r == 1 else (1, 0))]
    runs += [(1, 1, "0", None)] if args.torch_path else []
    runs += [(r, 1, "1", s) for s in filter(None, args.schedules.split(",")) for r in wanted if r > 1]
    for ranks, overlap, triton, schedule in runs:
        name = (f"hpcgnn-{ranks}rank" + ("" if overlap else "-no-overlap")
                + ("" if triton == "1" else "-torch-path") + (f"-{schedule}" if schedule else ""))
        cmd = [mpiexec, "-n", str(ranks), "--oversubscribe", *me, "ours", "--shards",
               str(shard_set(args.dataset, ranks, root, args.partitioner)), "--overlap", str(overlap),
               "--out", str(root / f"run-{name}"), *common,
               *(["--schedule", str(REPO / "configs" / "schedules" / f"{schedule}.toml")] if schedule else [])]
        results[name] = child(cmd, env={"HPCGNN_TRITON": triton})
        print(name, json.dumps(results[name]), flush=True)
    if not args.skip_pyg:
        extra = ["--pyg-edge-index"] if args.pyg_edge_index else []
        results["pyg-1process"] = child([sys.executable, str(Path(__file__).resolve()), "pyg",
                                         "--dataset", args.dataset, *common, *extra])
        print("pyg-1process", json.dumps(results["pyg-1process"]), flush=True)
    report(args, results)


def report(args, results: dict) -> None:
    base, base_cpu = results["hpcgnn-1rank"]["epoch_s"], results["hpcgnn-1rank"]["cpu_s"]
    base_wall = results["hpcgnn-1rank"].get("epoch_wall_s")
    rows = ["| configuration | median epoch (s) | speed-up vs 1 rank | with evaluation (s) "
            "| speed-up vs 1 rank | CPU s per rank per epoch "
            "| CPU speed-up | comm share | peak RSS per process (GiB) | peak GPU memory (GiB) "
            "| launches per epoch |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        wall = r.get("epoch_wall_s")                 # None: a result from before it was measured
        walls = (f"{wall:.2f} | {base_wall / wall:.2f}" if wall and base_wall else "– | –")
        rows.append(f"| {name} | {r['epoch_s']:.2f} | {base / r['epoch_s']:.2f} | {walls} | "
                    f"{r['cpu_s']:.2f} | "
                    f"{base_cpu / r['cpu_s']:.2f} | {100 * r['comm_share']:.0f} % | "
                    f"{r['peak_rss_gib']:.2f} | {r.get('gpu_peak_gib', 0.0):.2f} | "
                    f"{(r.get('launches_per_epoch') or {}).get('kernels', '–')} |")
    rows.append("\nmedian epoch: the training step alone; with evaluation: the same epochs' "
                "wall-clock with one evaluation each (eval_every = 1)")
    rows.append(f"\nload average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
                f"device copy bandwidth (copy_, read + write, this run): {args.copy_GB_per_s:.0f} GB/s")
    table = "\n".join(rows)
    print(table)
    results_dir = Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "epoch.json").write_text(json.dumps({"dataset": args.dataset, "epochs": args.epochs,
                                                    "dropout": args.dropout,
                                                    "copy_GB_per_s": args.copy_GB_per_s, "results": results},
                                                   indent=2) + "\n")
    (results_dir / "epoch.md").write_text(f"device {args.device}; dataset `{args.dataset}`, 3-layer {args.arch.upper()}, 128 hidden, "
                                      f"dropout {args.dropout}, {args.epochs} epochs\n\n{table}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="drive", choices=("drive", "ours", "pyg"))
    ap.add_argument("--dataset", default=DEFAULT_SPEC)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--dropout", type=float, default=0.5)
    ap.add_argument("--arch", default="sage", choices=("sage", "gcn", "gat"),
                    help="sage: against PyG's SAGEConv; gcn: against GCNConv (cached normalisation); "
                    "gat: 3 GAT layers of 4 heads x 32 against PyG's GATConv (edge_index)")
    ap.add_argument("--shards-root", default=str(REPO / "shards" / "bench-epoch"))
    ap.add_argument("--shards")
    ap.add_argument("--out")
    ap.add_argument("--overlap", type=int, default=1)
    ap.add_argument("--skip-pyg", action="store_true")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"),
                    help="where every configuration runs (cuda: ranks share the node's GPUs)")
    ap.add_argument("--results", default=str(RESULTS), help="where epoch.json/epoch.md go")
    ap.add_argument("--ranks", default="1,2", help="hpcgnn rank counts to run")
    ap.add_argument("--partitioner", default="metis")
    ap.add_argument("--schedule", help="(ours) the compression schedule file; default: none")
    ap.add_argument("--schedules", default="", help="comma-separated names in configs/schedules/: "
                    "each also run at every rank count above 1 (e.g. quant2-all,full)")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of one "
                    "more epoch (rank 0, stderr; not in the timings)")
    ap.add_argument("--pyg-edge-index", action="store_true")
    ap.add_argument("--torch-path", action="store_true", help="also hpcgnn on 1 rank with "
                    "HPCGNN_TRITON=0 (torch hash dropout and codecs, not the Triton kernels)")
    args = ap.parse_args()
    {"drive": drive, "ours": run_ours, "pyg": run_pyg}[args.mode](args)


if __name__ == "__main__":
    main()
