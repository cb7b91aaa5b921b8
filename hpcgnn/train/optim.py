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


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, prefixes: tuple[str, ...] = ("",)
                   ) -> torch.optim.Adam:
    return torch.optim.Adam(param_groups(model, cfg, prefixes), lr=cfg.lr, betas=tuple(cfg.betas))
