"""The GNN: ``layers`` GCN, SAGE or GAT layers (``LAYERS``, by ``model.arch``), the layer's
activation between them (ReLU; ELU for GAT), counter-based dropout on every layer's input.
Input ``(n_owned, F)`` features -> ``(n_owned, num_classes)`` logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hpcgnn.codecs.base import FULL_PRECISION, CompressionPolicy
from hpcgnn.comm.context import CommContext
from hpcgnn.comm.exchange import ExchangeStats, HaloExchanger
from hpcgnn.comm.plan import HaloPlan
from hpcgnn.comm.progress import Progress
from hpcgnn.comm.stale import StaleExchange
from hpcgnn.config import ModelConfig
from hpcgnn.nn.dropout import apply_keep, counter_dropout, keep_mask
from hpcgnn.nn.graph import LocalGraph
from hpcgnn.nn.gat import GATLayer
from hpcgnn.nn.layers import GCNLayer, SAGELayer

LAYERS = {"gcn": GCNLayer, "sage": SAGELayer, "gat": GATLayer}


@dataclass(frozen=True)
class Step:
    """What a forward pass needs to know beyond the input: which epoch, train or eval."""

    epoch: int
    training: bool


class GNN(nn.Module):
    """The model one rank holds: identical parameters on every rank, its own graph part."""

    def __init__(self, cfg: ModelConfig, in_dim: int, num_classes: int, graph: LocalGraph,
                 plan: HaloPlan, ctx: CommContext, global_id: torch.Tensor, seed: int,
                 overlap: bool = False, policy: CompressionPolicy = FULL_PRECISION,
                 staleness: int = 0, smoothing: float = 0.0, spmm=None):
        super().__init__()
        self.cfg, self.seed, self.global_id = cfg, seed, global_id
        self.stats = ExchangeStats()
        self.layers = nn.ModuleList()
        progress = Progress(ctx) if staleness else None      # one for all layers' exchanges
        kind = LAYERS[cfg.arch]
        for i, (a, b, extra) in enumerate(kind.stack(cfg, in_dim, num_classes)):
            exch = HaloExchanger(ctx, plan, layer=i, seed=seed, stats=self.stats, overlap=overlap)
            needs_grad = i > 0                   # the input features need no gradient
            width = kind.wire_width(a, b, needs_grad, **extra)
            self.layers.append(kind(a, b, graph, exch, policy.layer_modules(i, width),
                                    input_needs_grad=needs_grad, **extra))
            if staleness:
                if self.layers[-1].encoder is not None:
                    raise ValueError("train.staleness >= 1 does not combine with the 'learned' "
                                     "codec (its encoder would train on rows of another epoch); "
                                     "use truncate, random, quant or sample, or staleness = 0")
                self.layers[-1].stale = StaleExchange(exch, staleness, smoothing, progress)
            self.layers[-1].spmm = spmm

    @property
    def exchangers(self) -> list[HaloExchanger]:
        return [layer.exchanger for layer in self.layers]

    def stale_state(self) -> list[dict] | None:
        """Every layer's stale-exchange state (None without staleness); completes what is in flight."""
        if self.layers[0].stale is None:
            return None
        states = [layer.stale.state_dict() for layer in self.layers]
        self.layers[0].stale.progress.drain()            # nothing is left in flight: the thread ends
        return states

    def load_stale_state(self, states: list[dict]) -> None:
        for layer, state in zip(self.layers, states):
            layer.stale.load_state_dict(state)

    def input_nonzeros(self, x: torch.Tensor):
        """Non-zeros of the (constant) input features when they are sparse, cached; else None."""
        key = (x.data_ptr(), x._version, tuple(x.shape))
        if getattr(self, "_nz_key", None) != key:
            sparse = x.numel() and float(torch.count_nonzero(x)) / x.numel() < 0.5
            self._nz_key, self._nz = key, x.nonzero(as_tuple=True) if sparse else None
        return self._nz

    def _stale_dropout(self, x: torch.Tensor, i: int, epoch: int, nz) -> torch.Tensor:
        """Layer ``i``'s dropout when its exchange is stale: also tells the stale exchange how
        to make the sent input rows (each once) again under an earlier epoch's mask
        (``remask``), for the late halo gradients. A dense input's mask of the sent rows is
        kept for the 2s epochs until then (bool, sent rows x ``F_in``); a mask not kept (after a
        resume) or a sparse input's is made again from the counters."""
        stale, p = self.layers[i].stale, self.cfg.dropout
        send = stale.sent[0]                     # the sent rows, each once
        kept = stale.sent_masks
        for old in [e for e in kept if e < epoch - 2 * stale.s]:
            del kept[old]
        if nz is None:
            keep = keep_mask(self.global_id, x.shape[1], p, self.seed, epoch, i)
            kept[epoch] = keep.index_select(0, send)
            out = apply_keep(x, keep, p)
        else:
            out = counter_dropout(x, self.global_id, p, self.seed, epoch, i, True, nz)

        def remask(e: int) -> torch.Tensor:
            rows = x.index_select(0, send)
            if e in kept:
                return apply_keep(rows, kept[e], p)
            rows_nz = rows.nonzero(as_tuple=True) if nz is not None else None
            return counter_dropout(rows, self.global_id.index_select(0, send), p, self.seed, e,
                                   i, True, rows_nz)
        stale.remask = remask
        return out

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            nz = self.input_nonzeros(x) if (i == 0 and step.training and self.cfg.dropout) else None
            if layer.stale is not None:
                layer.stale.remask = None
            if layer.stale is not None and step.training and self.cfg.dropout and x.numel():
                x = self._stale_dropout(x, i, step.epoch, nz)
            else:
                x = counter_dropout(x, self.global_id, self.cfg.dropout, self.seed, step.epoch, i,
                                    step.training, nz)
            x = layer(x)
            if i < len(self.layers) - 1:
                x = layer.activation(x)
        return x
