"""The parallel algorithm's set-up, chosen by ``parallel.algorithm``: ``halo`` needs nothing
beyond the rank's shard; ``1.5d`` (CAGNET, ``hpcgnn.comm.cagnet``) builds the process grid
(collective: every rank calls it in the same order) and this rank's block columns of ``A``.
"""
from __future__ import annotations

from hpcgnn.comm.cagnet import ProcessGrid, Spmm15D, block_columns, check_rank_count, part_sizes
from hpcgnn.comm.context import CommContext
from hpcgnn.config import Config
from hpcgnn.nn.graph import gcn_values, mean_values
from hpcgnn.train.inputs import load_part


def load_15d(ctx: CommContext, cfg: Config, shards):
    """(meta, shard of my row group, Spmm15D) for a K-part set on K * c ranks (a schedule and
    staleness are refused by ``hpcgnn.combinations``)."""
    c = cfg.parallel.replication
    k = check_rank_count(shards, ctx, c)
    grid = ProcessGrid.make(ctx, c)
    meta, shard = load_part(shards, grid.i, k)
    values = gcn_values(shard) if cfg.model.arch == "gcn" else mean_values(shard)
    blocks = block_columns(shard, shards, values, grid.columns, cfg.model.arch)
    return meta, shard, Spmm15D(grid, blocks, part_sizes(shards, k), stats=None)
