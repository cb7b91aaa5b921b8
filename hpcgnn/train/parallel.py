"""The parallel algorithm's set-up, chosen by ``parallel.algorithm``: ``halo`` needs nothing
beyond the rank's shard; CAGNET's ``1.5d`` (``hpcgnn.comm.cagnet``), ``2d``
(``hpcgnn.comm.cagnet2d``) and ``3d`` (``hpcgnn.comm.cagnet3d``) each plan a process grid from
the rank count and the part count (``PLANS``: one entry per algorithm), load this rank's dense
rows and its blocks of ``A`` (``hpcgnn.data.blocks``) into an operator ``h -> A_i H`` (the
layers' ``SpmmPropagation``).

All of it is local (files only), so a rank that fails here fails before any collective; the
operator's ``connect()`` (the grid's communicators, collective) is called by
``Trainer.start()`` (through the model), after every rank agreed that none failed at start-up.
"""
from __future__ import annotations

import importlib
from typing import Callable

import numpy as np

from hpcgnn.comm.context import CommContext
from hpcgnn.config import Config
from hpcgnn.data.shardset import ShardSet
from hpcgnn.nn.graph import gcn_values, mean_values


def _plan(module: str, name: str) -> Callable:
    """``module.name``, imported when first called: the CAGNET modules need scipy, which a
    halo run never imports (0.2-0.4 s of every rank's start)."""
    def plan(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)
    plan.__name__ = plan.__qualname__ = name
    return plan


# parallel.algorithm -> plan(shards path, num_parts, rank, size, cfg.parallel) -> grid; a grid
# has ``dense_group`` (the (rank, ranks) whose part ``ShardSet.load`` gives it),
# ``block_groups()`` (which blocks of A it holds) and ``operator(ctx, blocks, meta)``
PLANS: dict[str, Callable] = {"1.5d": _plan("hpcgnn.comm.cagnet", "plan_15d"),
                              "2d": _plan("hpcgnn.comm.cagnet2d", "plan_2d"),
                              "3d": _plan("hpcgnn.comm.cagnet3d", "plan_3d")}


def edge_values(arch: str) -> Callable:
    """The model's normalisation of ``A`` for ``cagnet_blocks.adjacency_blocks``: GCN's
    symmetric values and self-loops ``1 / (d + 1)``, or SAGE-mean's ``1 / d`` (no self-loop)."""
    if arch == "gcn":
        return lambda g: (gcn_values(g), (1.0 / (g.degree + 1.0)).astype(np.float32))
    return lambda g: (mean_values(g), None)


def load_partitioned(ctx: CommContext, cfg: Config, shards: ShardSet):
    """(meta, shard of this rank's dense rows, operator) of a CAGNET algorithm (a schedule and
    staleness are refused by ``hpcgnn.combinations``). This rank reads its dense rows' parts
    and the graph datasets of the blocks of ``A`` its grid position holds; the operator gets
    the blocks (``hpcgnn.comm`` reads no files)."""
    from hpcgnn.comm.cagnet_wire import message_limit
    from hpcgnn.data.blocks import adjacency_blocks
    grid = PLANS[cfg.parallel.algorithm](shards.path, shards.num_parts, ctx.rank, ctx.size,
                                         cfg.parallel)
    shard = shards.load(*grid.dense_group)
    rows, cols = grid.block_groups()
    blocks = adjacency_blocks(shards.path, rows, cols, edge_values(cfg.model.arch))
    limit = message_limit(cfg.comm)
    return shards.meta, shard, grid.operator(ctx, blocks, shards.meta, limit)
