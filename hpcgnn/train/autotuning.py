"""The trainer's side of ``kind = "auto"`` (``hpcgnn.autotune``): what a step measures, the
reduction of the figures over ranks, and rank 0's decision handed to every rank.

After a probe epoch's training step, every rank in the same order:
  one Allreduce (SUM) of ``||x||^2`` and the candidates' squared errors,
  one Allreduce (MAX) of the candidates' seconds and bytes and of the wire samples,
  rank 0 decides (``AutoPolicy.decide``), one Bcast of the new controller state (a few kB).
Per layer and direction ``1 + |candidates|`` summed and ``2 |candidates| + 1`` maxed values,
plus 3 per probed exchange (bytes, wire seconds, the layer's compute between post and wait).
Other checks decide from the state alone (no communication).
"""
from __future__ import annotations

from hpcgnn.autotune import DIRECTIONS, ExchangeFigures, Figures
from hpcgnn.codecs.base import IDENTITY
from hpcgnn.codecs.quant import FP32
from hpcgnn.comm.collectives import max_float64, sum_float64
from hpcgnn.comm.context import CommContext
from hpcgnn.comm.exchange import ExchangeSettings, ExchangeStats, ProbeFigures


def with_probes(settings: ExchangeSettings, policy, epoch: int, layer: int,
                num_layers: int) -> ExchangeSettings:
    """``settings`` with the candidates ``policy`` measures at ``epoch`` in each direction."""
    fwd, bwd = (policy.probe(epoch, layer, num_layers, d) for d in DIRECTIONS)
    if not (fwd or bwd):
        return settings
    return ExchangeSettings(settings.epoch, settings.forward, settings.backward, fwd, bwd,
                            policy.settings.probe_rows)


def probed(policy, epoch: int, num_layers: int) -> list[tuple[int, int, tuple]]:
    """``(layer, direction index, candidates)`` of every exchange measured at ``epoch``, in one
    order that every rank derives alike."""
    return [(layer, d, policy.probe(epoch, layer, num_layers, name))
            for layer in range(num_layers) for d, name in enumerate(DIRECTIONS)
            if policy.probe(epoch, layer, num_layers, name)]


def _local(stats: ExchangeStats, keys: list) -> tuple[list[float], list[float]]:
    """This rank's (summed, maxed) figures in ``keys``' order; the wire samples last."""
    sums, maxes = [], []
    for layer, d, cands in keys:
        fig = stats.probes.get((layer, d), ProbeFigures())
        sums += [fig.norm2, *(fig.error2.get(c, 0.0) for c in cands)]
        maxes += [*(fig.seconds.get(c, 0.0) for c in cands),
                  *(float(fig.bytes.get(c, 0)) for c in (*cands, IDENTITY))]
    for sample in stats.wire:                 # a hidden (non-blocking) wire time: up to compute
        wire_s = sample.seconds + (sample.compute_s if sample.nonblocking else 0.0)
        maxes += [float(sample.bytes), wire_s, sample.compute_s]
    return sums, maxes


def reduce_figures(ctx: CommContext, stats: ExchangeStats, keys: list) -> Figures:
    """The decision epoch's figures over all ranks (errors summed, seconds and bytes maxed).
    Every rank probed the same exchanges in the same order, so the vectors line up."""
    sums, maxes = _local(stats, keys)
    sums, maxes = sum_float64(ctx, sums), max_float64(ctx, maxes)
    wire, compute = {name: [] for name in DIRECTIONS}, {}
    at = len(maxes) - 3 * len(stats.wire)
    for k, sample in enumerate(stats.wire):
        nbytes, seconds, comp = maxes[at + 3 * k:at + 3 * k + 3]
        wire[DIRECTIONS[sample.direction]].append((nbytes, seconds))
        key = (sample.layer, sample.direction)
        compute[key] = (compute.get(key, (0.0, False))[0] + comp, sample.nonblocking)
    exchanges, i, j = {}, 0, 0
    for layer, d, cands in keys:
        n = len(cands)
        bits = [c.bits for c in cands]
        comp, overlap = compute.get((layer, d), (0.0, False))
        fig = ExchangeFigures(norm2=sums[i], error2=dict(zip(bits, sums[i + 1:i + 1 + n])),
                              codec_s=dict(zip(bits, maxes[j:j + n])),
                              bytes=dict(zip([*bits, FP32], maxes[j + n:j + 2 * n + 1])),
                              compute_s=comp, overlap=overlap)
        if fig.bytes[FP32] > 0:           # no rank sent anything (e.g. no backward): no choice
            exchanges[(layer, DIRECTIONS[d])] = fig
        i, j = i + 1 + n, j + 2 * n + 1
    return Figures(exchanges, wire)


def tune(ctx: CommContext, policy, epoch: int, loss: float, stats: ExchangeStats,
         num_layers: int) -> dict | None:
    """After epoch ``epoch``'s training step, every rank: note the (global) loss; at a check
    decide — after a probe epoch from the reduced figures, rank 0 deciding for all (one
    Bcast); otherwise from the state alone, the same on every rank (no communication).
    Returns the check's record (every rank) or None."""
    keys = probed(policy, epoch, num_layers)
    probing, check = policy.due(epoch), policy.check(epoch)
    policy.observe_loss(loss)
    if not check:
        return None
    if not probing:
        state, record = policy.decide(epoch, None)
    else:
        figures = reduce_figures(ctx, stats, keys)
        decided = policy.decide(epoch, figures) if ctx.is_root else None
        if ctx.size > 1:
            decided = ctx.comm.bcast(decided, root=0)     # one small Bcast: state + record
        state, record = decided
    policy.adopt(state)
    return record
