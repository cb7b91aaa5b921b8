"""The per-step settings: everything a forward pass needs to know beyond its input, as data.

A ``Step`` is made by the trainer for every training step and every evaluation (and by RETEXO
and ``predict`` for theirs) and passed down the model; no layer or exchanger holds a step's
settings between calls. ``step.layer(i)`` is layer ``i``'s view: the dropout keys (seed, epoch,
layer; ``hpcgnn.nn.dropout``) and the ``ExchangeSettings`` of its halo exchange (the epoch of the
codec keys, the forward and backward codecs).
"""
from __future__ import annotations

from dataclasses import dataclass

from hpcgnn.comm.exchange import ExchangeSettings


@dataclass(frozen=True)
class LayerStep:
    """Layer ``layer``'s part of one step."""

    epoch: int
    training: bool
    seed: int
    layer: int
    exchange: ExchangeSettings


@dataclass(frozen=True)
class Step:
    """One forward pass: its epoch, train or eval, the dropout seed, and per layer the
    exchange settings (empty: the identity codec in every layer, keyed by ``epoch``)."""

    epoch: int
    training: bool
    seed: int = 0
    exchanges: tuple[ExchangeSettings, ...] = ()

    def layer(self, i: int) -> LayerStep:
        ex = self.exchanges[i] if self.exchanges else ExchangeSettings(self.epoch)
        return LayerStep(self.epoch, self.training, self.seed, i, ex)
