"""The one place a run's pieces are chosen and built from its config: the parallel algorithm's
set-up, the propagation object of every layer, the layers, the model and the trainer of the
training method. Each choice is a table entry; the trainer then drives whatever was built.

- ``ALGORITHMS`` (``parallel.algorithm``): reads this rank's shard and makes the distributed
  SpMM operator where the algorithm has one (``halo``: none; ``1.5d``, ``2d``, ``3d``: CAGNET's).
- ``PROPAGATIONS`` (from the algorithm and ``train.staleness``): how each layer reaches its
  neighbours' rows (``hpcgnn.nn.propagation``).
- ``LAYERS`` (``model.arch``, ``hpcgnn.nn.model``): the layer class.
- ``METHODS`` (``train.method``): the trainer class and the model that wraps the layers.

Everything unsupported is refused first, by ``hpcgnn.combinations.check_combination``. Nothing
here communicates: every rank can fail cleanly before the start-up agreement
(``hpcgnn.train.launch``).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from hpcgnn.codecs import native
from hpcgnn.codecs.base import FULL_PRECISION, CompressionPolicy
from hpcgnn.combinations import check_combination
from hpcgnn.comm.context import CommContext
from hpcgnn.comm.exchange import ExchangeStats, HaloExchanger
from hpcgnn.comm.plan import HaloPlan
from hpcgnn.comm.progress import Progress
from hpcgnn.comm.settings import CommSettings, check_halo_message, check_message_limit
from hpcgnn.comm.stale import StaleExchange
from hpcgnn.config import Config
from hpcgnn.data.shard import Shard, num_train
from hpcgnn.log import get_logger
from hpcgnn.nn.graph import LocalGraph
from hpcgnn.nn.model import GNN, LAYERS
from hpcgnn.nn.propagation import (ConstantPropagation, HaloPropagation, SpmmPropagation,
                                   StalePropagation)
from hpcgnn.nn.retexo import RetexoGNN
from hpcgnn.train import checkpoint as ckpt
from hpcgnn.data.shardset import ShardSet
from hpcgnn.train.inputs import part_tensors
from hpcgnn.train.parallel import load_partitioned
from hpcgnn.train.records import RunRecord
from hpcgnn.train.retexo import RetexoTrainer
from hpcgnn.train.trainer import RunOptions, RunParts, Trainer


@dataclass
class AlgorithmSetup:
    """What a parallel algorithm's set-up gives the builder for one rank."""

    meta: dict
    shard: Shard
    spmm: object | None = None      # the distributed SpMM (CAGNET), None for the halo algorithm

    def row_copies(self, size: int) -> int:
        """On how many of the ``size`` ranks each node's row lives (CAGNET's replicas)."""
        return 1 if self.spmm is None else size // self.spmm.grid.dense_group[1]


def load_halo(ctx: CommContext, cfg: Config, shards: ShardSet) -> AlgorithmSetup:
    """The halo algorithm: this rank's part (K/R parts merged when R divides K)."""
    return AlgorithmSetup(shards.meta, shards.load(ctx.rank, ctx.size))


def load_cagnet(ctx: CommContext, cfg: Config, shards: ShardSet) -> AlgorithmSetup:
    """CAGNET's 1.5D, 2D or 3D (``hpcgnn.train.parallel.PLANS``): this rank's dense rows and
    its distributed SpMM operator."""
    return AlgorithmSetup(*load_partitioned(ctx, cfg, shards))


ALGORITHMS: dict[str, Callable[[CommContext, Config, ShardSet], AlgorithmSetup]] = {
    "halo": load_halo, "1.5d": load_cagnet, "2d": load_cagnet, "3d": load_cagnet}


@dataclass(frozen=True)
class Method:
    """A training method: the trainer that drives it and the model that wraps its layers."""

    trainer: type
    model: Callable[..., torch.nn.Module]
    layer_dropout: bool              # layers drop out their own input (RETEXO's trainer does it)


METHODS = {
    "full": Method(Trainer, lambda layers, stats, cfg, classes: GNN(layers, stats), True),
    "retexo": Method(RetexoTrainer, lambda layers, stats, cfg, classes:
                     RetexoGNN(layers, stats, cfg.model.hidden, classes), False),
}


# -- propagations ------------------------------------------------------------------------------
@dataclass
class Wiring:
    """What the propagations of one model share."""

    ctx: CommContext
    cfg: Config
    plan: HaloPlan | None
    stats: ExchangeStats
    spmm: object | None
    comm: CommSettings = CommSettings()
    progress: Progress | None = None


def propagation_kind(cfg: Config, ctx: CommContext, spmm, layer: int) -> str:
    """``spmm`` (CAGNET), ``constant`` / ``stale`` (a stale run's first / later layers; a
    synchronous run's first layer with ``train.keep_features``) or ``halo``. Staleness needs
    peers: one rank runs synchronously."""
    if spmm is not None:
        return "spmm"
    if cfg.train.staleness and ctx.size > 1 and cfg.train.method == "full":
        return "constant" if layer == 0 else "stale"
    if layer == 0 and cfg.train.keep_features and ctx.size > 1 and cfg.train.method == "full":
        return "constant"                      # the features' halo rows, fetched once
    return "halo"


def _exchanger(w: Wiring, layer: int) -> HaloExchanger:
    return HaloExchanger(w.ctx, w.plan, layer=layer, seed=w.cfg.train.seed, stats=w.stats,
                         overlap=w.cfg.train.overlap, comm=w.comm)


def _progress(w: Wiring) -> Progress:
    """The model's one ``Progress`` of its stale exchanges (``[comm] progress``)."""
    w.progress = w.progress or Progress(w.ctx, w.comm.progress)
    return w.progress


def _stale(w: Wiring, layer: int) -> StalePropagation:
    ex = _exchanger(w, layer)
    t = w.cfg.train
    return StalePropagation(ex, StaleExchange(ex, t.staleness, t.smoothing, _progress(w)))


def silent_layers(cfg: Config, ctx: CommContext) -> frozenset:
    """The layers whose training steps exchange nothing: a first layer on kept feature rows
    (``constant``), which a closed-loop schedule leaves out."""
    return frozenset(i for i in range(cfg.model.layers)
                     if propagation_kind(cfg, ctx, None, i) == "constant")


def eval_kept(cfg: Config, layer: int, kind: str) -> bool:
    """Whether evaluation runs layer ``layer`` (``kind`` of ``propagation_kind``) on the
    features' halo rows kept on the rank (``train.eval_features``): the first layer only."""
    if layer != 0 or cfg.train.method != "full":
        return False
    mode = cfg.train.eval_features
    return mode == "kept" or (mode == "auto" and kind == "constant")


PROPAGATIONS: dict[str, Callable[[Wiring, int], object]] = {
    "halo": lambda w, i: HaloPropagation(_exchanger(w, i), eval_kept=eval_kept(w.cfg, i, "halo")),
    "constant": lambda w, i: ConstantPropagation(_exchanger(w, i), _progress(w),
                                                 eval_kept=eval_kept(w.cfg, i, "constant")),
    "stale": _stale,
    "spmm": lambda w, i: SpmmPropagation(w.spmm),
}


# -- the model ---------------------------------------------------------------------------------
def build_model(ctx: CommContext, cfg: Config, policy: CompressionPolicy, setup: AlgorithmSetup
                ) -> torch.nn.Module:
    """The model of ``train.method`` with ``model.arch`` layers over this rank's part, with the
    same initial parameters on every rank (seeded by ``train.seed``)."""
    shard, method = setup.shard, METHODS[cfg.train.method]
    classes = int(setup.meta["num_classes"])
    graph = LocalGraph.from_shard(shard, cfg.model.arch, ctx.device)
    plan = HaloPlan.from_shard(shard, ctx.device) if setup.spmm is None else None
    wiring = Wiring(ctx, cfg, plan, ExchangeStats(), setup.spmm, CommSettings.resolve(cfg.comm))
    if setup.spmm is not None:
        setup.spmm.stats = wiring.stats
    kind = LAYERS[cfg.model.arch]
    dropout = cfg.model.dropout if method.layer_dropout else 0.0
    torch.manual_seed(cfg.train.seed)                  # same initial parameters on every rank
    layers = []
    for i, (a, b, extra) in enumerate(kind.stack(cfg.model, shard.feature_dim, classes)):
        prop = PROPAGATIONS[propagation_kind(cfg, ctx, setup.spmm, i)](wiring, i)
        modules = policy.layer_modules(i, kind.wire_width(a, b, i > 0, **extra))
        layers.append(kind(a, b, graph, prop, input_needs_grad=i > 0, dropout=dropout,
                           codec_modules=modules, sparse_input=i == 0, **extra))
    return method.model(layers, wiring.stats, cfg, classes).to(ctx.device)


def release_features(shard: Shard, x: torch.Tensor) -> None:
    """Drop the shard's feature rows once ``x`` (the trainer's) is a copy of them (normalised,
    or on a GPU), keeping a zero-stride placeholder of their shape: otherwise the rank held
    them twice while its model was built."""
    f = shard.features
    if x.device.type == "cpu" and f.size and x.data_ptr() == f.ctypes.data:
        return
    shard.features = np.broadcast_to(np.zeros((), f.dtype), f.shape)


def with_comm_settings(ctx: CommContext, comm: CommSettings) -> CommContext:
    """The context with ``[comm] cuda_aware`` (``auto`` keeps what the library said) and
    ``max_message`` (the trainer's own collectives go in pieces of it) applied."""
    ctx = replace(ctx, max_message=comm.max_message)
    if comm.cuda_aware == "auto" or ctx.device.type != "cuda":
        return ctx
    return replace(ctx, cuda_aware=comm.cuda_aware == "true")


# -- the trainer -------------------------------------------------------------------------------
def prepare_trainer(ctx: CommContext, cfg: Config, shards: str | Path, run_dir: str | Path,
                    policy: CompressionPolicy = FULL_PRECISION, resume: bool = False,
                    force: bool = False, stop_after: int | None = None,
                    training: bool = True, source: str = "<config>") -> Trainer:
    """Check the combination, read this rank's shard (and, on rank 0, the checkpoint), build
    the model and the trainer of ``train.method``; ``training``: refuse a shard set without a
    training node (``predict`` passes False); ``source``: how errors name the config (its file).
    Local work only (no collectives)."""
    check_combination(cfg, policy, source)
    if ctx.device.type == "cpu":     # load the C kernels now (or build them, once: seconds), not
        native.lib()                 # inside epoch 0's timing where env/setup.sh did not build them
        missing = native.unavailable()
        if missing and ctx.local_rank == 0:          # once a node: its ranks all fail alike
            get_logger().warning(
                "no C kernels on host %s (%s): its ranks run the torch path, slower, and may "
                "pace the job. Fix: a C compiler on this node (CC, default cc), or build them "
                "where hpcgnn is installed (bash env/setup.sh, or python -m hpcgnn.codecs.native); "
                "HPCGNN_NATIVE=0 chooses the torch path without this warning",
                socket.gethostname(), missing)
    comm = CommSettings.resolve(cfg.comm)
    ctx = with_comm_settings(ctx, comm)
    if cfg.parallel.algorithm == "halo":          # CAGNET's operators check theirs (below)
        check_halo_message(cfg.comm, ctx.size, source)
    policy = policy.bind(cfg.train.epochs, cfg.model.layers, silent=silent_layers(cfg, ctx))
    shard_set = ShardSet.open(shards)                  # meta.json, read once
    setup = ALGORITHMS[cfg.parallel.algorithm](ctx, cfg, shard_set)
    if setup.spmm is not None:                    # CAGNET: what its grid's calls must carry
        check_message_limit(comm, *setup.spmm.least_message(), source)
    if training:
        shard_set.check_trainable(num_train(setup.shard))
    data = part_tensors(setup.shard, cfg.data.normalize_features, ctx.device)
    release_features(setup.shard, data.x)
    model = build_model(ctx, cfg, policy, setup)
    run_dir = Path(run_dir)
    options = RunOptions(
        resume=resume, force=force, stop_after=stop_after,
        record=RunRecord.make(cfg, getattr(policy, "path", None), shard_set),
        # rank 0 reads the checkpoint (and broadcasts it at start); a stale run's ranks read it
        # themselves, to check their own rank file against it
        resume_bytes=ckpt.read_checkpoint_bytes(run_dir)
        if resume and (ctx.is_root or cfg.train.staleness > 0) else None)
    parts = RunParts(ctx, cfg, run_dir, setup.meta, data, model, policy,
                     setup.row_copies(ctx.size))
    return METHODS[cfg.train.method].trainer(parts, options)
