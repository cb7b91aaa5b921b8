"""The RETEXO model: ``layers`` GCN or SAGE convolutions trained one at a time (stages), each
non-last stage with a LayerNorm and a linear head to the classes (``hpcgnn.train.retexo``).

Stage ``l < L-1``: ``h = ReLU(LayerNorm(conv_l(x)))`` is the stage's embedding (the next stage's
input), ``head_l(h)`` ``(n, C)`` its logits. Stage ``L-1``: ``conv_{L-1}(x)`` ``(n, C)`` are the
logits (no norm, no head), as in aashishkolluri/retexo-distributed's ``get_nth_layer``.

The convolutions are the full model's ``GCNLayer`` / ``SAGELayer`` (built in the same order,
so a seed gives them the same initial weights as ``GNN``'s); each keeps its halo propagation,
whose exchanger RETEXO uses once per stage. Shapes: ``x`` ``(n_owned, F_l)``, halo rows ``(n_halo, F_l)``.
"""
from __future__ import annotations

import torch
from torch import nn

from hpcgnn.comm.exchange import ExchangeStats, HaloExchanger
from hpcgnn.nn.step import Step


class RetexoGNN(nn.Module):
    """Convolutions ``layers[l]``, and for ``l < L-1`` ``norms[l]`` (LayerNorm(hidden)) and
    ``heads[l]`` (Linear(hidden, C)). Identical parameters on every rank. The convolutions are
    built by ``hpcgnn.train.build`` (synchronous halo propagation, no dropout of their own:
    RETEXO's trainer drops the stage input)."""

    def __init__(self, layers: list[nn.Module], stats: ExchangeStats, hidden: int,
                 num_classes: int):
        super().__init__()
        self.graph = layers[0].graph
        self.stats = stats
        self.layers = nn.ModuleList(layers)
        stages = len(layers) - 1
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(stages))
        self.heads = nn.ModuleList(nn.Linear(hidden, num_classes) for _ in range(stages))

    @property
    def exchangers(self) -> list[HaloExchanger]:
        return [layer.prop.exchanger for layer in self.layers]

    def stage_prefixes(self, stage: int) -> tuple[str, ...]:
        """``named_parameters`` prefixes of stage ``stage``'s parameters."""
        if stage == len(self.layers) - 1:
            return (f"layers.{stage}.",)
        return (f"layers.{stage}.", f"norms.{stage}.", f"heads.{stage}.")

    def stage_parameters(self, stage: int) -> list[tuple[str, nn.Parameter]]:
        prefixes = self.stage_prefixes(stage)
        return [(n, p) for n, p in self.named_parameters() if n.startswith(prefixes)]

    def aggregate(self, x: torch.Tensor, x_halo: torch.Tensor) -> torch.Tensor:
        """``A [x; x_halo]`` ``(n_owned, F)``: the local sparse products, no communication."""
        return self.graph.aggregate(x, x_halo)

    def stale_state(self) -> None:
        """No stale exchange (the checkpoint asks)."""
        return None

    def post_late_gradients(self) -> None:
        """No stale exchange: nothing kept for after the Allreduce (the trainer asks)."""

    def stage_forward(self, stage: int, x: torch.Tensor, halo: torch.Tensor | None = None,
                      agg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits ``(n_owned, C)``, embedding ``(n_owned, hidden)`` or None for the last
        stage) of stage ``stage`` from its input ``x`` and either its halo rows ``halo`` or
        ``agg = aggregate(x, halo)`` (precomputed once per stage)."""
        layer = self.layers[stage]
        h = layer.from_aggregate(x, agg) if agg is not None else layer.with_halo(x, halo)
        if stage == len(self.layers) - 1:
            return h, None
        emb = torch.relu(self.norms[stage](h))
        return self.heads[stage](emb), emb

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """The trained stack on the features, one exchange per layer through the layers'
        exchangers (evaluation only: ``hpcgnn predict``): ``(n_owned, C)`` logits."""
        if step.training:
            raise RuntimeError("RetexoGNN trains stage by stage (hpcgnn.train.retexo), not as a stack")
        for i, layer in enumerate(self.layers):
            x = layer(x, step.layer(i))
            if i < len(self.layers) - 1:
                x = torch.relu(self.norms[i](x))
        return x
