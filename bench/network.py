"""The cluster-network benchmark: real training runs whose bytes cost time as on a cluster link.

Each run is ``mpiexec -n R python -m mpi4py -m hpcgnn train`` inside a private network
namespace (``unshare -n``, root) whose loopback is rate-limited by a token bucket
(``tc qdisc add dev lo root tbf rate RATE burst 1mb latency 100ms``), with Open MPI forced onto
TCP over that loopback (``OMPI_MCA_btl=self,tcp``, ``pml=ob1``). ``none`` runs the same TCP path
without the limit; ``shm`` is a plain launch (shared memory). ``floor`` is full communication
with the exchange skipped (``HPCGNN_BENCH_NO_EXCHANGE=1``): the same compute, no halo wire;
``floor@sN`` is the stale step so (its halo rows arrive as zeros), whose receiver-side work
(dropout and aggregation of the halo input rows) is the compute a stale schedule hides its
wire behind.

    python bench/network.py [--ranks 4 8] [--rates 1 shm] [--schedules full quant2-all ...]
                            [--epochs 100] [--out bench/results/network] [--plot] [--append]
                            [--device cuda]      # GPU ranks (sharing the node's GPUs)

``--progress test fine thread ompi ompi+fine`` runs every stale schedule (``@sN``) once per
way of progressing its exchanges in flight (``[comm] progress``: ``test``, ``fine``,
``thread``; ``ompi``: Open MPI's own TCP progress thread, ``OMPI_MCA_btl_tcp_progress_thread=1``,
with ``test``; ``+`` combines), keyed ``SCHEDULE~VARIANT``; without it they run with the
config's default. ``SCHEDULE~burst128kb`` runs behind a token bucket of that size (``--burst``
for every run), ``SCHEDULE~unlimited`` on the same TCP loopback with no rate limit (its step:
the compute and the sockets' CPU, without the wait for the rate). A run named ``SCHEDULE~sysmalloc`` (any schedule; ``bench/paired.py`` takes
such names) runs with glibc's and torch's allocation defaults (``HPCGNN_MALLOC=system``,
``hpcgnn.memory``), ``SCHEDULE~heapmalloc`` with every block kept (``HPCGNN_MALLOC=heap``).

A schedule name may carry a training method: ``quant1-all@s1`` is that schedule with
``train.staleness = 1``, ``full@s1m`` adds PipeGCN's smoothing (0.95), ``full@retexo`` trains
with RETEXO's lazy message passing (``train.method = retexo``, ``epochs / 2`` rounds per layer:
the same total epochs; each layer's input rows cross the link once), or a CAGNET algorithm:
``full@1.5d-c2`` (1.5D, replication 2, a ``P / c``-part set), ``full@2d`` (SUMMA, ``P = q^2``,
a ``q``-part set), ``full@3d`` (split-3D, ``P = q^3``, a ``q^2``-part set); a rank count the
algorithm cannot use is skipped (``bench/regime.py`` runs the four side by side).

``auto`` is ``configs/schedules/auto.toml`` (``kind = "auto"``, its defaults); the epochs in
which it measures its candidates are part of its time, as they are of a user's run, and so are
its start before epoch 0 and each check's own seconds (``auto.start.seconds``,
``auto.seconds``), added to that epoch's training time and wall-clock.

Per run: median epoch time (the training step only, ``epoch_s``) and the mean wall-clock per
epoch with evaluation (``wall_s`` of ``metrics.jsonl``: the step plus the evaluation every
``--eval-every`` epochs, which runs synchronous and uncompressed), comm and codec share, bytes
relative to fp32, test accuracy at the best validation epoch, and **time to accuracy** twice:
the training time (sum of ``epoch_s``) and the wall-clock (sum of ``wall_s``) until validation
accuracy first reaches full communication's best validation accuracy at the same rank count
and link, less 0.5 pt. Where the link has a rate, ``wire`` is the time its bytes take on it
(all ranks share the one emulated link: a step's bytes x 8 / rate) and ``vs max`` is the epoch
against ``max(compute, wire)``, the compute being the floor run's epoch at the same ranks and
link plus the run's own codec time (run ``floor`` in the same sweep); a stale schedule is also
set against its stale floor (``floor@sN`` in the same sweep; ``vs_max_stale``). A step's bytes
(``bytes_per_step``, and the table's MB column) are those of the median over epochs 1 on, the
epochs ``epoch_s`` is the median of; ``bytes_per_epoch`` is the mean over every epoch, which for
a stale run also holds the first layer's input rows that cross once, in epoch 0 (fp32: 19 % more
than a Sylvie step's bytes over 100 epochs on the cSBM 20k, 47 % over 40). Results: ``OUT.json``, ``OUT.md`` and, with ``--plot``,
``OUT-tta.png`` (accuracy against wall-clock) and ``OUT-speedup.png``. A run that fails is named,
skipped and listed under ``failed`` (exit status 1); ``OUT.partial.json`` holds the finished runs
while the sweep goes on. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BURST = "1mb"
"""The token bucket's size (``tc``'s units: ``1mb`` = 1 MiB): that many bytes pass at once
after the link was idle long enough to refill it; an exchange smaller than that costs no wire
time if the ranks computed long enough before it (``bench/netmodel.py``'s ``bucket_wire_time``).
A cluster link has no such allowance: ``--burst 128kb`` comes closer (two loopback packets of
64 KiB)."""
DEFAULT_SPEC = "csbm:nodes=20000,classes=8,degree=10,homophily=0.7,features=128,signal=0.8,seed=11"
SCHEDULES = ("full", "auto", "varco", "varco-quant2-all", "quant4-all", "quant2-all", "quant1-all",
             "quant-1to4-all", "sample-all", "sample-quant2-all")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMP_NUM_THREADS": "1"}
TCP_ENV = {"OMPI_MCA_btl": "self,tcp", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl_tcp_if_include": "lo",
           "OMPI_MCA_oob_tcp_if_include": "lo", "PRTE_MCA_oob_tcp_if_include": "lo"}
LAYERS = 2
RUN_TOML = """[model]
arch = "gcn"
hidden = 64
layers = {layers}
dropout = 0.5
[train]
epochs = {epochs}
lr = 0.01
weight_decay = 5e-4
seed = {seed}
eval_every = {eval_every}
"""


def shard_set(spec: str, parts: int, root: Path, partitioner: str = "random") -> Path:
    out = root / f"shards-{partitioner}-{parts}"
    if not (out / "meta.json").is_file():
        subprocess.run([sys.executable, "-m", "preprocess", "--dataset", spec, "--parts", str(parts),
                        "--partitioner", partitioner, "--out", str(out), "--force", "-q"], check=True, cwd=REPO)
    return out


def method(name: str, epochs: int = 100) -> tuple[str, list[str], int]:
    """``SCHEDULE[@opt,...]`` -> (schedule, --set overrides, replication c). Options: ``sN``
    (staleness N), ``sNm`` (and PipeGCN's smoothing 0.95), ``1.5d-cN`` (CAGNET 1.5D, c = N),
    ``2d`` / ``3d`` (CAGNET 2D / 3D), ``retexo`` (RETEXO, ``epochs / LAYERS`` rounds per layer),
    ``ev-exchange`` / ``ev-kept`` (``train.eval_features``: how evaluation's first layer gets
    its halo rows), ``keep`` (``train.keep_features``: the first layer on kept feature rows)."""
    sched, _, opts = name.partition("@")
    sets, c = [], 1
    for opt in filter(None, opts.split(",")):
        if opt in ("ev-exchange", "ev-kept"):
            sets += ["--set", f"train.eval_features={opt[3:]}"]
        elif opt == "keep":
            sets += ["--set", "train.keep_features=true"]
        elif opt in ("2d", "3d"):
            sets += ["--set", f"parallel.algorithm={opt}"]
        elif opt == "retexo":
            if epochs % LAYERS:
                raise SystemExit(f"bench/network.py: {name} needs --epochs divisible by {LAYERS}")
            sets += ["--set", "train.method=retexo", "--set", f"train.rounds_per_layer={epochs // LAYERS}"]
        elif opt.startswith("1.5d-c"):
            c = int(opt[len("1.5d-c"):])
            sets += ["--set", "parallel.algorithm=1.5d", "--set", f"parallel.replication={c}"]
        else:
            smooth = opt.endswith("m")
            sets += ["--set", f"train.staleness={int(opt[1:].rstrip('m'))}",
                     "--set", f"train.smoothing={0.95 if smooth else 0.0}"]
    return sched, sets, c


def algorithm(name: str) -> str:
    """The ``parallel.algorithm`` a schedule name runs: halo, 1.5d, 2d or 3d."""
    opts = name.partition("@")[2].split(",")
    return next((o[:4] if o.startswith("1.5d") else o for o in opts
                 if o.startswith("1.5d") or o in ("2d", "3d")), "halo")


def part_count(name: str, ranks: int) -> int | None:
    """Parts of the shard set that ``name`` trains on with ``ranks`` ranks, or None when the
    algorithm cannot run on that many: halo P, 1.5D P / c (c^2 dividing P), 2D q (P = q^2),
    3D q^2 (P = q^3)."""
    alg, c = algorithm(name), method(name)[2]
    if alg == "1.5d":
        return ranks // c if ranks % (c * c) == 0 else None
    root = {"2d": 2, "3d": 3}.get(alg)
    if root is None:
        return ranks
    q = round(ranks ** (1.0 / root))
    return q ** (root - 1) if q ** root == ranks else None


PROGRESS_ENV = {"ompi": {"OMPI_MCA_btl_tcp_progress_thread": "1"},   # Open MPI's TCP thread
                "sysmalloc": {"HPCGNN_MALLOC": "system"},     # allocation defaults (hpcgnn.memory)
                "heapmalloc": {"HPCGNN_MALLOC": "heap"},      # every freed block kept
                # Open MPI's TCP path: more fragments of a large message in flight between two
                # progress calls (default 3 sent, 4 received, of btl_tcp_max_send_size each) ...
                "deep": {"OMPI_MCA_pml_ob1_send_pipeline_depth": "64",
                         "OMPI_MCA_pml_ob1_recv_pipeline_depth": "64"},
                # ... or messages up to 8 MiB sent eagerly (no rendezvous: no reply to wait for)
                "eager": {"OMPI_MCA_btl_tcp_eager_limit": "8388608",
                          "OMPI_MCA_btl_tcp_max_send_size": "8388608"},
                # ... and socket buffers of 4 MiB (net.core.[rw]mem_max here) instead of the
                # kernel's autotuning, which grows a receive buffer only as the rank reads it
                "sockbuf": {"OMPI_MCA_btl_tcp_sndbuf": "4194304", "OMPI_MCA_btl_tcp_rcvbuf": "4194304"}}


def progress_variant(variant: str) -> tuple[list[str], dict]:
    """``test`` | ``fine`` | ``thread`` | ``ompi`` | ``deep`` | ``eager`` | ``sockbuf`` |
    ``sysmalloc`` | ``heapmalloc``, ``+``-joined -> (--set list, environment)."""
    sets, env = [], {}
    for part in filter(None, variant.split("+")):
        if part in PROGRESS_ENV:
            env.update(PROGRESS_ENV[part])
        elif part in ("test", "fine", "thread"):
            sets += ["--set", f"comm.progress={part}"]
        else:
            raise SystemExit(f"bench/network.py: variant {part!r}: use test, fine, thread, "
                             f"ompi, deep, eager, sockbuf, sysmalloc or heapmalloc (joined with +)")
    return sets, env


def link_variant(variant: str, burst: str) -> tuple[str, str]:
    """A ``burstSIZE`` part of a run's variant (``quant2-all~burst128kb``: ``bench/paired.py``
    compares buckets in the same rounds) -> (the other parts, the bucket size)."""
    parts = [p for p in variant.split("+") if p]
    sizes = [p[len("burst"):] for p in parts if p.startswith("burst")]
    return "+".join(p for p in parts if not p.startswith("burst")), (sizes[-1] if sizes else burst)


def unlimited_variant(variant: str, rate: str) -> tuple[str, str]:
    """An ``unlimited`` part of a run's variant (``full@s1~unlimited``) runs it on the same
    TCP loopback without the rate limit (``none``): its bytes cross at memory speed, so its
    step is the compute plus all the CPU the sockets take, and nothing of the rate's wait
    (``bench/paired.py`` takes it as the compute of ``max(compute, wire)``) -> (the other
    parts, the rate)."""
    parts = [p for p in variant.split("+") if p]
    if "unlimited" not in parts:
        return variant, rate
    if rate == "shm":
        raise SystemExit("bench/network.py: ~unlimited needs a TCP link (a rate or none), not shm")
    return "+".join(p for p in parts if p != "unlimited"), "none"


def is_unlimited(name: str) -> bool:
    """Whether run ``name`` (``SCHEDULE[@opts][~VARIANT]``) runs without the rate limit."""
    return "unlimited" in name.partition("~")[2].split("+")


def unlimited_of(name: str) -> str:
    """The run name of ``name`` (``SCHEDULE[@opts][~VARIANT]``) without the rate limit."""
    return f"{name}+unlimited" if "~" in name else f"{name}~unlimited"


def behind_link(cmd: list[str], rate: str, burst: str = BURST) -> list[str]:
    """``cmd`` in a new network namespace whose loopback is a token bucket of ``rate`` Gbit/s
    (``none``: unlimited); its MPI must use TCP on ``lo`` (``TCP_ENV``). Needs root."""
    shape = "" if rate == "none" else (f"tc qdisc add dev lo root tbf rate {rate}gbit "
                                       f"burst {burst} latency 100ms && ")
    return ["unshare", "-n", "bash", "-c",
            f"ip link set lo up && {shape}exec {' '.join(shlex.quote(a) for a in cmd)}"]


def launch(ranks: int, shards: Path, name: str, rate: str, run_dir: Path, config: Path,
           timeout: float, epochs: int = 100, device: str = "cpu", burst: str = BURST) -> None:
    """One training run on ``ranks`` ranks behind link ``rate`` (Gbit/s, 'none' or 'shm');
    ``name``: ``SCHEDULE[@opts][~PROGRESS]``; ``burst``: the token bucket's (tc units)."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    name, _, variant = name.partition("~")
    variant, burst = link_variant(variant, burst)
    variant, rate = unlimited_variant(variant, rate)
    schedule, sets, _ = method(name, epochs)
    progress_sets, progress_env = progress_variant(variant)
    sets += progress_sets
    sched = [] if schedule in ("full", "floor") else ["--schedule", str(REPO / "configs" / "schedules" / f"{schedule}.toml")]
    train = [str(mpiexec), "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "mpi4py",
             "-m", "hpcgnn", "train", "--shards", str(shards), "--config", str(config),
             "--out", str(run_dir), "--force", "--device", device, *sched, *sets]
    env = {**os.environ, **MPI_ENV, **progress_env}
    if schedule == "floor":
        env["HPCGNN_BENCH_NO_EXCHANGE"] = "1"
    if rate == "shm":
        cmd = train
    else:
        env.update(TCP_ENV)
        cmd = behind_link(train, rate, burst)
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"run {run_dir} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def summarise(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    times = [r["epoch_s"] for r in rows]
    walls = [r["wall_s"] for r in rows]                 # the step plus its evaluation, if any
    start_s = rows[0].get("auto", {}).get("start", {}).get("seconds", 0.0) if rows else 0.0
    if start_s:                                         # kind = "auto": its timing before epoch 0
        times[0] += start_s
        walls[0] += start_s
    for i, r in enumerate(rows):                        # kind = "auto": each check's own time
        check_s = r.get("auto", {}).get("seconds", 0.0)
        times[i] += check_s
        walls[i] += check_s
    steps = [r["epoch_s"] for r in rows]                # the median: the step alone
    return {"epoch_s": statistics.median(steps[1:] or steps),
            "epoch_wall_s": statistics.mean(walls[1:] or walls),
            "eval_s": statistics.mean(r["eval_s"] for r in rows),
            "comm_share": statistics.median(r["comm_s"] / r["epoch_s"] for r in rows[1:] or rows),
            "codec_share": statistics.median(r["codec_s"] / r["epoch_s"] for r in rows[1:] or rows),
            "codec_s": statistics.median(r["codec_s"] for r in rows[1:] or rows),   # bench/netmodel.py
            "comm_s": statistics.median(r["comm_s"] for r in rows[1:] or rows),
            "bytes_ratio": summary["bytes_sent"] / max(summary["bytes_full"], 1),
            "bytes_sent": summary["bytes_sent"], "test_acc": summary["test_acc"],
            "peak_rss_bytes": summary.get("peak_rss_bytes"), "malloc": summary.get("malloc"),
            "thp": summary.get("thp"),
            "bytes_per_epoch": statistics.mean(r["bytes_sent"] for r in rows),
            # what the median step sends (the epochs epoch_s is the median of): a stale run's
            # epoch 0 also sends the first layer's input rows, once
            "bytes_per_step": statistics.median(r["bytes_sent"] for r in rows[1:] or rows),
            "best_val": summary["best_val_acc"], "train_s": sum(times), "train_wall_s": sum(walls),
            # (training time, val acc, test acc, wall-clock with evaluation) after each epoch
            "curve": [(sum(times[:i + 1]), r.get("val_acc"), r.get("test_acc"), sum(walls[:i + 1]))
                      for i, r in enumerate(rows)]}


def time_to(curve: list, target: float, wall: bool = False) -> float | None:
    """Training time (``wall``: wall-clock with evaluation) until validation accuracy first
    reaches ``target``; None if never (or, for ``wall``, a curve from before wall-clock)."""
    hit = next((c for c in curve if c[1] is not None and c[1] >= target), None)
    if hit is None or (wall and len(hit) < 4):
        return None
    return hit[3] if wall else hit[0]


def step_bytes(res: dict) -> float:
    """The bytes of a step (all ranks): ``bytes_per_step``; results from before it was recorded
    (2026-11-28) have the mean over every epoch alone, which is the same for a synchronous
    schedule of constant bytes."""
    return res.get("bytes_per_step", res["bytes_per_epoch"])


def wire_s(res: dict, rate: str) -> float | None:
    """Seconds a step's bytes (all ranks) take on the emulated link of ``rate`` Gbit/s."""
    try:
        return step_bytes(res) * 8 / (float(rate) * 1e9)
    except ValueError:
        return None                                  # 'none' or 'shm': no rate


def run_all(args, failed: list[str] | None = None) -> dict:
    """Every run of the sweep. A run that fails (or outlasts ``--timeout``) is reported, named in
    ``failed`` and skipped: the rest of the sweep goes on (a link emulation this machine lacks
    must not cost the shared-memory runs). The results so far are kept in ``OUT.partial.json``
    after each run, so a sweep stopped from outside leaves its finished runs summarised."""
    root = Path(args.work)
    root.mkdir(parents=True, exist_ok=True)
    config = root / "run.toml"
    config.write_text(RUN_TOML.format(epochs=args.epochs, seed=args.seed, eval_every=args.eval_every,
                                      layers=LAYERS))
    partial = Path(args.out).with_name(Path(args.out).name + ".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    failed = [] if failed is None else failed
    results: dict = {}
    for ranks in args.ranks:
        for rate in args.rates:
            for schedule in (n for s in args.schedules for n in with_progress(s, args.progress)):
                parts = part_count(schedule.partition("~")[0], ranks)
                if parts is None:
                    continue                          # e.g. 2D on a non-square rank count
                shards = shard_set(args.dataset, parts, root, args.partitioner)
                run_dir = root / f"r{ranks}-{rate}-{schedule}"
                t0 = time.perf_counter()
                try:
                    launch(ranks, shards, schedule, rate, run_dir, config, args.timeout, args.epochs,
                           args.device, args.burst)
                    res = summarise(run_dir)
                except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
                    failed.append(f"{ranks}|{rate}|{schedule}")
                    print(f"ranks {ranks} link {rate} {schedule}: FAILED, skipped: {exc}", flush=True)
                    continue
                res["wall_s"] = time.perf_counter() - t0
                results[f"{ranks}|{rate}|{schedule}"] = res
                partial.write_text(json.dumps({"failed": failed, "results": results}, indent=1))
                print(f"ranks {ranks} link {rate} {schedule}: epoch {1e3 * res['epoch_s']:.1f} ms, "
                      f"test {res['test_acc']:.4f}, bytes {100 * res['bytes_ratio']:.1f} %", flush=True)
    return results


def with_progress(schedule: str, variants: list[str] | None) -> list[str]:
    """The run names of ``schedule``: one per progress variant where it is stale (``@sN``)."""
    stale = any(o[:1] == "s" and o[1:2].isdigit() for o in schedule.partition("@")[2].split(","))
    return [f"{schedule}~{v}" for v in variants] if stale and variants else [schedule]


def is_floor(sched: str) -> bool:
    """``floor`` or a stale floor ``floor@sN``: runs that send nothing."""
    return sched.partition("@")[0].partition("~")[0] == "floor"


def stale_floor(sched: str) -> str | None:
    """``floor@sN`` for a stale schedule ``X@...,sN,...`` (the same stale step, nothing on the
    wire: its receiver-side work included), else None."""
    for opt in sched.partition("~")[0].partition("@")[2].split(","):
        if opt[:1] == "s" and opt[1:].isdigit():
            return f"floor@{opt}"
    return None


def add_time_to_accuracy(results: dict) -> None:
    """Per run: time to accuracy (training time and wall-clock) against full communication at
    the same ranks and link, and the epoch against ``max(compute, wire)``, compute being the
    floor's epoch plus the run's own codec; for a stale schedule also against its stale floor
    (``floor@sN``, where it ran: ``vs_max_stale``)."""
    for key, res in results.items():
        ranks, rate, sched = key.split("|")
        res["wire_s"] = None if is_floor(sched) else wire_s(res, rate)   # a floor sends nothing
        floor = results.get(f"{ranks}|{rate}|floor")
        if floor is not None and res["wire_s"] is not None:      # compute: the floor + own codec
            res["compute_s"] = floor["epoch_s"] + res.get("codec_s", 0.0)
            res["vs_max"] = res["epoch_s"] / max(res["compute_s"], res["wire_s"])
        own = stale_floor(sched)
        floor = results.get(f"{ranks}|{rate}|{own}") if own else None
        if floor is not None and res["wire_s"] is not None:
            res["compute_stale_s"] = floor["epoch_s"] + res.get("codec_s", 0.0)
            res["vs_max_stale"] = res["epoch_s"] / max(res["compute_stale_s"], res["wire_s"])
        full = results.get(f"{ranks}|{rate}|full")
        if full is None:
            continue
        res["target_val"] = full["best_val"] - 0.005
        for tag, wall in (("", False), ("_wall", True)):
            res[f"tta{tag}_s"] = time_to(res["curve"], res["target_val"], wall)
            base = time_to(full["curve"], res["target_val"], wall)
            res[f"tta{tag}_speedup"] = base / res[f"tta{tag}_s"] if res[f"tta{tag}_s"] and base else None
        res["epoch_speedup"] = full["epoch_s"] / res["epoch_s"]


def _gpus() -> str:
    import torch
    n = torch.cuda.device_count()
    return f"{n} x {torch.cuda.get_device_name(0)}" if n else "none found"


def _fmt(value, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "—" if value is None else f"{scale * value:{spec}}{unit}"


def to_markdown(results: dict, args) -> str:
    lines = [f"`{args.dataset}`, GCN 2 layers, 64 hidden, {args.epochs} epochs, {args.partitioner} parts, "
             f"evaluation every {args.eval_every} epochs (synchronous, uncompressed), "
             + (f"CPU ranks (one thread each) on {os.cpu_count()} cores; "
                if getattr(args, "device", "cpu") == "cpu"
                else f"GPU ranks, all sharing this node's GPUs ({_gpus()}), {os.cpu_count()} cores; ")
             + "link: token-bucket "
             "rate-limited loopback in a network namespace (Open MPI over TCP), `none` = the same "
             "TCP path unlimited, `shm` = shared memory. `epoch`: the training step (median); "
             "`wall`: wall-clock per epoch with evaluation (mean). `wire`: a step's bytes on "
             "the link (MB / step: the median step's, epochs 1 on); `vs max`: epoch / max(floor epoch + codec, wire); for a stale schedule "
             "`@sN` where `floor@sN` ran (the same stale step with nothing on the wire, so its "
             "receiver-side work counted as compute), also that ratio with the stale floor, "
             "after a slash. Time to accuracy: until "
             "validation accuracy reaches full communication's best - 0.5 pt, in training time "
             "and in wall-clock with evaluation (— = never).", "",
             "| ranks | link (Gbit/s) | schedule | epoch (ms) | vs full | wall (ms) | wire (ms) | "
             "vs max | comm | codec | bytes vs fp32 | MB / step | test acc | "
             "to acc, train (s) | vs full | to acc, wall (s) | vs full |",
             "|---|---|---|" + "---:|" * 14]
    for key, r in results.items():
        ranks, rate, sched = key.split("|")
        sent = "none" if is_floor(sched) else ("—" if algorithm(sched) != "halo"
                                                 else f"{100 * r['bytes_ratio']:.1f} %")
        lines.append(
            f"| {ranks} | {rate} | {sched} | {1e3 * r['epoch_s']:.1f} | "
            f"{r.get('epoch_speedup', 1):.2f}x | {_fmt(r.get('epoch_wall_s'), '.1f', 1e3)} | "
            f"{_fmt(r.get('wire_s'), '.1f', 1e3)} | {_fmt(r.get('vs_max'), '.2f', 1, 'x')}"
            f"{'' if r.get('vs_max_stale') is None else ' / ' + _fmt(r['vs_max_stale'], '.2f', 1, 'x')} | "
            f"{100 * r['comm_share']:.0f} % | {100 * r['codec_share']:.1f} % | {sent} | "
            f"{step_bytes(r) / 1e6:.2f} | {r['test_acc']:.4f} | {_fmt(r.get('tta_s'), '.2f')} | "
            f"{_fmt(r.get('tta_speedup'), '.2f', 1, 'x')} | {_fmt(r.get('tta_wall_s'), '.2f')} | "
            f"{_fmt(r.get('tta_wall_speedup'), '.2f', 1, 'x')} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [k for k in results if k.split("|")[1] == "1"] or list(results)
    ranks = sorted({k.split("|")[0] for k in keys}, key=int)
    fig, axes = plt.subplots(1, len(ranks), figsize=(6 * len(ranks), 4.2), squeeze=False)
    for ax, rk in zip(axes[0], ranks):
        for k in keys:
            r_, rate, sched = k.split("|")
            if r_ != rk:
                continue
            pts = [(c[-1], c[1]) for c in results[k]["curve"] if c[1] is not None]   # wall-clock
            if is_floor(sched) or not pts:
                continue                        # the floor's accuracy means nothing
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=sched, lw=1.2,
                    ls="--" if "@" in sched else "-")
        ax.set_title(f"{rk} ranks, link {rate} Gbit/s")
        ax.set_ylim(0.5, 0.9)
        ax.set_xlabel("wall-clock with evaluation (s; training time in older results)")
        ax.set_ylabel("validation accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_name(out.name + "-tta.png"), dpi=110)
    plt.close(fig)
    rates = [r for r in dict.fromkeys(k.split("|")[1] for k in results) if r not in ("shm",)]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for rk in sorted({k.split("|")[0] for k in results}, key=int):
        for sched in dict.fromkeys(k.split("|")[2] for k in results):
            if sched == "full":
                continue
            ys = [results.get(f"{rk}|{rate}|{sched}", {}).get("epoch_speedup") for rate in rates]
            if any(y is not None for y in ys):
                ax.plot(range(len(rates)), ys, marker="o", label=f"{sched}, {rk} ranks", lw=1)
    ax.set_xticks(range(len(rates)), [f"{r}" for r in rates])
    ax.set_xlabel("link (Gbit/s; none = unlimited TCP)")
    ax.set_ylabel("epoch speed-up over full communication")
    ax.axhline(1, color="grey", lw=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out.with_name(out.name + "-speedup.png"), dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default=DEFAULT_SPEC)
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rates", nargs="+", default=["0.5", "1", "10", "none", "shm"],
                    help="link rates in Gbit/s, 'none' (TCP, unlimited) or 'shm' (shared memory)")
    ap.add_argument("--schedules", nargs="+", default=["floor", *SCHEDULES],
                    help="schedule names in configs/schedules, 'full', or 'floor'")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--burst", default=BURST,
                    help=f"the link's token bucket, tc units (default {BURST}: bytes an idle link "
                         f"lets pass at once; a cluster link has no such allowance)")
    ap.add_argument("--partitioner", default="random", choices=("random", "metis"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=2,
                    help="train.eval_every: evaluate every k epochs (the wall-clock columns include it)")
    ap.add_argument("--progress", nargs="+", metavar="VARIANT",
                    help="stale schedules once per variant: test, fine, thread, ompi (Open MPI's "
                         "TCP progress thread), joined with + (default: the config's)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the ranks train; cuda: the ranks share the node's GPUs (one GPU: "
                    "all of them), so say so when quoting")
    ap.add_argument("--work", default=str(REPO / "runs" / "network"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "network"))
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--append", action="store_true", help="merge into an existing OUT.json")
    ap.add_argument("--replot", action="store_true", help="only redraw the plots from OUT.json")
    args = ap.parse_args()
    if os.geteuid() != 0 and any(r != "shm" for r in args.rates):
        sys.exit("bench/network.py: the link emulation needs root (unshare -n, tc); use --rates shm")
    if "full" not in args.schedules:
        args.schedules.insert(0, "full")
    out = Path(args.out)
    if args.replot:
        plot(json.loads(out.with_name(out.name + ".json").read_text())["results"], out)
        return
    failed: list[str] = []
    results = run_all(args, failed)
    if args.append and out.with_name(out.name + ".json").is_file():      # merge with an earlier sweep
        results = {**json.loads(out.with_name(out.name + ".json").read_text())["results"], **results}
    add_time_to_accuracy(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = to_markdown(results, args)
    out.with_name(out.name + ".md").write_text(table)
    out.with_name(out.name + ".json").write_text(json.dumps({"dataset": args.dataset, "epochs": args.epochs,
                                                   "device": args.device, "burst": args.burst,
                                                   "eval_every": args.eval_every,
                                                   "load_average": os.getloadavg()[0],
                                                   "failed": failed, "results": results}, indent=1))
    out.with_name(out.name + ".partial.json").unlink(missing_ok=True)
    print(table)
    if args.plot:
        plot(results, out)
    if failed:
        sys.exit(f"bench/network.py: {len(failed)} run(s) failed (their errors above): {', '.join(failed)}")


if __name__ == "__main__":
    main()
