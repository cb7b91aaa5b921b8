"""CPU time of the training step's phases on every rank: work, not waiting.

    mpiexec -n R python -m mpi4py bench/step_phases.py OUT.json -- train --shards DIR [...]

Runs ``hpcgnn train`` with the arguments after ``--`` and times each training step's phases in
the calling thread's CPU time (``time.thread_time``): the forward pass, the backward pass, the
gradient Allreduce, and the rest (stale layers' late gradients, Adam). On the development
machine 4 or 8 ranks share 2 cores and the host's load moves wall-clock times by 15-30 % between
runs; a rank's CPU time leaves out the time it waited for a core or for a peer (the Allreduce
still counts MPI's busy polling over shared memory). With ``HPCGNN_BENCH_NO_EXCHANGE=1`` (the
benchmarks' no-communication floor) the forward and backward are the layers' arithmetic alone.
Also timed, summed per step: the layer functions in ``PARTS`` (what a stale step adds shows
there). Evaluation and the epoch's bookkeeping are not timed.

Writes ``OUT.json`` (every step of every rank) and prints per rank the median and least step
CPU time and the phases' medians, skipping the first 5 steps; the parts for rank 0.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict

from mpi4py import MPI

from hpcgnn import memory

memory.configure()                   # as `hpcgnn train` does, before torch is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hpcgnn.comm.collectives import allreduce_sum_  # noqa: E402
from hpcgnn.nn import graph, layers, propagation  # noqa: E402
from hpcgnn.train import trainer  # noqa: E402

PHASES = ("forward", "backward", "allreduce", "rest")
PARTS = ((layers.HaloLayer, "dropped"), (layers.HaloLayer, "dropped_matmul"),
         (layers.GCNLayer, "forward_owned"), (layers.GCNLayer, "from_aggregate"),
         (propagation.HaloPropagation, "aggregate"), (propagation.HaloPropagation, "aggregate_halo"),
         (propagation.StalePropagation, "input_halo"), (graph.SparseOp, "__matmul__"))
SKIP = 5
STEPS: list[dict] = []
_parts: dict[str, float] = defaultdict(float)


def _timed(owner, name: str) -> None:
    fn, label = getattr(owner, name), f"{owner.__name__}.{name}"

    def wrapper(*args, **kwargs):
        c = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _parts[label] += time.thread_time() - c
    setattr(owner, name, wrapper)


def train_step(self, epoch: int) -> dict:
    """``Trainer.train_step`` and ``finish_step`` in one, with the phases timed."""
    step = self.make_step(epoch, training=True)
    self.model.stats.reset()
    _parts.clear()
    cpu, t0 = [time.thread_time()], time.perf_counter()
    self.model.train()
    self.opt.zero_grad(set_to_none=False)
    logits = self.model(self.data.x, step)
    cpu.append(time.thread_time())
    mask = self.data.train
    loss = F.cross_entropy(logits[mask], self.data.y[mask], reduction="sum") / self.n_train
    loss.backward()
    for p in self.params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    loss_buf = loss.detach().reshape(1).clone()
    cpu.append(time.thread_time())
    t1 = time.perf_counter()
    nbytes = allreduce_sum_(self.ctx, [p.grad for p in self.params] + [loss_buf])
    t2 = time.perf_counter()
    cpu.append(time.thread_time())
    self.model.post_late_gradients()
    self.opt.step()
    cpu.append(time.thread_time())
    STEPS.append({"epoch": epoch, **{k: b - a for k, a, b in zip(PHASES, cpu, cpu[1:])},
                  "parts": dict(_parts)})
    return {"loss": float(loss_buf.item()), "ratio": self.ratios(epoch), "allreduce_bytes": nbytes,
            "allreduce_s": t2 - t1, "epoch_s": time.perf_counter() - t0}


def report(rank_steps: list[list[dict]]) -> None:
    ms = lambda v: f"{1e3 * v:.2f}"  # noqa: E731
    for rank, steps in enumerate(rank_steps):
        steps = steps[SKIP:] or steps
        total = [sum(s[k] for k in PHASES) for s in steps]
        phases = " ".join(f"{k} {ms(statistics.median(s[k] for s in steps))}" for k in PHASES)
        print(f"rank {rank}: step CPU ms median {ms(statistics.median(total))}, least "
              f"{ms(min(total))} ({len(steps)} steps); medians: {phases}")
    steps = rank_steps[0][SKIP:] or rank_steps[0]
    for label in sorted({k for s in steps for k in s["parts"]}):
        values = [s["parts"].get(label, 0.0) for s in steps]
        print(f"  rank 0 {label}: median {ms(statistics.median(values))} ms, least {ms(min(values))}")


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        raise SystemExit(__doc__.split("\n\n")[1])
    out, argv = sys.argv[1], sys.argv[3:]
    for owner, name in PARTS:
        _timed(owner, name)
    trainer.Trainer.train_step = train_step
    from hpcgnn.__main__ import main as hpcgnn_main
    rc = hpcgnn_main(argv)
    if rc:
        raise SystemExit(rc)
    comm = MPI.COMM_WORLD
    everything = comm.gather(STEPS, root=0)
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump(everything, f)
        report(everything)


if __name__ == "__main__":
    main()
