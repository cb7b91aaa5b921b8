"""Progress of the stale exchanges in flight (``[comm] progress``, ``hpcgnn.comm.progress``).

That every mode trains exactly PipeGCN's model (``tests/_pipegcn.py``) is checked with the
other stale cases in ``tests/test_methods_exact.py`` (``fine``: GCN 3 layers, SAGE with s = 2
and smoothing on uneven METIS parts, GAT with attention dropout). Here, on real ranks: ``fine``
tests the requests in flight inside the layers, in the forward and in the backward pass, where
``test`` tests only at the stale layers' boundaries, and both give the same logits bit for bit.
This file is also the MPI worker of the last test.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import CSBM, check_ok, run_mpi


def test_progress_mode_is_a_config_key_and_an_override():
    from hpcgnn.comm.settings import CommSettings
    from hpcgnn.config import ConfigError, load_config
    assert load_config(None, ["comm.progress=fine"]).comm.progress == "fine"
    assert CommSettings.resolve(None, {"HPCGNN_PROGRESS": "fine"}).progress == "fine"
    with pytest.raises(ConfigError, match=r"comm.progress = 'often'.*'test', 'fine', 'thread'"):
        load_config(None, ["comm.progress=often"])
    with pytest.raises(ValueError, match=r"HPCGNN_PROGRESS='often'.*test, fine, thread"):
        CommSettings.resolve(None, {"HPCGNN_PROGRESS": "often"})


@pytest.mark.mpi
def test_fine_points_test_inside_the_layers_both_ways(shards, tmp_path):
    """2 ranks, a 3-layer GCN 24 -> 64 -> 64 -> 4 of a stale run (the first layer's input
    constant), epochs 1-3 after the warm-up. ``test``: one test at each stale layer's
    boundary, forward and backward (2 and 2). ``fine``: also at every point inside the layers.
    Forward (the cheaper order on these parts, ``transform_first_with_halo``): layers 0 and 1
    aggregate first, 5 points each (the dropped input and halo rows, both sparse products, the
    output); layer 2 transforms first with the dropout fused into ``@ W`` (C kernel, 4 wide),
    4 (both fused products, both sparse products): 2 + 14 = 16. Backward: the points whose
    tensors carry a gradient; in layer 0 only its output (the features and their sparse
    products need none): 2 + 1 + 5 + 4 = 12. Same logits both ways, bit for bit."""
    shard_dir = shards(CSBM, 2, "random")
    counts = {}
    for mode in ("test", "fine"):
        proc = run_mpi(2, [__file__, str(shard_dir), str(tmp_path / mode), mode], timeout=180)
        check_ok(proc)
        rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("tests ")]
        assert len(rows) == 2 * 3                                     # 2 ranks x 3 epochs
        counts[mode] = {(int(r[1]), int(r[2])): (int(r[3]), int(r[4]), r[5]) for r in rows}
    for key, (fwd, bwd, loss) in counts["test"].items():
        assert (fwd, bwd) == (2, 2), key
        fine_fwd, fine_bwd, fine_loss = counts["fine"][key]
        assert (fine_fwd, fine_bwd) == (16, 12), key
        assert fine_loss == loss                                      # repr of the float


@pytest.mark.mpi
def test_halo_gradients_are_posted_after_the_gradient_allreduce(shards, tmp_path):
    """2 ranks, training steps 0-3 of a 3-layer stale GCN through the trainer. A link delivers
    in order, so the halo gradients posted ahead of the step's gradient Allreduce would delay
    it by their wire time (``hpcgnn.comm.stale``). At the Allreduce of every step after the
    warm-up both stale layers hold their halo gradients unposted; after the step they are on
    the wire (the entry of that epoch), and nothing is kept."""
    shard_dir = shards(CSBM, 2, "random")
    proc = run_mpi(2, [__file__, str(shard_dir), str(tmp_path / "order"), "order"], timeout=180)
    check_ok(proc)
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("order ")]
    assert len(rows) == 2 * 4                                         # 2 ranks x 4 steps
    for _, rank, epoch, kept, posted, left in rows:
        if int(epoch) == 0:                                           # warm-up: synchronous
            assert (kept, posted, left) == ("0", "0", "0"), (rank, epoch)
        else:
            assert (kept, posted, left) == ("2", "2", "0"), (rank, epoch)


# -- the worker (runs on every rank) --------------------------------------------------------

def _worker(shard_dir: str, out: str, mode: str) -> None:
    """Epochs 0-3 of a 3-layer stale GCN (forward, backward, no optimiser step); prints, per
    epoch >= 1, the tests that found requests in flight in the forward and in the backward
    pass, and the sum of the logits."""
    from hpcgnn.codecs.base import FULL_PRECISION
    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.train.build import prepare_trainer
    ctx = CommContext.from_world("cpu")
    cfg = load_config(None, ["model.layers=3", "model.hidden=64", "model.dropout=0.5",
                             "train.staleness=1", f"comm.progress={mode}"])
    trainer = prepare_trainer(ctx, cfg, shard_dir, Path(out), FULL_PRECISION)
    trainer.start()
    model, progress = trainer.model, trainer.model.layers[1].prop.progress
    model.train()
    for epoch in range(4):
        before = progress.tests
        logits = model(trainer.data.x, trainer.make_step(epoch, training=True))
        forward = progress.tests - before
        logits.square().mean().backward()
        backward = progress.tests - before - forward
        if epoch >= 1:
            # one write per line (print() writes the newline apart under PYTHONUNBUFFERED, and
            # Open MPI 4 forwards the ranks' pieces interleaved)
            sys.stdout.write(f"tests {ctx.rank} {epoch} {forward} {backward} {float(logits.sum())!r}\n")
            sys.stdout.flush()
    model.stale_state()                                   # nothing left in flight


def _order_worker(shard_dir: str, out: str) -> None:
    """Steps 0-3 of a 3-layer stale GCN through ``Trainer.train_step``; prints per step the
    halo gradients kept unposted at the Allreduce, the stale layers with that epoch's
    gradients on the wire after the step, and the gradients still kept after it."""
    from hpcgnn.codecs.base import FULL_PRECISION
    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.train import trainer as trainer_module
    from hpcgnn.train.build import prepare_trainer
    ctx = CommContext.from_world("cpu")
    cfg = load_config(None, ["model.layers=3", "model.hidden=64", "model.dropout=0.5",
                             "train.staleness=1"])
    trainer = prepare_trainer(ctx, cfg, shard_dir, Path(out), FULL_PRECISION)
    trainer.start()
    stales = [layer.prop.stale for layer in trainer.model.layers if hasattr(layer.prop, "stale")]
    assert len(stales) == 2
    seen = []
    allreduce = trainer_module.allreduce_sum_

    def watched(*args, **kwargs):
        seen.append(sum(len(s.late) for s in stales))
        return allreduce(*args, **kwargs)

    trainer_module.allreduce_sum_ = watched
    for epoch in range(4):
        trainer.train_step(epoch)
        posted = sum(epoch in s.bwd for s in stales)
        left = sum(len(s.late) for s in stales)
        sys.stdout.write(f"order {ctx.rank} {epoch} {seen[-1]} {posted} {left}\n")
        sys.stdout.flush()
    trainer.model.stale_state()                           # nothing left in flight


if __name__ == "__main__":
    if sys.argv[3] == "order":
        _order_worker(sys.argv[1], sys.argv[2])
    else:
        _worker(sys.argv[1], sys.argv[2], sys.argv[3])
