"""``hpcgnn.train.optim``'s Adam: torch's update, bit for bit, without importing ``torch._dynamo``
(1.3 s of CPU a rank on the development machine, which every MPI launch paid per rank)."""
import subprocess
import sys

import pytest
import torch

from hpcgnn.config import TrainConfig
from hpcgnn.train import optim


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _steps(opt, model, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("betas,decay_on", [((0.9, 0.999), "all"), ((0.7, 0.99), "weights")])
def test_steps_and_state_equal_torch_adam_bit_for_bit(betas, decay_on):
    cfg = TrainConfig(lr=0.01, weight_decay=5e-4, weight_decay_on=decay_on, betas=betas)
    ours, theirs = _model(0), _model(0)
    a = optim.make_optimizer(ours, cfg)
    b = torch.optim.Adam(optim.param_groups(theirs, cfg), lr=cfg.lr, betas=betas)
    assert type(a) is optim.Adam and len(a.param_groups) == len(b.param_groups)
    _steps(a, ours, 6, seed=1)
    _steps(b, theirs, 6, seed=1)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)
    # the state is torch's: each loads the other's and they go on equal
    a2 = optim.make_optimizer(ours, cfg)
    a2.load_state_dict(b.state_dict())
    b.load_state_dict(a.state_dict())
    _steps(a2, ours, 3, seed=2)
    _steps(b, theirs, 3, seed=2)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)


@pytest.mark.skipif(optim._ADAM_STEP is None, reason="this torch's Adam.step is not handled")
def test_an_optimiser_round_leaves_torch_dynamo_unimported():
    code = """
import sys, torch
from hpcgnn.config import TrainConfig
from hpcgnn.train.optim import make_optimizer
m = torch.nn.Linear(4, 2)
opt = make_optimizer(m, TrainConfig())
m(torch.ones(3, 4)).sum().backward()
opt.step(); opt.zero_grad(); opt.load_state_dict(opt.state_dict())
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
