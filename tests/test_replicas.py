"""The ranks' copies of the weights: a rank whose optimizer rounds one weight otherwise (as a
GPU rank beside CPU ranks may, or a CPU of another instruction set) is found at that epoch's end
and every rank takes rank 0's copy, so the run ends with the weights of a run in which no copy
drifted, bit for bit; without the check, the drifted rank trains on with its own weights and
the result differs. A run whose copies never differ says nothing and sends nothing more.

This file is also the MPI worker (see ``__main__``): 3 ranks train Cora twice in one launch,
once untouched and once with rank 1 nudging one weight by one ulp after epoch 2's Adam step.
"""
from __future__ import annotations

import sys
from pathlib import Path

from conftest import check_ok, run_mpi

EPOCHS = 5
NUDGED_EPOCH = 2
WARNING = "the ranks' copies of the weights differ after the optimizer step (rank 1 against rank 0)"


def test_a_copy_that_drifts_is_found_and_replaced_by_rank_0s(shards, tmp_path):
    import torch
    proc = run_mpi(3, [__file__, str(shards("cora", 3)), str(tmp_path)], timeout=300)
    check_ok(proc)
    out = proc.stdout + proc.stderr
    assert out.count(WARNING) == 1, out[-3000:]                 # rank 0, once, the nudged run's
    assert f"epoch {NUDGED_EPOCH}: {WARNING}" in out, out[-3000:]
    finals = {run: [torch.load(tmp_path / f"{run}-rank{r}.pt") for r in range(3)]
              for run in ("clean", "nudged")}
    for run, ranks in finals.items():                           # every rank holds rank 0's copy
        for r in (1, 2):
            for name, value in ranks[0].items():
                assert torch.equal(ranks[r][name], value), (run, r, name)
    for name, value in finals["clean"][0].items():              # and the clean run's, bit for bit
        assert torch.equal(finals["nudged"][0][name], value), name


def _worker(shard_dir: str, out: str) -> None:
    import torch

    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.log import setup_logging
    from hpcgnn.train.build import prepare_trainer
    ctx = CommContext.from_world("cpu")
    setup_logging(ctx.rank, ctx.size)
    for run in ("clean", "nudged"):
        cfg = load_config("configs/cora.toml", [f"train.epochs={EPOCHS}", "train.eval_every=100"])
        trainer = prepare_trainer(ctx, cfg, shard_dir, Path(out) / run)
        if run == "nudged" and ctx.rank == 1:
            step, steps = trainer.opt.step, [0]

            def nudged_step(*args, **kw):          # this rank's Adam rounds one weight otherwise
                result = step(*args, **kw)
                if steps[0] == NUDGED_EPOCH:
                    with torch.no_grad():
                        w = trainer.params[0].view(-1)
                        w[7] = torch.nextafter(w[7], torch.tensor(float("inf")))
                steps[0] += 1
                return result

            trainer.opt.step = nudged_step
        trainer.start()
        trainer.run()
        torch.save({name: p.detach().clone() for name, p in trainer.model.named_parameters()},
                   Path(out) / f"{run}-rank{ctx.rank}.pt")


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
