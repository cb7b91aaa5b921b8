"""CPU time of the training step's phases on every rank: work, not waiting.

    mpiexec -n R python -m mpi4py bench/step_phases.py OUT.json -- train --shards DIR [...]

Runs ``hpcgnn train`` with the arguments after ``--`` and times each training step
(``Trainer.train_step``) in the calling thread's CPU time (``time.thread_time``), split by
wrapping what the step calls: the model's forward pass, ``loss.backward()``, the gradient
Allreduce, and the rest (the loss, stale layers' late gradients, Adam). On the development
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

from hpcgnn.nn import graph, layers, model, propagation  # noqa: E402
from hpcgnn.train import trainer  # noqa: E402

PHASES = ("forward", "backward", "allreduce", "rest")
PARTS = ((layers.HaloLayer, "dropped"), (layers.HaloLayer, "dropped_matmul"),
         (layers.GCNLayer, "forward_owned"), (layers.GCNLayer, "from_aggregate"),
         (propagation.HaloPropagation, "aggregate"), (propagation.HaloPropagation, "aggregate_halo"),
         (propagation.StalePropagation, "input_halo"), (graph.SparseOp, "__matmul__"))
SKIP = 5
STEPS: list[dict] = []
_in_step = False
_spent: dict[str, float] = defaultdict(float)     # this step's CPU seconds per wrapped function


def _timed(owner, name: str, label: str) -> None:
    """Wrap ``owner.name`` so that its CPU time inside a training step adds to ``label``."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if not _in_step:
            return fn(*args, **kwargs)
        c = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[label] += time.thread_time() - c
    setattr(owner, name, wrapper)


def _timed_step(step):
    def train_step(self, epoch: int) -> dict:
        global _in_step
        _spent.clear()
        _in_step, c = True, time.thread_time()
        try:
            out = step(self, epoch)
        finally:
            _in_step = False
        total = time.thread_time() - c
        phases = {k: _spent.pop(k, 0.0) for k in PHASES[:3]}
        STEPS.append({"epoch": epoch, **phases, "rest": total - sum(phases.values()),
                      "parts": dict(_spent)})
        return out
    return train_step


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
    _timed(model.GNN, "forward", "forward")
    _timed(torch.Tensor, "backward", "backward")
    _timed(trainer, "allreduce_sum_", "allreduce")       # the name finish_step calls
    for owner, name in PARTS:
        _timed(owner, name, f"{owner.__name__}.{name}")
    trainer.Trainer.train_step = _timed_step(trainer.Trainer.train_step)
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
