"""The trainer's side of ``kind = "auto"`` (``hpcgnn.autotune``): what a step measures, the
reduction of the figures over ranks, and rank 0's decision handed to every rank.

After a probe epoch's training step, every rank in the same order:
  one Allreduce (SUM) of ``||x||^2`` and the candidates' squared errors,
  one Allreduce (MAX) of the candidates' seconds and bytes and of the wire samples,
  rank 0 decides (``AutoPolicy.decide``), one Bcast of the new controller state (a few kB).
Per layer and direction ``1 + |candidates|`` summed and ``2 |candidates| + 1`` maxed values,
plus 3 per probed exchange (bytes, wire seconds, the layer's compute between post and wait).
Other checks decide from the state alone (no communication).

Before epoch 0 of a run (``start_run``), on the time objective: one small Allreduce (MAX) of
every exchange's bytes and codec seconds per candidate (only those whose ``prior_error`` is
within ``MAX_ERROR``: the others cannot be sent in epoch 0, and are not timed), then, for the
exchange with the most fp32 bytes, two timed exchanges of zeros (after a Barrier each) at
``CALIBRATION`` of its fp32 width and one small Allreduce (MAX) of their bytes and seconds.
Every rank derives the same start state from the reduced figures (``hpcgnn.autotune.start``);
no Bcast.
"""
from __future__ import annotations

import time

import torch

from hpcgnn.autotune import (DIRECTIONS, MAX_ERROR, ExchangeFigures, Figures, prior_error,
                             prior_figures, quant_codec, start)
from hpcgnn.codecs.base import IDENTITY
from hpcgnn.codecs.quant import FP32
from hpcgnn.codecs.rng import Blocks
from hpcgnn.comm.collectives import max_float64, sum_float64
from hpcgnn.comm.context import CommContext
from hpcgnn.comm.exchange import ExchangeSettings, ExchangeStats, ProbeFigures, busy_seconds
from hpcgnn.comm.keys import FORWARD

CALIBRATION = (0.5, 0.125)
"""Widths, as fractions of the largest exchange's, of the two exchanges of zeros timed before
epoch 0: the link's cost near an fp32 exchange's size (a 2x extrapolation up to fp32; the
compressed candidates lie between), at 5/8 of that exchange's fp32 bytes in all. Larger first,
so the smaller is not the one a token bucket's burst carries."""


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


# -- before epoch 0 ------------------------------------------------------------------------------
def _counts(exchanger, direction: str) -> tuple[int, ...]:
    plan = exchanger.plan
    return plan.send_counts if direction == "forward" else plan.recv_counts


def _codec_seconds(rows: int, width: int, bits: int, cap: int, device: torch.device,
                   timed: dict | None = None) -> float:
    """Seconds of an encode + decode of ``rows`` rows of ``width`` through the codec a send uses
    (``quant_codec``, one block, as a probe times it), timed on at most ``cap`` random rows and
    scaled; the better of two tries. ``timed``: what earlier calls of this start timed, by
    ``(rows timed, width, bits)``; a size timed already is not timed again (a layer's forward
    and backward exchanges both send more than ``cap`` rows wherever the cap matters)."""
    n = min(rows, cap) if cap > 0 else rows
    if n == 0 or width == 0:
        return 0.0
    timed = {} if timed is None else timed
    if (n, width, bits) not in timed:
        timed[(n, width, bits)] = _time_codec(n, width, bits, device)
    return timed[(n, width, bits)] * rows / n


def _time_codec(n: int, width: int, bits: int, device: torch.device) -> float:
    """The better of two encode + decode passes of ``n`` random rows of ``width``."""
    gen = torch.Generator(device=device).manual_seed(n)  # not the global generator: the run's
    x = torch.randn(n, width, generator=gen, device=device)  # random state stays as it was
    codec, blocks = quant_codec(bits), Blocks.of((n,), device)
    keys = torch.zeros(1, dtype=torch.int64, device=device)
    best = float("inf")
    for _ in range(2):
        t0, c0 = time.perf_counter(), time.process_time()
        y = codec.decode(codec.encode(x, blocks, keys, 1), blocks, width, keys)
        float(y[0, 0])                                   # syncs the device
        best = min(best, busy_seconds(t0, c0, device))
    return best


def _time_link(ctx: CommContext, exchanger, width: int) -> list[tuple[float, float]]:
    """``(bytes, seconds)``, each the ranks' largest, of forward exchanges of zeros at the
    ``CALIBRATION`` fractions of ``width`` fp32 channels, each started after a Barrier."""
    local = []
    for fraction in CALIBRATION:
        w = max(1, round(width * fraction))
        rows = torch.zeros(exchanger.plan.n_send, w, device=ctx.device)
        ctx.comm.Barrier()
        t0 = time.perf_counter()
        exchanger.complete(exchanger.post(rows, FORWARD, ExchangeSettings(0), nonblocking=False))
        local += [float(rows.numel() * 4), time.perf_counter() - t0]
    exchanger.stats.reset()                              # off the books
    reduced = max_float64(ctx, local)
    return [(reduced[k], reduced[k + 1]) for k in range(0, len(reduced), 2)]


def start_run(ctx: CommContext, policy, layers) -> dict | None:
    """Before epoch 0 of a fresh run, every rank: the codecs epoch 0 sends, adopted into
    ``policy``, and their record (for epoch 0's ``auto``). Where nothing of the run has been
    measured yet, a candidate's error is its ``prior_error`` bound; on the time objective its
    cost comes from the codec timed on random rows of each exchange's size and the link timed
    at two sizes near the largest exchange's (``CALIBRATION``); on the bytes objective from one
    row's bytes (no communication). None (epoch 0 sends fp32) for one rank or a resumed run.
    The record's ``seconds``: this rank's time here (``bench/network.py`` counts it into the
    run's time to accuracy)."""
    t0, n = time.perf_counter(), len(layers)
    if (ctx.size == 1 or policy.state.probes > 0 or policy.state.bits
            or not all(hasattr(layer.prop, "exchanger") for layer in layers)):
        return None
    # a layer whose exchanged rows need no gradient (the first, exchanging the features) has
    # no backward exchange: nothing to decide, time or record for it
    keys = [(i, d) for i in range(n) for d in DIRECTIONS if policy.compresses(i, n, d)
            and (d == "forward" or getattr(layers[i], "sends_gradient", True))]
    widths = {i: int(layers[i].width) for i in range(n)}
    if policy.settings.objective == "bytes":             # one row: the same on every rank
        figs = {(i, d): prior_figures(widths[i], {b: float(quant_codec(b).block_bytes(1, widths[i]))
                                                   for b in (*policy.settings.bits, FP32)}, {})
                for i, d in keys}
        samples = []
    else:                       # a width the prior bound rules out (above MAX_ERROR) is not timed
        timed = {i: [b for b in policy.settings.bits if prior_error(widths[i], b) <= MAX_ERROR]
                 for i in range(n)}
        local, codec_timed = [], {}
        for i, d in keys:
            counts, w = _counts(layers[i].prop.exchanger, d), widths[i]
            local += [float(sum(quant_codec(b).byte_counts(counts, w)))
                      for b in (*timed[i], FP32)]
            local += [_codec_seconds(sum(counts), w, b, policy.settings.probe_rows, ctx.device,
                                     codec_timed) for b in timed[i]]
        reduced, figs, k = max_float64(ctx, local), {}, 0
        for i, d in keys:
            nbytes = dict(zip((*timed[i], FP32), reduced[k:k + len(timed[i]) + 1]))
            k += len(timed[i]) + 1
            seconds = dict(zip(timed[i], reduced[k:k + len(timed[i])]))
            k += len(timed[i])
            if nbytes[FP32] > 0:                         # no rank sends anything: no choice
                figs[(i, d)] = prior_figures(widths[i], nbytes, seconds)
        forward = [(figs[(i, "forward")].bytes[FP32], -i) for i in range(n) if (i, "forward") in figs]
        samples = []
        if forward:
            biggest = -max(forward)[1]
            samples = _time_link(ctx, layers[biggest].prop.exchanger, widths[biggest])
    state, record = start(policy.settings, figs, samples)
    policy.adopt(state)
    return {**record, "seconds": time.perf_counter() - t0}
