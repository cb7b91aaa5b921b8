"""The optimiser: Adam over parameter groups chosen by ``train.weight_decay_on``.

``all``          every model parameter (weights and biases) is decayed — the default, as before
``first_layer``  only layer 0's parameters (Kipf & Welling's GCN, and PyG's GCN example)
``weights``      only the weight matrices (ndim >= 2), no biases
The ``learned`` codec's encoder/decoder (``layers.i.encoder``, ``layers.i.decoder``, registered
through ``policy.layer_modules``) are decayed only with ``train.weight_decay_codec = true``.
Adam's decay is coupled (``grad + wd * p``), i.e. the gradient of ``wd/2 * ||p||^2`` in the loss.
"""
from __future__ import annotations

import sys

import torch

from hpcgnn.config import TrainConfig

CODEC_MODULES = ("encoder", "decoder")


def is_codec_param(name: str) -> bool:
    """``layers.0.encoder.weight`` -> True: a parameter of a codec module, not of the model."""
    return any(part in CODEC_MODULES for part in name.split(".")[:-1])


def decays(name: str, param: torch.Tensor, cfg: TrainConfig) -> bool:
    """Whether ``param`` (named as in ``model.named_parameters()``) gets weight decay."""
    if is_codec_param(name):
        return cfg.weight_decay_codec
    if cfg.weight_decay_on == "first_layer":
        return name.startswith("layers.0.")
    if cfg.weight_decay_on == "weights":
        return param.ndim >= 2
    return True


def param_groups(model: torch.nn.Module, cfg: TrainConfig, prefixes: tuple[str, ...] = ("",)
                 ) -> list[dict]:
    """[{params, weight_decay}, ...]: decayed then not decayed, each in model order; empty
    groups left out (so ``all`` without codec modules is one group, exactly as before).
    ``prefixes``: only parameters whose name starts with one of them (RETEXO: one stage's)."""
    on, off = [], []
    for name, p in model.named_parameters():
        if not name.startswith(prefixes):
            continue
        (on if decays(name, p, cfg) else off).append(p)
    groups = [{"params": on, "weight_decay": cfg.weight_decay}, {"params": off, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def skip_dynamo_import() -> bool:
    """Spare each rank the import of ``torch._dynamo`` (1.3 s of CPU on the development
    machine, a third of a rank's start-up) that the first call of an optimiser method triggers:
    ``torch.optim.Optimizer``'s methods are wrapped by ``torch._compile._disable_dynamo``, which
    imports dynamo only to mark them as not to be traced, and caches the result on the function
    (``__dynamo_disable``, torch >= 2.4). hpcgnn compiles nothing, so the cache is given the
    plain function. Returns whether any method was spared; with a torch that caches nothing, or
    once dynamo is imported anyway, it does nothing."""
    if "torch._dynamo" in sys.modules:
        return False
    spared = False
    for wrapper in vars(torch.optim.Optimizer).values():
        fn, code = getattr(wrapper, "__wrapped__", None), getattr(wrapper, "__code__", None)
        if fn is not None and getattr(code, "co_qualname", "") == "_disable_dynamo.<locals>.inner":
            if getattr(fn, "__dynamo_disable", None) is None:
                setattr(fn, "__dynamo_disable", fn)
                spared = True
    return spared


_ADAM_STEP = getattr(torch.optim.Adam.step, "__wrapped__", None)
if getattr(getattr(torch.optim.Adam.step, "__code__", None), "co_qualname", "") != \
        "_use_grad_for_differentiable.<locals>._use_grad":
    _ADAM_STEP = None                   # another torch: its own step, as it comes


class Adam(torch.optim.Adam):
    """torch's Adam, whose ``step`` runs torch's own update under ``no_grad`` without the
    wrapper that imports ``torch._dynamo`` at every call to place two graph breaks (no-ops
    outside ``torch.compile``); the same arithmetic, bit for bit, and the same state."""

    def step(self, closure=None):
        if _ADAM_STEP is None or self.defaults.get("differentiable"):
            return super().step(closure)
        with torch.no_grad():
            return _ADAM_STEP(self, closure)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, prefixes: tuple[str, ...] = ("",)
                   ) -> torch.optim.Adam:
    skip_dynamo_import()
    return Adam(param_groups(model, cfg, prefixes), lr=cfg.lr, betas=tuple(cfg.betas))
