"""Which combinations of settings a run can train with: the ONE place every refusal lives.

``check_combination(cfg, policy, where)`` refuses, before any rank communicates, every
combination of training method, parallel algorithm, architecture, staleness and schedule
(over all its epochs and layers) that hpcgnn does not support, naming the keys and the fix.
``load_config`` calls it without a schedule (so a config that can never run is a config error
at once); the builder (``hpcgnn.train.build``) calls it again with the run's schedule.

What is refused, and why:
- ``train.method = 'retexo'``: GAT (not built for it), an algorithm other than ``halo``,
  staleness (RETEXO exchanges once per layer: nothing to make stale), ``train.epochs`` other
  than ``model.layers * train.rounds_per_layer``, and the ``learned`` codec (no gradient
  crosses RETEXO's exchange, so its encoder could not train).
- ``parallel.algorithm`` other than ``halo`` (CAGNET): a schedule or staleness (its products
  run uncompressed and synchronous) and GAT (its attention changes the adjacency every step).
- ``train.staleness >= 1`` with the ``learned`` codec (its encoder would train on rows of
  another epoch).
- a closed-loop schedule (``kind = "auto"``) with ``train.method = 'retexo'`` (each layer's rows
  cross the wire once: there is no loop to close) or with ``train.staleness >= 1`` (the stale
  exchange hides the wire time the controller weighs, and its rows are of another epoch).
- ``train.keep_features = true`` with an algorithm other than ``halo``, with
  ``train.method = 'retexo'`` or with the ``learned`` codec (the first layer's encoder would
  see no row).
- ``train.eval_features = 'kept'`` with an algorithm other than ``halo`` (no halo rows), with
  ``train.method = 'retexo'``, or with ``train.eval_codec = 'train'`` where training exchanges
  its first layer (its rows go through the training codecs; kept rows would be exact).
- a schedule that compresses no exchange of the run: where ``train.staleness >= 1`` or
  ``train.keep_features = true`` keeps the first layer's halo rows, one that compresses the
  first layer and no later one (``compress_last_layer = false`` on a 2-layer model), unless
  evaluation exchanges the first layer through it (``eval_codec = 'train'``,
  ``eval_features = 'exchange'``).
- ``model.arch = 'gat'`` with ``train.staleness >= 1``, ``train.smoothing > 0`` and a schedule
  whose forward ``sample`` stage is on at any epoch of a stale layer (any but the first): a GAT
  layer attends over the halo rows of one epoch's sample (the epoch they were sent at,
  ``hpcgnn.nn.gat``), and a smoothed row is an average over several epochs' samples, which no
  one sample's mask describes. Without smoothing the combination trains (docs/gat.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpcgnn.errors import ConfigError, toml_value

if TYPE_CHECKING:       # not at run time: loading a config (hpcgnn summary, plot) needs no torch
    from hpcgnn.codecs.base import CompressionPolicy

RETEXO_ARCHS = ("gcn", "sage")


def _full(policy) -> bool:
    """No schedule, or the full-precision one (a policy exists only where its module is loaded)."""
    if policy is None:
        return True
    from hpcgnn.codecs.base import FULL_PRECISION  # noqa: PLC0415  (torch: only with a policy)
    return policy is FULL_PRECISION


def _need(ok: bool, where: str, key: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {key} = {toml_value(value)} is not allowed; {fix}")


def check_combination(cfg, policy: CompressionPolicy | None = None,
                      where: str = "<config>") -> None:
    """Raise ``ConfigError`` naming the keys and the fix for an unsupported combination of the
    run config ``cfg`` (an ``hpcgnn.config.Config``). ``policy``: the run's schedule (None:
    check the config alone)."""
    _check_method(cfg, where)
    _check_algorithm(cfg, policy, where)
    _check_eval_features(cfg, where)
    _check_keep_features(cfg, where)
    if _full(policy):
        return
    bound = policy.bind(cfg.train.epochs, cfg.model.layers)
    sched = f"schedule {getattr(policy, 'path', '<schedule>')}"
    learned = bound.learned_layers(cfg.model.layers)
    _need(not (learned and cfg.train.method == "retexo"), sched, "codec", "learned",
          "the 'learned' codec does not combine with train.method = 'retexo' (no gradient "
          "crosses RETEXO's exchange, so its encoder could not train); use truncate, random, "
          "quant or sample")
    _need(not (learned and cfg.train.staleness), sched, "codec", "learned",
          "train.staleness >= 1 does not combine with the 'learned' codec (its encoder would "
          "train on rows of another epoch); use truncate, random, quant or sample, or "
          "staleness = 0")
    _need(not (learned and cfg.train.keep_features), sched, "codec", "learned",
          "train.keep_features = true does not combine with the 'learned' codec (the first "
          "layer's encoder would never see a row); use truncate, random, quant or sample, or "
          "train.keep_features = false")
    _check_kept_first_layer(cfg, bound, sched, where)
    if bound.adaptive:
        _check_auto(cfg, sched)
    if cfg.model.arch == "gat" and cfg.train.smoothing:
        _check_gat_sampling(cfg, bound, sched)


def _check_auto(cfg, sched: str) -> None:
    """What a closed-loop schedule (``kind = "auto"``) does not combine with."""
    _need(cfg.train.method != "retexo", sched, "kind", "auto",
          "train.method = 'retexo' exchanges each layer's rows once, so there is no loop for "
          "kind = 'auto' to close; use a curve kind (e.g. codec = 'quant', bits = 4) or "
          "train.method = 'full'")
    _need(not cfg.train.staleness, sched, "kind", "auto",
          "train.staleness >= 1 hides the wire time kind = 'auto' weighs against the codec's "
          "error; use a curve kind (e.g. codec = 'quant', bits = 2) with staleness, or "
          "train.staleness = 0 with kind = 'auto'")


def _check_kept_first_layer(cfg, policy: CompressionPolicy, sched: str, where: str) -> None:
    """A schedule that would change nothing: it compresses the first layer's exchange, which
    training never makes (``train.staleness >= 1`` or ``train.keep_features`` keep its halo
    rows; the halo algorithm's full training), and none of the later layers'."""
    t, layers = cfg.train, cfg.model.layers
    if not (t.staleness or t.keep_features) or t.method != "full" \
            or cfg.parallel.algorithm != "halo":
        return
    if not policy.compresses_layer(0, layers) or (t.eval_codec == "train"
                                                  and t.eval_features == "exchange"):
        return       # nothing of the schedule is lost, or evaluation's first layer uses it
    key = "train.staleness >= 1" if t.staleness else "train.keep_features = true"
    _need(layers > 1, f"{where} with {sched}", "model.layers", layers,
          f"with {key} the only layer of a 1-layer model runs on the first layer's halo rows "
          f"fetched once and kept, so no training step exchanges and the schedule would change "
          f"nothing; drop --schedule")
    _need(any(policy.compresses_layer(i, layers) for i in range(1, layers)), sched,
          "compress_last_layer", False,
          f"with {key} the first layer's halo rows are fetched once and kept, so of the "
          f"model.layers = {layers} layers only the later ones exchange, and this schedule "
          f"compresses none of them (it would change nothing); set compress_last_layer = true, "
          f"or drop --schedule")


def _check_method(cfg, where: str) -> None:
    """What ``train.method = 'retexo'`` needs from the other sections."""
    t, m = cfg.train, cfg.model
    if t.method != "retexo":
        return
    _need(m.arch in RETEXO_ARCHS, where, "model.arch", m.arch,
          "train.method = 'retexo' supports 'gcn' and 'sage' only (GAT is not built for it); "
          "use one of those or train.method = 'full'")
    _need(cfg.parallel.algorithm == "halo", where, "parallel.algorithm", cfg.parallel.algorithm,
          "train.method = 'retexo' runs on the halo algorithm; use parallel.algorithm = 'halo'")
    _need(t.staleness == 0, where, "train.staleness", t.staleness,
          "train.method = 'retexo' exchanges once per layer, so there is nothing to make stale; "
          "use train.staleness = 0")
    want = m.layers * t.rounds_per_layer
    _need(t.epochs == want, where, "train.epochs", t.epochs,
          f"train.method = 'retexo' trains model.layers = {m.layers} layers for "
          f"train.rounds_per_layer = {t.rounds_per_layer} rounds each, {want} epochs in all; "
          f"set train.epochs = {want}, or train.rounds_per_layer = train.epochs / {m.layers}")


def _check_algorithm(cfg, policy: CompressionPolicy | None, where: str) -> None:
    """CAGNET's algorithms: uncompressed, synchronous, a fixed adjacency."""
    algo = cfg.parallel.algorithm
    if algo == "halo":
        return
    _need(cfg.model.arch != "gat", where, "parallel.algorithm", algo,
          f"{algo} multiplies a fixed adjacency and GAT's attention changes it every step; use "
          f"parallel.algorithm = 'halo' with model.arch = 'gat'")
    _need(not cfg.train.staleness, where, "train.staleness", cfg.train.staleness,
          f"parallel.algorithm = '{algo}' runs uncompressed and synchronous: drop "
          f"train.staleness, or use parallel.algorithm = 'halo'")
    _need(_full(policy), where, "--schedule",
          getattr(policy, "path", "given"),
          f"parallel.algorithm = '{algo}' runs uncompressed and synchronous: drop --schedule, "
          f"or use parallel.algorithm = 'halo'")


def _check_eval_features(cfg, where: str) -> None:
    """``train.eval_features = 'kept'``: the halo algorithm's full training, and evaluation
    that does not claim to see the training codecs' first layer."""
    t = cfg.train
    if t.eval_features != "kept":
        return
    _need(cfg.parallel.algorithm == "halo", where, "train.eval_features", t.eval_features,
          f"parallel.algorithm = '{cfg.parallel.algorithm}' has no halo rows to keep; use "
          f"train.eval_features = 'auto' or 'exchange'")
    _need(t.method == "full", where, "train.eval_features", t.eval_features,
          f"train.method = '{t.method}' evaluates its own way; use train.eval_features = 'auto' "
          f"or 'exchange'")
    _need(not (t.eval_codec == "train" and not t.staleness and not t.keep_features), where,
          "train.eval_features", t.eval_features,
          "with train.eval_codec = 'train' evaluation goes through the training codecs, and a "
          "synchronous run's first layer sends its rows through them; kept rows would be exact. "
          "Use train.eval_features = 'exchange' (or 'auto'), train.eval_codec = 'none', or "
          "train.keep_features = true (training's first layer on kept rows too)")


def _check_keep_features(cfg, where: str) -> None:
    """``train.keep_features``: the halo algorithm's full training."""
    t = cfg.train
    if not t.keep_features:
        return
    _need(cfg.parallel.algorithm == "halo", where, "train.keep_features", True,
          f"parallel.algorithm = '{cfg.parallel.algorithm}' has no halo rows to keep; use "
          f"train.keep_features = false")
    _need(t.method == "full", where, "train.keep_features", True,
          f"train.method = '{t.method}' exchanges each layer's rows once already; use "
          f"train.keep_features = false")


def _check_gat_sampling(cfg, policy: CompressionPolicy, sched: str) -> None:
    """Refuse GAT with staleness and smoothing when the schedule's forward samples the halo
    rows of a stale layer (any but the first: a stale run's first layer keeps the features'
    rows) at any epoch."""
    layers = cfg.model.layers
    for epoch in range(cfg.train.epochs):
        for layer in range(1, layers):
            _need(policy.forward_codec(epoch, layer, layers, 64).keep == 1.0, sched, "codec",
                  "sample",   # the stage, as files name it
                  f"layer {layer}: the schedule's 'sample' stage (BNS-GCN) is on from epoch "
                  f"{epoch}, and with model.arch = 'gat' and train.staleness = "
                  f"{cfg.train.staleness} that layer attends over the halo rows of the epoch "
                  f"they were sent at, each epoch's sample its own, while train.smoothing = "
                  f"{cfg.train.smoothing} averages rows of several epochs' samples, which no one "
                  f"sample's attention mask describes. Use train.smoothing = 0 with sample, or "
                  f"truncate, random or quant with smoothing")
