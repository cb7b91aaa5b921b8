"""Schedule file (TOML) -> ``CompressionPolicy``: the compression ratio of every exchange.

```toml
codec = "truncate"        # none | truncate | learned | random | quant | sample, or a '+' combination
kind = "linear"           # constant | linear | exponential | step | table
max_ratio = 128.0         # ratio at t = 0; ratio = fp32 bytes / bytes sent; 1.0 = uncompressed
min_ratio = 1.0
slope = 5.0
compress_last_layer = false
compress_backward = true
```
Kinds (``t`` = epoch from 0, ``T`` = the run's epochs, from ``policy.bind`` or ``epochs = T``):
``constant``: ``ratio`` (or ``max_ratio``) always. ``linear`` (the VARCO authors' formula):
``max(min_ratio, max_ratio - slope * t * (max_ratio - min_ratio) / (T - 2))``. ``exponential``:
the geometric path between the same ends, ``max(min_ratio, max_ratio * (min_ratio /
max_ratio) ** (slope * t / (T - 2)))`` — both reach ``min_ratio`` at ``t = (T - 2) / slope``.
``step``: ``max(min_ratio, max_ratio / factor ** floor(t / every))``. ``table``: ``[[phase]]``
entries ``{until_epoch, ratio}``: the ratio of the first phase with ``t < until_epoch``, the last
phase's ratio after that.

Fixed stage settings: ``bits`` (quant, when the ratio drives another stage) and ``keep`` (sample,
likewise); see ``hpcgnn.codecs.build`` for which stage the ratio drives. ``[backward]`` overrides
any of these keys for the backward (halo-gradient) exchange; ``[layers.N]`` overrides them for
layer ``N`` (and may hold its own ``[layers.N.backward]``). An override that sets ``kind``
replaces the whole rate curve, one that sets ``codec`` its ``bits``/``keep``; other
overrides tweak single keys. ``ratio()`` reports the
schedule's ratio; the exact bytes of a combined codec come from its ``block_bytes``.

``kind = "auto"`` is a closed loop, not a curve: it takes no ratio keys and no per-layer or
``[backward]`` tables, only ``codec = "quant"``, ``bits`` (the candidate widths), ``every``,
``objective``, ``compress_last_layer`` (default true for auto), ``compress_backward`` and
``probe_rows``; see
``hpcgnn.autotune``.

Every check runs at load time (layer indices at ``bind``), before any rank communicates; each
error names the file, the key and the fix.
"""
from __future__ import annotations

import copy
import difflib
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from hpcgnn.autotune import OBJECTIVES, AutoPolicy, AutoSettings
from hpcgnn.codecs.base import IDENTITY, MIN_KEEP, CompressionPolicy, WireCodec
from hpcgnn.codecs.build import CodecSpec, build_codec, parse_codec
from hpcgnn.codecs.learned import learned_pair
from hpcgnn.codecs.quant import BITS
from hpcgnn.config import SECTIONS
from hpcgnn.errors import ScheduleError

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

KINDS = ("constant", "linear", "exponential", "step", "table")  # and "auto" (hpcgnn.autotune)
RATE_KEYS = ("kind", "max_ratio", "min_ratio", "slope", "ratio", "every", "factor", "phase")
STAGE_KEYS = ("bits", "keep")
RULE_KEYS = ("codec", *RATE_KEYS, *STAGE_KEYS)
TOP_KEYS = (*RULE_KEYS, "epochs", "compress_last_layer", "compress_backward", "backward", "layers")
LAYER_KEYS = (*RULE_KEYS, "backward")
KIND_KEYS = {"constant": ("ratio", "max_ratio"), "linear": ("max_ratio", "min_ratio", "slope"),
             "exponential": ("max_ratio", "min_ratio", "slope"),
             "step": ("max_ratio", "min_ratio", "every", "factor"), "table": ("phase",)}
"""The rate keys each curve kind reads; another rate key beside it would have no effect."""
DEFAULTS = {"codec": "truncate", "kind": "linear", "max_ratio": 128.0, "min_ratio": 1.0,
            "slope": 5.0, "factor": 2.0}


class _Where:
    """Error factory for one file: ``where.error(key, problem, fix)``."""

    def __init__(self, path: str):
        self.path = path

    def error(self, key: str, problem: str, fix: str) -> ScheduleError:
        return ScheduleError(f"schedule {self.path}: key '{key}': {problem}; fix: {fix}")


@dataclass(frozen=True)
class RateCurve:
    """Ratio as a function of the epoch (see the module docstring for the formulas)."""

    kind: str
    max_ratio: float
    min_ratio: float = 1.0
    slope: float = 5.0
    every: int = 1
    factor: float = 2.0
    phases: tuple[tuple[int, float], ...] = ()

    @property
    def needs_epochs(self) -> bool:
        return self.kind in ("linear", "exponential")

    def at(self, t: int, epochs: int | None) -> float:
        """Ratio at epoch ``t`` (from 0) of a run of ``epochs`` epochs."""
        if self.kind == "constant":
            return self.max_ratio
        if self.kind == "step":
            return max(self.min_ratio, self.max_ratio / self.factor ** (t // self.every))
        if self.kind == "table":
            return next((r for until, r in self.phases if t < until), self.phases[-1][1])
        frac = self.slope * t / max(epochs - 2, 1)  # the authors' T - 2
        if self.kind == "linear":
            return max(self.min_ratio, self.max_ratio - frac * (self.max_ratio - self.min_ratio))
        return max(self.min_ratio, self.max_ratio * (self.min_ratio / self.max_ratio) ** frac)


@dataclass(frozen=True)
class ExchangeRule:
    """What one direction of one layer's exchange does: a codec and its rate curve."""

    codec: CodecSpec
    curve: RateCurve


# --- parsing -----------------------------------------------------------------------------


def _check_keys(table: dict, allowed: tuple[str, ...], prefix: str, where: _Where) -> None:
    for key in table:
        if key not in allowed:
            near = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean '{near[0]}'?" if near else f"known keys: {', '.join(allowed)}"
            raise where.error(prefix + key, "unknown key", hint)


def _number(table: dict, key: str, prefix: str, where: _Where, default: Any = None) -> Any:
    value = table.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise where.error(prefix + key, f"expected a number, got {value!r}", f"write {key} = 4.0")
    return value


def _ratio(table: dict, key: str, prefix: str, where: _Where, default: Any = None) -> Any:
    value = _number(table, key, prefix, where, default)
    if value is not None and not (value >= 1.0 and math.isfinite(value)):
        problem = "is below 1 (1 = uncompressed)" if value < 1.0 else "is not a finite number"
        raise where.error(prefix + key, f"ratio {value} {problem}", "use a finite ratio >= 1.0")
    return value


def _phases(table: dict, prefix: str, where: _Where) -> tuple[tuple[int, float], ...]:
    raw = table.get("phase")
    fix = "add [[phase]] entries with until_epoch (increasing) and ratio (non-increasing)"
    if not isinstance(raw, list) or not raw:
        raise where.error(prefix + "phase", "kind = 'table' needs a list of [[phase]]", fix)
    phases = []
    for i, entry in enumerate(raw):
        at = f"{prefix}phase[{i}]."
        if not isinstance(entry, dict):
            raise where.error(f"{prefix}phase[{i}]", "expected a table", fix)
        _check_keys(entry, ("until_epoch", "ratio"), at, where)
        until = entry.get("until_epoch")
        if isinstance(until, bool) or not isinstance(until, int) or until < 1:
            raise where.error(at + "until_epoch", f"expected an epoch >= 1, got {until!r}", fix)
        ratio = _ratio(entry, "ratio", at, where)
        if ratio is None:
            raise where.error(at + "ratio", "missing", fix)
        phases.append((until, float(ratio)))
    _check_phase_order(phases, prefix, where, fix)
    return tuple(phases)


def _check_phase_order(phases: list, prefix: str, where: _Where, fix: str) -> None:
    for i in range(1, len(phases)):
        if phases[i][0] <= phases[i - 1][0]:
            raise where.error(f"{prefix}phase[{i}].until_epoch", "phases must be in increasing "
                              "until_epoch order", fix)
        if phases[i][1] > phases[i - 1][1]:
            raise where.error(f"{prefix}phase[{i}].ratio", f"ratio increases from "
                              f"{phases[i - 1][1]} to {phases[i][1]}; VARCO's ratio must not "
                              "increase during training", fix)


def _curve(table: dict, prefix: str, where: _Where) -> RateCurve:
    kind = table.get("kind", DEFAULTS["kind"])
    if kind == "auto":
        raise where.error(prefix + "kind", "kind = 'auto' decides every layer and direction "
                          "itself and is set for the whole schedule only", "write kind = "
                          "'auto' at the top of the file and remove this override")
    if kind not in KINDS:
        kinds = (*KINDS, "auto") if not prefix else KINDS    # auto: the whole file's only
        raise where.error(prefix + "kind", f"unknown kind {kind!r}", f"use one of {', '.join(kinds)}")
    if "ratio" in table and kind != "constant":
        raise where.error(prefix + "ratio", f"'ratio' is for kind = 'constant', not {kind!r}",
                          "use max_ratio and min_ratio, or kind = 'constant'")
    if kind == "constant":
        return _constant(table, prefix, where)
    if kind == "table":
        return RateCurve("table", max_ratio=0.0, phases=_phases(table, prefix, where))
    return _decreasing(kind, table, prefix, where)


def _constant(table: dict, prefix: str, where: _Where) -> RateCurve:
    key = "ratio" if "ratio" in table else "max_ratio"
    ratio = _ratio(table, key, prefix, where)
    if ratio is None:
        raise where.error(prefix + "ratio", "kind = 'constant' needs a ratio", "add ratio = 8.0")
    return RateCurve("constant", max_ratio=float(ratio))


def _decreasing(kind: str, table: dict, prefix: str, where: _Where) -> RateCurve:
    hi = float(_ratio(table, "max_ratio", prefix, where, DEFAULTS["max_ratio"]))
    lo = float(_ratio(table, "min_ratio", prefix, where, DEFAULTS["min_ratio"]))
    if hi < lo:
        raise where.error(prefix + "max_ratio", f"max_ratio {hi} < min_ratio {lo}: the schedule "
                          "would increase; VARCO's ratio must decrease", "swap them")
    slope = float(_number(table, "slope", prefix, where, DEFAULTS["slope"]))
    if kind != "step":
        if not slope > 0:
            raise where.error(prefix + "slope", f"slope {slope} <= 0 never decreases the ratio",
                              "use a slope > 0 (5.0 reaches min_ratio after ~20 % of training)")
        return RateCurve(kind, hi, lo, slope=slope)
    return _step(hi, lo, table, prefix, where)


def _step(hi: float, lo: float, table: dict, prefix: str, where: _Where) -> RateCurve:
    every = table.get("every")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise where.error(prefix + "every", f"kind = 'step' needs every = N epochs >= 1, got "
                          f"{every!r}", "add every = 20")
    factor = float(_number(table, "factor", prefix, where, DEFAULTS["factor"]))
    if not factor > 1:
        raise where.error(prefix + "factor", f"factor {factor} <= 1 never decreases the ratio",
                          "use a factor > 1 (2.0 halves the ratio every step)")
    return RateCurve("step", hi, lo, every=every, factor=factor)


def _codec(table: dict, prefix: str, where: _Where) -> CodecSpec:
    try:
        spec = parse_codec(table.get("codec", DEFAULTS["codec"]))
    except ValueError as err:
        raise where.error(prefix + "codec", str(err), "e.g. codec = 'truncate+quant'") from None
    keep = _fixed_setting("keep", spec, table, prefix, where)
    return CodecSpec(spec.sample, spec.channels, spec.quant,
                     bits=_fixed_setting("bits", spec, table, prefix, where),
                     keep=None if keep is None else float(keep))


def _valid_bits(value: Any) -> bool:
    """An int in ``BITS`` (``2.0 in BITS`` holds in Python, and a float width fails in the codec
    at the first exchange)."""
    return isinstance(value, int) and not isinstance(value, bool) and value in BITS


def _valid_keep(value: Any) -> bool:
    """``MIN_KEEP <= keep <= 1``: the codec raises a smaller fraction to ``MIN_KEEP``, so one
    below it would not be what the file says."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and MIN_KEEP <= value <= 1


# key -> (stage, why it has no effect when that stage is the rate stage, check, wanted, fix)
_FIXED = {
    "bits": ("quant", "with quant alone the ratio sets the bits (ratio 8 -> 4 bits)",
             _valid_bits, f"bits in {BITS}", "set bits = 4"),
    "keep": ("sample", "with sample as the rate stage the ratio sets the kept fraction "
             "(1 / ratio)", _valid_keep, f"a kept fraction in [{MIN_KEEP}, 1]", "set keep = 0.5"),
}


def _fixed_setting(key: str, spec: CodecSpec, table: dict, prefix: str, where: _Where) -> Any:
    """The setting of a stage the ratio does not drive; None where the stage is absent or is the
    rate stage (setting it there is an error: it would have no effect)."""
    stage, rate_note, valid, wanted, fix = _FIXED[key]
    has_stage = getattr(spec, stage)
    if not has_stage or spec.rate_stage == stage:
        if key in table:
            why = f"the codec has no {stage} stage" if not has_stage else rate_note
            raise where.error(prefix + key, "has no effect: " + why, f"remove {key}")
        return None
    value = table.get(key)
    if not valid(value):
        raise where.error(prefix + key, f"a fixed {stage} stage needs {wanted}, got {value!r}",
                          fix)
    return value


def _rule(table: dict, prefix: str, where: _Where) -> ExchangeRule:
    table = _bits_as_rate(table, prefix, where)
    return ExchangeRule(_codec(table, prefix, where), _curve(table, prefix, where))


def _rate_stage(codec: Any) -> str | None:
    """The stage a codec name's ratio drives; None for a bad name (``_codec`` reports it)."""
    try:
        return parse_codec(codec).rate_stage
    except ValueError:
        return None


def _bits_as_rate(table: dict, prefix: str, where: _Where) -> dict:
    """``codec = "quant"`` (quant the rate stage) with ``bits = b`` and no rate keys: a constant
    ratio ``32 / b`` (which gives ``b`` bits); ``bits`` next to rate keys is a conflict."""
    if _rate_stage(table.get("codec", DEFAULTS["codec"])) != "quant" or "bits" not in table:
        return table
    given = [key for key in RATE_KEYS if key in table]
    if given:
        raise where.error(prefix + "bits", f"bits and {', '.join(prefix + k for k in given)} both "
                          "set the rate of codec 'quant' (ratio 32 / bits)",
                          "keep bits alone (a constant ratio 32 / bits) or the ratio keys alone")
    bits = table["bits"]
    if not _valid_bits(bits):
        raise where.error(prefix + "bits", f"codec 'quant' needs bits in {BITS}, got {bits!r}",
                          "e.g. bits = 2")
    rest = {k: v for k, v in table.items() if k != "bits"}
    return {**rest, "kind": "constant", "ratio": 32.0 / bits}


def _merge(base: dict, override: dict) -> dict:
    """Override rule keys; an override that sets ``kind`` replaces the whole rate curve, one that
    sets ``codec`` replaces the stage settings (``bits``, ``keep``). Where quant is the rate
    stage, ``bits`` is a curve of its own (``32 / bits``): an override's ``bits`` replaces the
    inherited rate keys, and an override's ``kind`` the inherited ``bits``."""
    merged = {k: v for k, v in base.items() if k in RULE_KEYS}
    if "kind" in override:
        merged = {k: v for k, v in merged.items() if k not in RATE_KEYS}
    if "codec" in override:
        merged = {k: v for k, v in merged.items() if k not in STAGE_KEYS}
    if _rate_stage(override.get("codec", merged.get("codec", DEFAULTS["codec"]))) == "quant":
        if "bits" in override:
            merged = {k: v for k, v in merged.items() if k not in RATE_KEYS}
        elif "kind" in override:
            merged.pop("bits", None)
    merged.update({k: v for k, v in override.items() if k in RULE_KEYS})
    return merged


def _sub_table(table: dict, key: str, prefix: str, where: _Where) -> dict:
    value = table.get(key, {})
    if not isinstance(value, dict):
        raise where.error(prefix + key, "expected a table", f"write it as [{prefix}{key}]")
    return value


def _flag(table: dict, key: str, default: bool, where: _Where) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise where.error(key, f"expected true or false, got {value!r}", f"write {key} = true")
    return value


@dataclass(frozen=True)
class LayerRules:
    """Forward and backward rules of one layer (or of every layer without an override)."""

    forward: ExchangeRule
    backward: ExchangeRule


def _unread_keys(own: dict, merged: dict, prefix: str, where: _Where) -> None:
    """The rate keys a table sets itself (``own``) that its curve's kind (``merged``'s) does not
    read: refused, as they would have no effect (e.g. ``slope`` beside ``kind = 'constant'``)."""
    kind = merged.get("kind", DEFAULTS["kind"])
    reads = KIND_KEYS.get(kind)
    if reads is None:
        return                                        # _curve reports the kind
    if kind == "constant" and "ratio" in own and "max_ratio" in own:
        raise where.error(prefix + "max_ratio", "has no effect: kind = 'constant' reads ratio "
                          "when both are set", "remove max_ratio")
    for key in RATE_KEYS:
        if key in own and key not in (*reads, "kind", "ratio"):   # ratio: _curve's message
            raise where.error(prefix + key, f"has no effect: kind = {kind!r} reads only "
                              f"{', '.join(reads)}", f"remove {key}, or set the kind that "
                              f"reads it (see the kinds in docs/compression.md)")


def _layer_rules(top: dict, layer: dict, prefix: str, where: _Where) -> LayerRules:
    fwd = _merge(top, layer)
    own_bwd = _sub_table(layer if prefix else top, "backward", prefix, where)
    bwd = _merge(_merge(fwd, _sub_table(top, "backward", "", where)),
                 _sub_table(layer, "backward", prefix, where))
    _unread_keys(layer if prefix else top, fwd, prefix, where)
    _unread_keys(own_bwd, bwd, prefix + "backward.", where)
    rules = LayerRules(_rule(fwd, prefix, where), _rule(bwd, prefix + "backward.", where))
    _backward_in_effect(rules, prefix, where)
    return rules


def _curve_reads(curve: RateCurve) -> tuple:
    """The curve as its kind reads it (a constant curve carries an unread default slope)."""
    return (curve.kind, *(curve.phases if curve.kind == "table" else
                          [getattr(curve, key) for key in KIND_KEYS[curve.kind] if key != "ratio"]))


def _backward_in_effect(rules: LayerRules, prefix: str, where: _Where) -> None:
    """Refuse a backward rule the exchange would not follow. While the forward selects rows or
    channels the backward is its adjoint (``codecs.base.backward_codec``): the gradients of
    exactly what the forward sent, with the backward rule's value stage alone. A backward with
    selecting stages or a rate of its own there had no effect (until the forward's ratio reached
    1, where it started to select gradients on its own); and ``learned`` names the pair around
    the forward exchange, so as a backward codec of its own it truncated gradients, pairless."""
    fwd, bwd = rules.forward.codec, rules.backward.codec
    if bwd.learned and not fwd.learned:
        raise where.error(prefix + "backward.codec", "'learned' has no learned encoder and decoder "
                          "in a backward exchange: the pair wraps the forward exchange, whose "
                          "backward is the gradient through it", "set codec = 'learned' for the "
                          "forward (the backward follows it), or use 'truncate' here")
    if not (fwd.sample or fwd.channels) or not (bwd.sample or bwd.channels):
        return
    same = ((bwd.sample, bwd.channels, bwd.keep) == (fwd.sample, fwd.channels, fwd.keep)
            and _curve_reads(rules.backward.curve) == _curve_reads(rules.forward.curve))
    if not same:
        raise where.error(prefix + "backward", "has no effect while the forward exchange selects "
                          "rows or channels: its backward sends the gradients of exactly the rows "
                          "and channels the forward sent, and takes only the value stage (quant "
                          "bits) from this table, not its rows, channels or ratio",
                          "give the backward a value stage only (codec = 'quant' with bits = b, "
                          "or codec = 'none'), or remove its codec and rate keys")


def _layers(top: dict, where: _Where) -> dict[int, LayerRules]:
    out = {}
    for name, table in _sub_table(top, "layers", "", where).items():
        prefix = f"layers.{name}."
        if not str(name).isdigit():
            raise where.error(f"layers.{name}", "layer overrides are named by layer index",
                              "write [layers.0], [layers.1], ...")
        if not isinstance(table, dict):
            raise where.error(f"layers.{name}", "expected a table", f"write [layers.{name}]")
        _check_keys(table, LAYER_KEYS, prefix, where)
        _check_keys(_sub_table(table, "backward", prefix, where), RULE_KEYS, prefix + "backward.",
                    where)
        out[int(name)] = _layer_rules(top, table, prefix, where)
    return out


def _epochs(top: dict, where: _Where) -> int | None:
    epochs = top.get("epochs")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                               or epochs < 1):
        raise where.error("epochs", f"expected a positive epoch count, got {epochs!r}",
                          "remove it (the trainer binds the run's epochs) or write epochs = 200")
    return epochs


# --- the policy ----------------------------------------------------------------------------


class SchedulePolicy(CompressionPolicy):
    """A ``CompressionPolicy`` built from a schedule file. Epochs count from 0."""

    def __init__(self, path: str, default: LayerRules, layers: dict[int, LayerRules],
                 compress_last_layer: bool, compress_backward: bool, epochs: int | None):
        self.path, self.default, self.layers = path, default, layers
        self.compress_last_layer, self.compress_backward = compress_last_layer, compress_backward
        self.epochs, self.num_layers = epochs, None
        self.silent: frozenset = frozenset()
        self._codec = lru_cache(maxsize=4096)(self._build)

    def bind(self, epochs: int, num_layers: int,
             silent: frozenset = frozenset()) -> "SchedulePolicy":
        where = _Where(self.path)
        bad = [layer for layer in self.layers if layer >= num_layers]
        if bad:
            raise where.error(f"layers.{bad[0]}", f"the model has {num_layers} layers "
                              f"(0..{num_layers - 1})", "remove the override or add layers")
        if not self.compress_last_layer and num_layers - 1 in self.layers:
            raise where.error(f"layers.{num_layers - 1}", "has no effect: it is the model's last "
                              "layer, which compress_last_layer = false keeps fp32",
                              "set compress_last_layer = true, or remove the override")
        if not self.compress_last_layer and self._names_codec(num_layers - 1) and not any(
                self._names_codec(layer) for layer in range(num_layers - 1)):
            raise where.error("compress_last_layer", f"has no effect on a {num_layers}-layer "
                              "model: the file compresses only its last layer, which "
                              "compress_last_layer = false keeps fp32, so the run would be full "
                              "communication", "set compress_last_layer = true (as "
                              "varco-all.toml does), or leave out --schedule")
        bound = copy.copy(self)
        bound.epochs = self.epochs if self.epochs is not None else int(epochs)
        bound.num_layers, bound.silent = int(num_layers), frozenset(silent)
        bound._codec = lru_cache(maxsize=4096)(bound._build)
        return bound

    def _rules(self, layer: int) -> LayerRules:
        return self.layers.get(layer, self.default)

    def _names_codec(self, layer: int) -> bool:
        """Whether ``layer``'s rules name a codec other than ``none`` (in a direction that is
        compressed at all), whatever ``compress_last_layer`` says."""
        rules = self._rules(layer)
        codecs = [rules.forward.codec] + [rules.backward.codec] * self.compress_backward
        return any(c.sample or c.channels or c.quant for c in codecs)

    def _compressed(self, layer: int, num_layers: int | None) -> bool:
        last = num_layers is not None and layer == num_layers - 1
        return self.compress_last_layer or not last

    def _ratio(self, rule: ExchangeRule, epoch: int) -> float:
        if rule.curve.needs_epochs and self.epochs is None:
            raise _Where(self.path).error(
                "kind", f"kind = {rule.curve.kind!r} needs the run's epoch count T",
                "the trainer calls policy.bind(epochs, num_layers), or write epochs = T")
        return rule.curve.at(epoch, self.epochs)

    def compresses_layer(self, layer: int, num_layers: int) -> bool:
        """As the base's: the layer's rules reach it and name a codec other than ``none``."""
        return self._compressed(layer, num_layers) and self._names_codec(layer)

    def ratio(self, epoch: int, layer: int, num_layers: int) -> float:
        """As the base's; 1.0 for a layer whose training steps exchange nothing (``silent``)."""
        if layer in self.silent or not self._compressed(layer, num_layers):
            return 1.0
        return self._ratio(self._rules(layer).forward, epoch)

    def _build(self, spec: CodecSpec, ratio: float, width: int) -> WireCodec:
        return build_codec(spec, ratio, width)

    def forward_codec(self, epoch: int, layer: int, num_layers: int, width: int) -> WireCodec:
        if not self._compressed(layer, num_layers):
            return IDENTITY
        rule = self._rules(layer).forward
        return self._codec(rule.codec, self._ratio(rule, epoch), width)

    def backward_codec(self, epoch: int, layer: int, num_layers: int, width: int) -> WireCodec:
        if not (self.compress_backward and self._compressed(layer, num_layers)):
            return IDENTITY
        rule = self._rules(layer).backward
        return self._codec(rule.codec, self._ratio(rule, epoch), width)

    def layer_modules(self, layer: int, width: int):
        if layer in self.learned_layers(self.num_layers):
            return learned_pair(width)
        return None, None

    def learned_layers(self, num_layers: int | None) -> list[int]:
        n = num_layers if num_layers is not None else max([0, *self.layers]) + 1
        return [i for i in range(n)
                if self._rules(i).forward.codec.learned and self._compressed(i, num_layers)]


# --- kind = "auto" -----------------------------------------------------------------------------
AUTO_KEYS = ("kind", "codec", "bits", "every", "objective", "compress_last_layer",
             "compress_backward", "probe_rows")


def _auto_refusals(top: dict, where: _Where) -> None:
    """The keys of a rate curve or of overrides: auto sets those itself."""
    for key in (*RATE_KEYS, "keep"):
        if key not in ("kind", "every") and key in top:
            raise where.error(key, "kind = 'auto' chooses the rate itself (the bits per layer "
                              "and direction, from measured error and cost)",
                              f"remove {key}, or use a curve kind (constant, linear, ...) with "
                              f"codec = 'quant' to fix the rate")
    if "epochs" in top:
        raise where.error("epochs", "has no effect: kind = 'auto' follows the loss, not a curve "
                          "over the run's epochs", "remove epochs")
    for key in ("layers", "backward"):
        if key in top:
            raise where.error(key, "kind = 'auto' decides every layer and direction itself",
                              f"remove [{key}...]; use compress_last_layer = false or "
                              "compress_backward = false to keep exchanges at fp32")
    _check_keys(top, AUTO_KEYS, "", where)
    if top.get("codec", "quant") != "quant":
        raise where.error("codec", f"kind = 'auto' drives the quant codec's bits, not "
                          f"{top['codec']!r}", "write codec = 'quant' (or leave codec out)")


def _auto_bits(top: dict, where: _Where) -> tuple[int, ...]:
    bits = top.get("bits", list(BITS))
    fix = f"a non-empty list drawn from {list(BITS)}, e.g. bits = [2, 4, 8]"
    if (not isinstance(bits, list) or not bits or not all(_valid_bits(b) for b in bits)
            or len(set(bits)) != len(bits)):
        raise where.error("bits", f"kind = 'auto' takes the candidate bit widths as a list, "
                          f"got {bits!r}", fix)
    return tuple(sorted(bits))


def _auto_every(top: dict, where: _Where) -> int:
    every = top.get("every", AutoSettings.every)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise where.error("every", f"expected a number of epochs >= 1, got {every!r}",
                          f"write every = {AutoSettings.every}")
    return every


def _auto_probe_rows(top: dict, where: _Where) -> int:
    rows = top.get("probe_rows", AutoSettings.probe_rows)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise where.error("probe_rows", f"expected a number of rows >= 0 (0: every sent row), "
                          f"got {rows!r}", f"write probe_rows = {AutoSettings.probe_rows}")
    return rows


def _auto(top: dict, where: _Where) -> AutoPolicy:
    """``kind = "auto"``: the controller's settings, checked."""
    _auto_refusals(top, where)
    objective = top.get("objective", AutoSettings.objective)
    if objective not in OBJECTIVES:
        raise where.error("objective", f"unknown objective {objective!r}",
                          f"use one of {', '.join(OBJECTIVES)}")
    return AutoPolicy(where.path, AutoSettings(
        bits=_auto_bits(top, where), every=_auto_every(top, where), objective=objective,
        compress_last_layer=_flag(top, "compress_last_layer", True, where),
        compress_backward=_flag(top, "compress_backward", True, where),
        probe_rows=_auto_probe_rows(top, where)))


def _no_backward_tables(top: dict, where: _Where) -> None:
    """``compress_backward = false`` sends every backward fp32: a backward table would have no
    effect."""
    if _flag(top, "compress_backward", True, where):
        return
    tables = ["backward"] * ("backward" in top) + [
        f"layers.{name}.backward" for name, table in _sub_table(top, "layers", "", where).items()
        if isinstance(table, dict) and "backward" in table]
    if tables:
        raise where.error(tables[0], "has no effect: compress_backward = false sends every "
                          "backward exchange fp32", f"set compress_backward = true, or remove "
                          f"[{tables[0]}]")


def parse_schedule(top: dict, path: str = "<schedule>") -> CompressionPolicy:
    """A policy from an already-parsed schedule table; every check runs here."""
    where = _Where(path)
    config = [key for key in SECTIONS if isinstance(top.get(key), dict)]
    if config:
        raise where.error(config[0], f"[{config[0]}] is a run config's section: this file is a "
                          "run config, not a compression schedule", "pass it with --config, and "
                          "give --schedule a schedule file (configs/schedules/)")
    if top.get("kind") == "auto":
        return _auto(top, where)
    for key in [k for k in AUTO_KEYS if k not in TOP_KEYS]:       # one order on every rank
        if key in top:
            raise where.error(key, "is a key of kind = 'auto' only, and this file's kind is "
                              f"{top.get('kind', DEFAULTS['kind'])!r}", "add kind = 'auto' "
                              f"(see configs/schedules/auto.toml), or remove {key}")
    _check_keys(top, TOP_KEYS, "", where)
    _check_keys(_sub_table(top, "backward", "", where), RULE_KEYS, "backward.", where)
    _no_backward_tables(top, where)
    default, layers = _layer_rules(top, {}, "", where), _layers(top, where)
    epochs = _epochs(top, where)
    rules = [r for pair in (default, *layers.values()) for r in (pair.forward, pair.backward)]
    if epochs is not None and not any(rule.curve.needs_epochs for rule in rules):
        raise where.error("epochs", "has no effect: only kind = 'linear' or 'exponential' reads "
                          "the run's epoch count, and no curve of this file is one",
                          "remove epochs")
    return SchedulePolicy(path, default, layers, _flag(top, "compress_last_layer", False, where),
                          _flag(top, "compress_backward", True, where), epochs)


def load_schedule(path: str | Path) -> CompressionPolicy:
    """Read and validate a schedule file; raises ScheduleError naming the file, key and fix."""
    path = Path(path)
    try:
        top = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ScheduleError(f"schedule {path}: file not found; fix: pass an existing "
                            "--schedule file (see configs/schedules/)") from None
    except (OSError, UnicodeDecodeError) as err:     # a directory, unreadable, not text
        raise ScheduleError(f"schedule {path}: cannot be read as a TOML text file ({err}); fix: "
                            "pass a schedule file (see configs/schedules/)") from None
    except tomllib.TOMLDecodeError as err:
        raise ScheduleError(f"schedule {path}: not valid TOML ({err}); fix: correct the "
                            "syntax") from None
    if not top:                 # parse_schedule({}) is VARCO's default curve; a file says so
        raise ScheduleError(f"schedule {path}: the file sets no key (it is empty or only "
                            "comments); fix: write the schedule's keys (e.g. kind, codec; see "
                            "configs/schedules/), or leave out --schedule to train uncompressed")
    return parse_schedule(top, str(path))
