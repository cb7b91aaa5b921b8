"""The parallel algorithm's set-up, chosen by ``parallel.algorithm``: ``halo`` needs nothing
beyond the rank's shard; CAGNET's ``1.5d`` (``hpcgnn.comm.cagnet``), ``2d``
(``hpcgnn.comm.cagnet2d``) and ``3d`` (``hpcgnn.comm.cagnet3d``) each plan a process grid from
the rank count and the part count (``PLANS``: one entry per algorithm), load this rank's dense
rows and build its blocks of ``A`` into an operator ``h -> A_i H`` (``layer.spmm``).

All of it is local (files only), so a rank that fails here fails before any collective; the
operator's ``connect()`` (the grid's communicators, collective) is called by
``Trainer.start()``, after every rank agreed that none failed at start-up.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from hpcgnn.codecs.base import FULL_PRECISION, CompressionPolicy
from hpcgnn.comm.cagnet import plan_15d
from hpcgnn.comm.cagnet2d import plan_2d
from hpcgnn.comm.cagnet3d import plan_3d
from hpcgnn.comm.context import CommContext
from hpcgnn.config import Config
from hpcgnn.data.shard import read_meta
from hpcgnn.nn.graph import gcn_values, mean_values
from hpcgnn.train.inputs import load_part

# parallel.algorithm -> plan(shards, num_parts, rank, size, cfg.parallel) -> grid; a grid has
# ``dense_group`` (what ``load_part`` loads) and ``operator(ctx, shards, meta, values)``
PLANS: dict[str, Callable] = {"1.5d": plan_15d, "2d": plan_2d, "3d": plan_3d}


def edge_values(arch: str) -> Callable:
    """The model's normalisation of ``A`` for ``cagnet_blocks.adjacency_blocks``: GCN's
    symmetric values and self-loops ``1 / (d + 1)``, or SAGE-mean's ``1 / d`` (no self-loop)."""
    if arch == "gcn":
        return lambda g: (gcn_values(g), (1.0 / (g.degree + 1.0)).astype(np.float32))
    return lambda g: (mean_values(g), None)


def check_plain(cfg: Config, policy: CompressionPolicy) -> None:
    """CAGNET's algorithms run uncompressed and synchronous."""
    alg = cfg.parallel.algorithm
    if policy is not FULL_PRECISION or cfg.train.staleness:
        raise ValueError(f"parallel.algorithm = '{alg}' runs uncompressed and synchronous: drop "
                         f"--schedule and train.staleness, or use parallel.algorithm = 'halo'")


def load_partitioned(ctx: CommContext, cfg: Config, shards, policy: CompressionPolicy):
    """(meta, shard of this rank's dense rows, operator) of a CAGNET algorithm."""
    check_plain(cfg, policy)
    k = int(read_meta(shards)["num_parts"])
    grid = PLANS[cfg.parallel.algorithm](shards, k, ctx.rank, ctx.size, cfg.parallel)
    meta, shard = load_part(shards, *grid.dense_group)
    return meta, shard, grid.operator(ctx, shards, meta, edge_values(cfg.model.arch))

