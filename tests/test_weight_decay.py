"""``train.weight_decay_on`` and the codec modules: the trainer's optimiser, given random
gradients, takes exactly the Adam step computed here with the decay each parameter should get
(the learned codec's encoder/decoder none by default); the default groups leave a 2-rank run's
losses as they were (one group: every model parameter decayed)."""
from __future__ import annotations

import signal

import pytest
import torch

WD, LR = 0.1, 0.01
SCHEDULE = 'codec = "learned"\nkind = "constant"\nratio = 4.0\n'


def _trainer(shard_dir, tmp_path, *sets):
    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.schedule import load_schedule
    from hpcgnn.train.build import prepare_trainer
    (tmp_path / "learned.toml").write_text(SCHEDULE)
    cfg = load_config("configs/cora.toml", [f"train.weight_decay={WD}", f"train.lr={LR}", *sets])
    return prepare_trainer(CommContext.from_world("cpu"), cfg, shard_dir, tmp_path / "run",
                           load_schedule(tmp_path / "learned.toml"))


def _adam_first_step(p: torch.Tensor, g: torch.Tensor, wd: float) -> torch.Tensor:
    """Adam's first step, written out: m_hat = g', v_hat = g'^2 with g' = g + wd * p."""
    g = g.double() + wd * p.double()
    return (p.double() - LR * g / (g.abs() + 1e-8)).float()


def _wanted_decay(name: str, mode: str, codec: bool) -> float:
    if ".encoder." in name or ".decoder." in name:
        return WD if codec else 0.0
    return {"all": WD, "weights": WD if name.endswith("weight") else 0.0,
            "first_layer": WD if name.startswith("layers.0.") else 0.0}[mode]


@pytest.mark.parametrize("mode,codec", [("all", False), ("first_layer", False), ("weights", False),
                                        ("all", True)])
def test_one_adam_step_decays_the_chosen_parameters(shards, tmp_path, mode, codec):
    tr = _trainer(shards("cora", 1), tmp_path, f"train.weight_decay_on={mode!r}",
                  f"train.weight_decay_codec={str(codec).lower()}")
    named = dict(tr.model.named_parameters())
    assert any(".encoder." in n for n in named) and any(".decoder." in n for n in named)
    gen = torch.Generator().manual_seed(1)
    before = {}
    for name, p in named.items():
        p.grad = torch.randn(p.shape, generator=gen)
        before[name] = p.detach().clone()
    tr.opt.step()
    for name, p in named.items():
        want = _adam_first_step(before[name], p.grad, _wanted_decay(name, mode, codec))
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7, msg=name)


def test_bad_mode_names_the_key(tmp_path):
    from hpcgnn.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="train.weight_decay_on = 'bias'.*first_layer"):
        load_config(None, ["train.weight_decay_on='bias'"])


@pytest.mark.mpi
def test_default_groups_keep_the_losses(shards, tmp_path):
    """2 ranks, default config: the same losses as one Adam over every parameter (1 rank, here)."""
    from conftest import check_ok, read_metrics, train
    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.train.build import prepare_trainer
    check_ok(train(2, shards("cora", 2), tmp_path / "run", "train.epochs=5", config="configs/cora.toml"))
    tr = prepare_trainer(CommContext.from_world("cpu"), load_config("configs/cora.toml", ["train.epochs=5"]),
                         shards("cora", 1), tmp_path / "ref")
    tr.opt = torch.optim.Adam(tr.params, lr=0.01, weight_decay=5e-4)       # as before the groups
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        tr.start()
        want = [tr.run_epoch(e)[0]["loss"] for e in range(5)]
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    got = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert got == pytest.approx(want, rel=1e-5)
