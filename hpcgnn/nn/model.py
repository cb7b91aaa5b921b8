"""The GNN: a stack of GCN, SAGE or GAT layers (``LAYERS``, by ``model.arch``) with the layer's
activation between them (ReLU; ELU for GAT). Every layer drops out its own input
(counter-based, ``hpcgnn.nn.dropout``) and reaches its neighbours through its propagation
object (``hpcgnn.nn.propagation``). The layers are built by ``hpcgnn.train.build``.
Input ``(n_owned, F)`` features -> ``(n_owned, num_classes)`` logits.
"""
from __future__ import annotations

import torch
from torch import nn

from hpcgnn.comm.exchange import ExchangeStats, HaloExchanger
from hpcgnn.nn.gat import GATLayer
from hpcgnn.nn.layers import GCNLayer, HaloLayer, SAGELayer
from hpcgnn.nn.step import Step

LAYERS = {"gcn": GCNLayer, "sage": SAGELayer, "gat": GATLayer}


class GNN(nn.Module):
    """The model one rank holds: identical parameters on every rank, its own graph part."""

    def __init__(self, layers: list[HaloLayer], stats: ExchangeStats):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.stats = stats                       # the exchanges' counters, shared by all layers

    @property
    def exchangers(self) -> list[HaloExchanger]:
        return [layer.prop.exchanger for layer in self.layers if hasattr(layer.prop, "exchanger")]

    def connect(self) -> None:
        """Every propagation's collective set-up, after the start-up agreement."""
        for layer in self.layers:
            layer.prop.connect()

    def stale_state(self) -> list | None:
        """Every layer's propagation state (None when no layer has any); completes what is in
        flight, so nothing is left on the wire."""
        states = [layer.prop.state_dict() for layer in self.layers]
        if all(s is None for s in states):
            return None
        for layer in self.layers:                 # a progress thread, if any, has nothing left
            stale = getattr(layer.prop, "stale", None)
            if stale is not None:
                stale.progress.drain()
        return states

    def load_stale_state(self, states: list) -> None:
        for layer, state in zip(self.layers, states):
            layer.prop.load_state_dict(state)

    def fetch_kept_input(self, x: torch.Tensor, epoch: int) -> bool:
        """Fetch the halo rows of the features ``x`` that the first layer keeps (training's,
        ``keeps_input``, or evaluation's, ``eval_kept``) now: a resumed run does before its
        first step. Collective where it keeps them; False (nothing exchanged) elsewhere."""
        prop = self.layers[0].prop
        if not (getattr(prop, "keeps_input", False) or getattr(prop, "eval_kept", False)):
            return False
        prop.kept_input_halo(x, epoch)
        return True

    def post_late_gradients(self) -> None:
        """After the step's gradient Allreduce: the stale layers post the halo gradients their
        backward kept (``hpcgnn.comm.stale``), in the order the backward made them."""
        for layer in reversed(self.layers):
            stale = getattr(layer.prop, "stale", None)
            if stale is not None:
                stale.post_late_gradients()

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, step.layer(i))
            if i < last:
                x = layer.activation(x)
        return x
