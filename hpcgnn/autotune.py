"""``kind = "auto"``: a closed-loop compression policy that needs no tuning.

```toml
kind = "auto"
codec = "quant"            # the only codec auto drives: bit widths of stochastic rounding
bits = [1, 2, 4, 8]        # the candidates besides fp32 (always a candidate)
every = 5                  # epochs between checks; epoch 0 measures and decides
objective = "time"         # time (codec + wire seconds) | bytes (fewest bytes; deterministic)
compress_last_layer = true # auto's default: fp32 is always a candidate
compress_backward = true
probe_rows = 2048          # a probe measures on at most about this many rows per exchange
```

Per layer and direction (forward activations, backward halo gradients) the controller keeps one
setting: fp32 or ``b``-bit stochastic rounding (``hpcgnn.codecs.quant``). Before epoch 0
(``start``; the trainer's side is ``hpcgnn.train.autotuning.start_run``) a candidate's error is
``prior_error``, a bound on the expected error that holds for any row, and on the time
objective its cost comes from each codec timed on random rows of each exchange's size and from
the link timed at two sizes near the largest exchange's fp32 size. The fit then extrapolates at
most 2x up to fp32 and *down* to the compressed sizes. (From compressed sizes alone, as when
auto started at the fewest bits as VARCO starts at its heaviest compression, it extrapolated up
from a few hundred kB, and on shared memory, where time did not grow in proportion to bytes,
predicted fp32 several times dearer than it was.) Epoch 0 sends the cheapest candidate within
``MAX_ERROR`` and is a probe. (It used to send fp32, which on a slow link costs what four to six
4-bit epochs do.) From the first decision on, the budget below
applies, and it starts at ``MAX_ERROR = 1``: no codec may ever send more noise than signal.

**Measuring** (a *probe epoch*; epoch 0 is one): the trainer asks every sender to measure, on
the rows it actually sends in that epoch's exchanges (``ExchangeSettings.probe``), for each
candidate ``b`` the squared error ``||x - x^b||^2`` of its encode + decode of those rows (the
real send's noise key) beside ``||x||^2``, its seconds (on the CPU the lesser of wall-clock and
process CPU time, ``hpcgnn.comm.exchange.busy_seconds``) and bytes — on every ``k``-th sent row
where an exchange sends more than ``probe_rows`` (``k = ceil(R / probe_rows)``; sums and seconds
scaled by ``R / sampled``, bytes exact), so that a probe costs a few per cent of an epoch rather
than ``|bits|`` codec passes over every boundary row — and every exchange's
bytes, wire seconds (post + wait) and the layer's compute between post and wait. The trainer reduces them over ranks (errors summed,
seconds and bytes maxed) and rank 0 decides and broadcasts the new ``AutoState``. An exchange
no rank sent anything through (a layer whose rows need no gradient has no backward) gets no
decision.

**Deciding**, per layer and direction: among the candidates whose relative error
``e_b = sum ||x - x^b||^2 / sum ||x||^2`` is within the budget ``B`` (fp32, error 0, always
is), the one of least predicted cost ``codec_s(b) + alpha + beta * bytes(b)``: ``(alpha, beta)``
a least-squares fit of that direction's wire seconds against bytes over the last
``WIRE_HISTORY`` probed exchanges (``beta = 0`` where the slope is not positive: bytes are then
free within the timing noise; the ratio ``sum s / sum bytes`` where only one size was ever
measured). A probed exchange starts with a ``Barrier``, so its seconds are the transfer's and
not the ranks' skew (the compute before it, which differs by layer and would pass for a cost
per byte). With ``train.overlap`` (non-blocking exchanges) the wire
time counts only past the layer's compute that hides it: ``max(0, alpha + beta * bytes(b) -
compute_s)``, and a sample's wire seconds are post + compute + wait. Ties go to the more precise, so where the link makes bytes
free fp32 wins on time; and a prediction within ``HYSTERESIS`` (10 %) of the best counts as a
tie, won first by fp32 (compression has to pay clearly, since what it costs in convergence is
not in the prediction), then by the setting in use, so timing noise alone flips nothing. ``objective = "bytes"`` ranks by bytes alone (a choice that does not
depend on timing, so runs are reproducible bit for bit).

**The budget only falls** (VARCO's monotone condition). Every ``every`` epochs (a *check*) the
loss's improvement per window is ``g_k = (1 - Lbar_k / Lbar_j) / (k - j)``, ``j = max(0, k -
LOSS_WINDOWS)``, ``Lbar_k`` the mean of the globally reduced training loss over the epochs
since the previous check (epoch 0 alone for ``k = 0``), averaged over the last
``LOSS_WINDOWS`` windows (20 epochs at the default) so that one noisy window (dropout) cannot
end compression for good; ``G_k = max(g_1 .. g_k)`` is the fastest the loss has fallen. The
budget moves to ``B_k = min(B_{k-1}, MAX_ERROR * max(0, g_k) / G_k)``, ``B_0 = MAX_ERROR``: a
codec may perturb what it sends (relative squared error) by as much as the signal while
training improves the loss at its fastest, by the fraction of that pace it still keeps as
learning slows, and by nothing once the loss stops improving (``B = 0``, after which nothing
is measured any more). Scale-free: the rule reads no loss value or rate of its own, so it needs
no tuning per graph (``docs/compression.md`` says why it replaced the loss rate itself, which
capped the budget under what 2-bit rows measure). A check re-decides from the last measured
figures at once when the budget falls, so the codec in use never has a last measured error
above the current budget. Each check records ``peak`` (``G_k``) beside the budget.

**The steps overrule the prediction** (time objective). The time model is fitted on exchanges
that start together after a ``Barrier``; where ranks share cores (shared memory, more ranks than
cores) every rank copies at once there, and a compressed setting predicted 30 % cheaper made
real steps 7-17 % slower. So after every epoch that did not probe, the ranks' mean step seconds
(agreed in the epoch-end Allreduce, one epoch late) are kept per *setting* (the bits of every
exchange, ``signature``; the last ``STEP_HISTORY``), and at a check a compressed setting runs
only while the median of its steps is ``MEASURED_GAIN`` (5 %) below fp32's; one that was not
is never sent again (``slower``). Once one was, the model has been wrong on this link by more
than ``VERIFY_BELOW`` allows: a setting predicted less than that much cheaper is not tried
(fp32 stays, so decisions stop flipping), and a probe whose check the steps overrule sets the
probe interval to its longest (``MAX_BACKOFF * every``). Where fp32 was never timed (epoch 0
probes, and ``start`` sends a compressed setting where the link is slow), the check after the
first timed compressed window sends fp32 for one window to time it, but only where the
prediction is not confident: codec + wire summed over exchanges less than ``VERIFY_BELOW`` (2)
times cheaper than fp32's. At 1 Gbit/s (settings predicted 3.1-7.2x cheaper) no
fp32 window is spent. Every check on the time objective records what the steps said
(``auto.steps``: the setting, both medians, the predicted gain, the verdict ``keep``,
``reference`` or ``fp32``).

**Probing less as things settle**: probes are ``every`` epochs apart at first; each probe that
leaves every decision as it was doubles the interval (up to ``MAX_BACKOFF * every``), one that
changes a decision resets it. A decision the falling budget changes is not the probe's news:
a probe changed something only where its measurements decide otherwise than the figures
before it would have at the same budget (``_baseline``; on 8 ranks at 1 Gbit/s the budget
moving layer after layer to 4 bits had reset the interval at epochs 35, 50 and 65, and seven
probes ran from epoch 35 to 80). One that leaves every exchange on fp32 with fp32 predicted cheaper
than every allowed candidate (not only by the tie rule: ``fp32_clear``) goes to the longest
interval at once: the budget only falls, so only a cheaper link or codec could change that (on
8 ranks over shared memory a probe epoch cost some 70 ms more than a 90 ms step). Probing costs
an encode + decode of at most ``probe_rows`` rows per exchange and candidate, and after the first probe a candidate is left out whose last
measured error is above ``SKIP_ABOVE`` (2) times the budget, and once left out it stays out:
the budget only falls, so it could pass again only if its error halved, which is not watched
for (1-bit rows measure 4-9 against budgets below 1); the most precise candidate is always
measured. Checks cost nothing (no communication). A candidate's codec
seconds are the least any probe measured (its cost depends on sizes alone, and a slow sample is
a preempted one).

Decisions are recorded at every check (``metrics.jsonl``'s ``auto``) and the whole state is
checkpointed (``state_dict``): a resumed run continues with the same budget, codecs, figures
and wire history. No MPI here: the trainer reduces and broadcasts (``hpcgnn.train.autotuning``).
"""
from __future__ import annotations

import copy
import math
import statistics
from dataclasses import asdict, dataclass, field

from hpcgnn.codecs.base import IDENTITY, CompressionPolicy, WireCodec
from hpcgnn.codecs.quant import BITS, FP32
from hpcgnn.errors import ScheduleError

DIRECTIONS = ("forward", "backward")
OBJECTIVES = ("time", "bytes")
WIRE_HISTORY = 64
"""Wire samples (bytes, seconds) kept per direction for the fit: the latest probes'."""
MAX_BACKOFF = 8
"""The longest probe interval, in units of ``every``."""
LOSS_WINDOWS = 4
"""How many check windows back the loss improvement is measured from (averaged per window)."""
MAX_ERROR = 1.0
"""``B_0``, the budget before any loss improvement is known: no codec may send more noise than
signal (relative squared error above 1; 1-bit rows of Gaussian-like features measure 4-9)."""
HYSTERESIS = 0.10
"""A setting in use stays while its predicted time is within this fraction of the best's."""
SKIP_ABOVE = 2.0
"""A probe leaves out a candidate whose last measured error is above this many budgets."""
PROBE_ROWS = 2048
"""Default ``probe_rows``: the rows (at most, about) of each exchange a probe measures on."""
STEP_HISTORY = 8
"""Agreed step seconds kept per setting (the latest non-probe epochs run with it)."""
MIN_STEPS = 3
"""Steps a setting needs before its median step time is compared with fp32's."""
MEASURED_GAIN = 0.05
"""A compressed setting stays only while its median step is this fraction below fp32's."""
VERIFY_BELOW = 2.0
"""A compressed setting predicted less than this many times cheaper than fp32 (codec + wire,
summed over exchanges) is checked against one window of fp32 steps."""


@dataclass(frozen=True)
class AutoSettings:
    """The schedule file's keys for ``kind = "auto"`` (see the module docstring)."""

    bits: tuple[int, ...] = BITS
    every: int = 5
    objective: str = "time"
    compress_last_layer: bool = True
    compress_backward: bool = True
    probe_rows: int = PROBE_ROWS


@dataclass(frozen=True)
class ExchangeFigures:
    """One layer and direction at one probe epoch, reduced over ranks: ``norm2`` and
    ``error2[b]`` summed, ``codec_s[b]`` and ``bytes[b]`` (``b = 32``: fp32) the ranks' largest;
    ``compute_s`` the layer's work between the post and the wait (largest rank), which the wire
    time hides when the exchange is non-blocking (``overlap``, ``train.overlap``)."""

    norm2: float
    error2: dict[int, float]
    codec_s: dict[int, float]
    bytes: dict[int, float]
    compute_s: float = 0.0
    overlap: bool = False

    def error(self, bits: int) -> float:
        """Relative squared error of ``bits`` on the rows sent; 0 for fp32 or when none were;
        infinite for a candidate this probe did not measure (``AutoPolicy.probe``)."""
        if bits == FP32 or self.norm2 <= 0:
            return 0.0
        if bits not in self.error2:
            return math.inf
        return self.error2[bits] / self.norm2

    def to_dict(self) -> dict:
        """Plain, checkpointable: bit widths as string keys."""
        return {"norm2": self.norm2, "compute_s": self.compute_s, "overlap": self.overlap,
                **{name: {str(b): v for b, v in getattr(self, name).items()}
                   for name in ("error2", "codec_s", "bytes")}}

    @classmethod
    def from_dict(cls, d: dict) -> "ExchangeFigures":
        return cls(d["norm2"], *({int(b): v for b, v in d[name].items()}
                                 for name in ("error2", "codec_s", "bytes")),
                   compute_s=d["compute_s"], overlap=d["overlap"])


@dataclass(frozen=True)
class Figures:
    """What one probe epoch measured: per ``(layer, direction)`` its ``ExchangeFigures``; per
    direction the probed exchanges' ``(bytes, seconds)`` (each the ranks' largest)."""

    exchanges: dict[tuple[int, str], ExchangeFigures]
    wire: dict[str, list[tuple[float, float]]]


@dataclass
class AutoState:
    """Everything the controller carries between epochs (the same on every rank)."""

    bits: dict[str, int] = field(default_factory=dict)     # "layer/direction" -> 1|2|4|8|32
    budget: float = MAX_ERROR
    peak: float = 0.0                                        # fastest loss improvement per window
    window: list[float] = field(default_factory=list)      # losses since the last check
    means: list[float] = field(default_factory=list)       # mean loss of the last windows
    measured: dict[str, dict] = field(default_factory=dict)  # "layer/direction" -> last figures
    wire: dict[str, list[list[float]]] = field(default_factory=dict)   # direction -> samples
    interval: int = 0                                       # epochs to the next probe
    next_probe: int = 0
    probes: int = 0
    steps: dict[str, list[float]] = field(default_factory=dict)  # setting -> step seconds
    slower: list[str] = field(default_factory=list)         # settings measured no faster

    @property
    def settled(self) -> bool:
        """The budget is 0: only fp32 can ever pass again, so nothing is measured."""
        return self.probes > 0 and self.budget <= 0.0


# -- the decision rule (pure) --------------------------------------------------------------------
def fit_wire(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """``(alpha, beta)`` of ``seconds ~ alpha + beta * bytes`` by least squares, with ``alpha >=
    0`` (a message takes no negative time): where the free fit's intercept is negative (small
    messages timed slower than the line through the large ones predicts; seen at -58 ms) the
    line through the origin, ``(0, sum b s / sum b^2)``, the least-squares fit under that
    constraint. Where the samples show no cost per byte (``beta <= 0``: the link moves these
    sizes faster than the timing noise resolves) ``(mean seconds, 0)``: bytes are free. Only
    where one size was ever measured (no slope to fit) the ratio ``(0, sum s / sum bytes)``,
    which charges every second to the bytes."""
    if not samples:
        return 0.0, 0.0
    n = len(samples)
    mx = sum(b for b, _ in samples) / n
    my = sum(s for _, s in samples) / n
    sxx = sum((b - mx) ** 2 for b, _ in samples)
    if sxx > 0:
        beta = sum((b - mx) * (s - my) for b, s in samples) / sxx
        if beta <= 0:
            return max(my, 0.0), 0.0
        if my - beta * mx >= 0:
            return my - beta * mx, beta
        return 0.0, sum(b * s for b, s in samples) / sum(b * b for b, _ in samples)
    total = sum(b for b, _ in samples)
    return 0.0, (sum(s for _, s in samples) / total if total > 0 else 0.0)


def predicted_cost(fig: ExchangeFigures, bits: int, wire: tuple[float, float],
                   objective: str) -> float:
    """Seconds (codec + the wire time not hidden by the layer's compute) or bytes of ``bits``
    on this exchange."""
    if objective == "bytes":
        return fig.bytes[bits]
    alpha, beta = wire
    seconds = alpha + beta * fig.bytes[bits]
    if fig.overlap:                         # a non-blocking exchange hides up to compute_s
        seconds = max(0.0, seconds - fig.compute_s)
    return fig.codec_s.get(bits, 0.0) + seconds


def allowed(fig: ExchangeFigures, candidates: tuple[int, ...], budget: float) -> list[int]:
    """The candidates measured on this exchange whose error is within ``budget``, and fp32."""
    return [FP32] + [b for b in candidates if b in fig.error2 and fig.error(b) <= budget]


def choose(fig: ExchangeFigures, candidates: tuple[int, ...], budget: float,
           wire: tuple[float, float], objective: str = "time", current: int | None = None
           ) -> int:
    """The candidate of least predicted cost whose error is within ``budget`` (fp32 always
    passes); ties go to the more precise. With ``objective = "time"`` a prediction within
    ``HYSTERESIS`` of the best counts as a tie, resolved first for fp32 (compression must pay
    clearly: what it may cost in convergence is not in the prediction), then for ``current``
    (the setting in use, while allowed: timing noise alone does not flip a decision, and so does
    not reset the probe interval)."""
    cost = {b: predicted_cost(fig, b, wire, objective) for b in allowed(fig, candidates, budget)}
    best = min(cost, key=lambda b: (cost[b], -b))
    if objective == "time":
        for keep in (FP32, current):
            if keep in cost and cost[keep] <= (1.0 + HYSTERESIS) * cost[best]:
                return keep
    return best


def next_budget(budget: float, means: list[float], window: list[float], peak: float = 0.0
                ) -> tuple[float, float]:
    """``(budget, peak)`` after a check: ``g``, the loss's relative improvement per window of this
    window's mean over the mean of the window ``LOSS_WINDOWS`` back (``means``: the earlier
    windows', latest last; fewer early on); ``peak = max(peak, g)``; ``budget = min(budget,
    MAX_ERROR * max(0, g) / peak)`` (0 where the loss never fell). Unchanged when there is no
    earlier window to compare with."""
    back = means[-LOSS_WINDOWS:]
    if not back or not window or not back[0] > 0:
        return budget, peak
    improvement = (1.0 - (sum(window) / len(window)) / back[0]) / len(back)
    peak = max(peak, improvement)
    if improvement <= 0.0:
        return 0.0, peak
    return min(budget, MAX_ERROR * improvement / peak), peak


def signature(bits: dict[str, int]) -> str:
    """One setting of every exchange as a string: its compressed exchanges, or ``"fp32"``."""
    return ",".join(f"{k}={b}" for k, b in sorted(bits.items()) if b != FP32) or "fp32"


def _median(seconds: list[float]) -> float | None:
    """The median step, once ``MIN_STEPS`` were timed."""
    return statistics.median(seconds) if len(seconds) >= MIN_STEPS else None


def verify_steps(steps: dict[str, list[float]], slower: list[str], bits: dict[str, int],
                 gain: float) -> tuple[str, dict]:
    """Whether the compressed setting ``bits`` (predicted ``gain`` times cheaper than fp32) may
    run, from the steps actually measured: ``"keep"``, ``"fp32"`` (its median step was not
    ``MEASURED_GAIN`` below fp32's, now or before: it joins ``slower``; or, once some setting
    was, it is not confidently predicted, ``gain < VERIFY_BELOW``: on this link the model has
    been wrong by that much) or ``"reference"`` (no fp32 step was ever timed, some compressed
    one was, and ``gain < VERIFY_BELOW``: the next window runs fp32 to time it). Pure."""
    sig = signature(bits)
    mine, ref = _median(steps.get(sig, [])), _median(steps.get("fp32", []))
    facts = {"setting": sig, "median_s": mine, "fp32_median_s": ref, "predicted_gain": gain}
    if sig == "fp32":
        return "keep", facts
    if sig in slower:
        return "fp32", facts
    if mine is not None and ref is not None:
        return ("keep" if mine <= (1.0 - MEASURED_GAIN) * ref else "fp32"), facts
    if slower and gain < VERIFY_BELOW:
        return "fp32", facts
    timed_any = any(len(v) >= MIN_STEPS for k, v in steps.items() if k != "fp32")
    if ref is None and timed_any and gain < VERIFY_BELOW:
        return "reference", facts
    return "keep", facts


def steps_note(steps: dict) -> str:
    """The log line of a check whose ``steps`` verdict is not ``keep``: why it sends fp32 (or
    times it), in the terms of ``verify_steps``: a setting whose steps were measured no faster,
    or, never run, one predicted less than ``VERIFY_BELOW`` times cheaper on a link where the
    steps already overruled the prediction."""
    ms = {k: "untimed" if steps[k] is None else f"{1e3 * steps[k]:.1f} ms"
          for k in ("median_s", "fp32_median_s")}
    facts = f"{steps['setting']} steps {ms['median_s']}, fp32 steps {ms['fp32_median_s']}"
    if steps["verdict"] == "reference":
        return f"{facts}: timing fp32 for one window"
    if steps["median_s"] is None or steps["fp32_median_s"] is None:
        gain = steps["predicted_gain"]
        return (f"{facts}: predicted {'?' if gain is None else f'{gain:.2f}'}x cheaper than "
                f"fp32, under the {VERIFY_BELOW:g}x that a compressed setting needs on this link "
                "(its steps overruled the prediction before), sending fp32")
    return f"{facts}: not {MEASURED_GAIN:.0%} faster, sending fp32"


def _probe_interval(state: AutoState, bits: dict[str, int], every: int,
                    fp32_clear: bool = False, baseline: dict[str, int] | None = None) -> int:
    """Double the interval when a probe changed nothing, else back to ``every``; the longest
    at once when it changed nothing, every exchange sends fp32 and ``fp32_clear`` (the
    prediction itself, not only the tie rule, puts fp32 below every allowed candidate).
    ``baseline``: what the check would have decided without the probe's measurements (the
    last figures at the new budget); a probe changed something only where ``bits`` differ
    from it (default: from the bits in use)."""
    if state.probes == 0 or bits != (state.bits if baseline is None else baseline):
        return every
    if fp32_clear and all(b == FP32 for b in bits.values()):
        return MAX_BACKOFF * every
    return min(2 * max(state.interval, every), MAX_BACKOFF * every)


def fp32_clear(figs: dict[str, ExchangeFigures], candidates: tuple[int, ...], budget: float,
               fits: dict[str, tuple[float, float]]) -> bool:
    """Whether fp32's predicted time is below that of every candidate within ``budget`` on
    every exchange (no tie rule needed). The budget only falls, so what could make compression
    pay later is the link or the codec getting cheaper, which is not what a link does within a
    run: such a probe backs off to the longest interval (``_probe_interval``)."""
    for key, fig in figs.items():
        fit = fits[key.partition("/")[2]]
        fp32 = predicted_cost(fig, FP32, fit, "time")
        if any(predicted_cost(fig, b, fit, "time") <= fp32
               for b in allowed(fig, candidates, budget) if b != FP32):
            return False
    return True


def decide(state: AutoState, settings: AutoSettings, figures: Figures | None, epoch: int
           ) -> tuple[AutoState, dict]:
    """A check after epoch ``epoch``: the next state (budget, bits per exchange, figures, wire
    history, next probe) and its record for ``metrics.jsonl``. ``figures``: what this epoch
    measured (rank 0, reduced), or None to re-decide from the last ones. Pure."""
    budget, peak = next_budget(state.budget, state.means, state.window, state.peak)
    measured = dict(state.measured)
    wire = {d: [list(s) for s in state.wire.get(d, [])] for d in DIRECTIONS}
    if figures is not None:
        for (layer, d), fig in figures.exchanges.items():
            key, new = f"{layer}/{d}", fig.to_dict()
            if key in measured:           # a codec's cost is a property of the sizes: the
                new["codec_s"] = {b: min(s, measured[key]["codec_s"].get(b, s))   # least seen
                                  for b, s in new["codec_s"].items()}
            measured[key] = new
        wire = {d: (wire[d] + [list(s) for s in figures.wire.get(d, [])])[-WIRE_HISTORY:]
                for d in DIRECTIONS}
    fits = {d: fit_wire([tuple(s) for s in wire[d]]) for d in DIRECTIONS}
    baseline = _baseline(state, settings, budget) if figures is not None else None
    bits, figs, cost = dict(state.bits), {}, [0.0, 0.0]
    for key in sorted(measured):
        fig = figs[key] = ExchangeFigures.from_dict(measured[key])
        fit = fits[key.partition("/")[2]]
        bits[key] = choose(fig, settings.bits, budget, fit, settings.objective,
                           state.bits.get(key))
        cost[0] += predicted_cost(fig, FP32, fit, settings.objective)
        cost[1] += predicted_cost(fig, bits[key], fit, settings.objective)
    slower, steps = list(state.slower), None
    if settings.objective == "time":      # what the steps measured overrules the prediction
        verdict, steps = verify_steps(state.steps, slower, bits,
                                      cost[0] / cost[1] if cost[1] > 0 else math.inf)
        steps["verdict"] = verdict
        if verdict == "fp32" and steps["median_s"] is not None and steps["setting"] not in slower:
            slower.append(steps["setting"])              # measured, not merely distrusted
        if verdict != "keep":
            bits = {k: FP32 for k in bits}    # a change the probe interval resets for
    rows = []
    for key in sorted(measured):
        layer, _, direction = key.partition("/")
        rows.append(_row(int(layer), direction, bits[key], figs[key], settings, fits[direction]))
    means = (state.means + [sum(state.window) / len(state.window)] if state.window
             else state.means)[-LOSS_WINDOWS:]
    new = AutoState(bits=bits, budget=budget, peak=peak, window=[], means=means,
                    measured=measured, wire=wire, interval=state.interval,
                    next_probe=state.next_probe,
                    probes=state.probes, steps={k: list(v) for k, v in state.steps.items()},
                    slower=slower)
    if figures is not None:
        clear = settings.objective == "time" and fp32_clear(figs, settings.bits, budget, fits)
        new.interval = _probe_interval(state, bits, settings.every, clear, baseline)
        if steps is not None and steps["verdict"] == "fp32":   # the steps overruled the model:
            new.interval = MAX_BACKOFF * settings.every        # probing pays for nothing here
        new.next_probe, new.probes = epoch + new.interval, state.probes + 1
    record = {"epoch": epoch, "budget": budget, "peak": peak, "probed": figures is not None,
              "next_probe": None if new.settled else new.next_probe,
              "wire": {d: {"alpha_s": fits[d][0], "beta_s_per_byte": fits[d][1]}
                       for d in DIRECTIONS}, "exchanges": rows}
    if steps is not None:
        record["steps"] = steps
    return new, record


def _baseline(state: AutoState, settings: AutoSettings, budget: float) -> dict[str, int] | None:
    """The bits a check at ``budget`` decides from the figures measured before this probe (and
    the wire history before it): what the falling budget alone changes, which is not news
    that a probe found. None before the first figures; an exchange without earlier figures is
    missing from it, so a probe that first measures one counts as a change."""
    fits = {d: fit_wire([tuple(s) for s in state.wire.get(d, [])]) for d in DIRECTIONS}
    if not state.measured:
        return None
    return {key: choose(ExchangeFigures.from_dict(fig), settings.bits, budget,
                        fits[key.partition("/")[2]], settings.objective, state.bits.get(key))
            for key, fig in state.measured.items()}


def prior_error(width: int, bits: int) -> float:
    """A bound, known before any row is seen, on the expected relative squared error of
    ``bits``-bit stochastic rounding of any row of ``width`` values: per value
    ``E (x - x^b)^2 <= step^2 / 4``, ``step <= (1 + 2^-7) (max - min) / (2^b - 1)`` (bfloat16,
    rounded up) and ``(max - min)^2 <= 2 ||x||^2``, so ``width (1 + 2^-7)^2 / (2 (2^b - 1)^2)``
    (fp32: 0). Width 64: 4 bits 0.14, 2 bits 3.6; 8 bits stays below 1 up to 130k channels."""
    if bits == FP32:
        return 0.0
    return width * (1.0 + 2.0 ** -7) ** 2 / (2.0 * ((1 << bits) - 1) ** 2)


def prior_figures(width: int, bytes_: dict[int, float], codec_s: dict[int, float]
                  ) -> ExchangeFigures:
    """An exchange's figures before epoch 0: ``prior_error`` in place of measured errors."""
    return ExchangeFigures(norm2=1.0, error2={b: prior_error(width, b) for b in bytes_ if b != FP32},
                           codec_s=dict(codec_s), bytes=dict(bytes_))


def start(settings: AutoSettings, exchanges: dict[tuple[int, str], ExchangeFigures],
          samples: list[tuple[float, float]]) -> tuple[AutoState, dict]:
    """The state epoch 0 runs with: per exchange the cheapest candidate whose ``prior_error`` is
    within ``MAX_ERROR`` (``choose``), the wire model fitted on ``samples`` (the link's seconds
    at sizes near an exchange's fp32 size, timed before epoch 0), which also open the wire
    history of both directions. Epoch 0 then probes as always; its check decides from what it
    measured. Pure; the same on every rank given the same (reduced) figures."""
    fit = fit_wire(samples)
    bits = {f"{layer}/{d}": choose(fig, settings.bits, MAX_ERROR, fit, settings.objective)
            for (layer, d), fig in sorted(exchanges.items())}
    state = AutoState(bits=bits, wire={d: [list(s) for s in samples] for d in DIRECTIONS})
    record = {"bits": bits, "samples": [list(s) for s in samples],
              "wire": {"alpha_s": fit[0], "beta_s_per_byte": fit[1]},
              "exchanges": [_row(layer, d, bits[f"{layer}/{d}"], fig, settings, fit)
                            for (layer, d), fig in sorted(exchanges.items())]}
    return state, record


def _row(layer: int, direction: str, pick: int, fig: ExchangeFigures, settings: AutoSettings,
         wire: tuple[float, float]) -> dict:
    cands = (*(b for b in settings.bits if b in fig.error2), FP32)   # those measured
    return {"layer": layer, "direction": direction, "bits": pick, "compute_s": fig.compute_s,
            "error": {str(b): fig.error(b) for b in cands},
            "predicted": {str(b): predicted_cost(fig, b, wire, settings.objective)
                          for b in cands}}


# -- the policy ----------------------------------------------------------------------------------
def quant_codec(bits: int) -> WireCodec:
    return IDENTITY if bits == FP32 else WireCodec(bits=bits)


class AutoPolicy(CompressionPolicy):
    """The ``CompressionPolicy`` of ``kind = "auto"``: codecs from ``state``, which the trainer
    advances (``observe_loss`` every epoch on every rank; at a check ``decide``, on rank 0 when
    the epoch probed, then ``adopt`` of the broadcast state on every rank)."""

    adaptive = True

    def __init__(self, path: str, settings: AutoSettings):
        self.path, self.settings = path, settings
        self.num_layers: int | None = None
        self.silent: frozenset = frozenset()
        self.state = AutoState()

    def bind(self, epochs: int, num_layers: int, silent: frozenset = frozenset()) -> "AutoPolicy":
        if int(num_layers) == 1 and not self.settings.compress_last_layer:
            raise ScheduleError(
                f"schedule {self.path}: key 'compress_last_layer': has no effect on a 1-layer "
                "model: its only layer is the last, which compress_last_layer = false keeps "
                "fp32, so kind = 'auto' would decide nothing and the run would be full "
                "communication; fix: set compress_last_layer = true (auto's default), or leave "
                "out --schedule")
        bound = copy.copy(self)
        bound.num_layers, bound.state = int(num_layers), AutoState()
        bound.silent = frozenset(silent)
        return bound

    def compresses(self, layer: int, num_layers: int | None, direction: str) -> bool:
        """Whether ``layer``'s exchange in ``direction`` is ever compressed (the keys
        ``compress_last_layer`` and ``compress_backward``; never a layer that exchanges nothing
        in training, ``silent``)."""
        if layer in self.silent:
            return False
        last = num_layers is not None and layer == num_layers - 1
        if last and not self.settings.compress_last_layer:
            return False
        return direction == "forward" or self.settings.compress_backward

    def bits(self, layer: int, num_layers: int | None, direction: str) -> int:
        """The bits ``layer``'s exchange in ``direction`` sends now (32: fp32): the state's, which
        ``start`` sets before epoch 0; fp32 where nothing was decided."""
        if not self.compresses(layer, num_layers, direction):
            return FP32
        return self.state.bits.get(f"{layer}/{direction}", FP32)

    def ratio(self, epoch: int, layer: int, num_layers: int) -> float:
        return FP32 / self.bits(layer, num_layers, "forward")

    def compresses_layer(self, layer: int, num_layers: int) -> bool:
        return any(self.compresses(layer, num_layers, d) for d in ("forward", "backward"))

    def forward_codec(self, epoch: int, layer: int, num_layers: int, width: int) -> WireCodec:
        return quant_codec(self.bits(layer, num_layers, "forward"))

    def backward_codec(self, epoch: int, layer: int, num_layers: int, width: int) -> WireCodec:
        return quant_codec(self.bits(layer, num_layers, "backward"))

    # -- the loop ------------------------------------------------------------------------------
    def check(self, epoch: int) -> bool:
        """Whether a check (budget update, maybe a new decision) follows ``epoch``'s step."""
        return epoch % self.settings.every == 0

    def due(self, epoch: int) -> bool:
        """Whether ``epoch``'s training step measures the candidates (a probe epoch)."""
        return (self.check(epoch) and epoch >= self.state.next_probe
                and not self.state.settled)

    def probe(self, epoch: int, layer: int, num_layers: int, direction: str
              ) -> tuple[WireCodec, ...]:
        """The candidates ``layer``'s exchange in ``direction`` measures at ``epoch``: every
        one at the first probe; later, not those whose last measured error is above
        ``SKIP_ABOVE`` times the budget, nor those the last probe left out (the budget only
        falls, so such a candidate could pass again only if its error fell by that factor,
        which is not watched for; 1-bit rows measure 4-9 against budgets below 1), but always
        the most precise."""
        if not (self.due(epoch) and self.compresses(layer, num_layers, direction)):
            return ()
        last = self.state.measured.get(f"{layer}/{direction}")
        keep = list(self.settings.bits)
        if last is not None:
            fig = ExchangeFigures.from_dict(last)
            top = max(keep)
            keep = [b for b in keep if b == top or fig.error(b) <= SKIP_ABOVE * self.state.budget]
        return tuple(WireCodec(bits=b) for b in keep)

    def observe_loss(self, loss: float) -> None:
        """Every rank, every epoch: the globally reduced training loss."""
        self.state.window.append(float(loss))

    def observe_step(self, setting: str, seconds: float) -> None:
        """Every rank, after every epoch that did not probe: the step's seconds (the ranks'
        mean, agreed at the epoch's end) under ``setting`` (``signature`` of the bits it ran)."""
        kept = self.state.steps.setdefault(setting, [])
        kept.append(float(seconds))
        del kept[:-STEP_HISTORY]

    def decide(self, epoch: int, figures: Figures | None) -> tuple[AutoState, dict]:
        """The check's new state and record (``hpcgnn.autotune.decide``)."""
        return decide(self.state, self.settings, figures, epoch)

    def adopt(self, state: AutoState) -> None:
        """Every rank: the state of the check (rank 0's, broadcast, after a probe)."""
        self.state = state

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None:
            self.state = AutoState(**state)
