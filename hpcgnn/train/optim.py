"""The optimiser: Adam over parameter groups chosen by ``train.weight_decay_on``.

``all``          every model parameter (weights and biases) is decayed — the default, as before
``first_layer``  only layer 0's parameters (Kipf & Welling's GCN, and PyG's GCN example)
``weights``      only the weight matrices (ndim >= 2), no biases
The ``learned`` codec's encoder/decoder (``layers.i.encoder``, ``layers.i.decoder``, registered
through ``policy.layer_modules``) are decayed only with ``train.weight_decay_codec = true``.
Adam's decay is coupled (``grad + wd * p``), i.e. the gradient of ``wd/2 * ||p||^2`` in the loss.
"""
from __future__ import annotations

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


def _unwrapped(method, wrapper: str):
    """The function ``method`` wraps, where its wrapper is torch's ``wrapper`` (a code object's
    qualified name); None for any other torch, whose method then stays as it comes."""
    code, inner = getattr(method, "__code__", None), getattr(method, "__wrapped__", None)
    return inner if inner is not None and getattr(code, "co_qualname", "") == wrapper else None


_USE_GRAD = "_use_grad_for_differentiable.<locals>._use_grad"
_DISABLE_DYNAMO = "_disable_dynamo.<locals>.inner"
_ADAM_STEP = _unwrapped(torch.optim.Adam.step, _USE_GRAD)


class Adam(torch.optim.Adam):
    """torch's Adam without the wrappers that import ``torch._dynamo`` (1.3 s of CPU a rank on
    the development machine, a third of its start-up) only to mark graph breaks and untraced
    methods, which do nothing outside ``torch.compile`` (hpcgnn compiles nothing): ``step`` runs
    torch's own update under ``no_grad``, and ``add_param_group``, ``zero_grad``,
    ``state_dict`` and ``load_state_dict`` are torch's functions unwrapped (set below). The
    same arithmetic, bit for bit, and the same state."""

    def step(self, closure=None):
        if _ADAM_STEP is None or self.defaults.get("differentiable"):
            return super().step(closure)
        with torch.no_grad():
            return _ADAM_STEP(self, closure)


for _name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
    _plain = _unwrapped(getattr(torch.optim.Optimizer, _name), _DISABLE_DYNAMO)
    if _plain is not None:
        setattr(Adam, _name, _plain)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, prefixes: tuple[str, ...] = ("",)
                   ) -> torch.optim.Adam:
    return Adam(param_groups(model, cfg, prefixes), lr=cfg.lr, betas=tuple(cfg.betas))
