"""The run config: a TOML file (every key optional) -> frozen, validated dataclasses.

``load_config(path, overrides)`` reads ``path`` (or only defaults when ``path`` is None), applies
``--set section.key=value`` overrides and validates. Every error is a ``ConfigError`` that names
the file, the key and the fix; an unknown section or key is an error, not a silent default.
"""
from __future__ import annotations

import difflib
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from hpcgnn.combinations import check_combination
from hpcgnn.errors import ConfigError, toml_value

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "gcn"
    """gcn | sage | gat"""
    hidden: int = 16
    """hidden channels of every layer but the last (gat: per head)"""
    layers: int = 2
    """number of message-passing layers (>= 1)"""
    dropout: float = 0.5
    """dropout probability on every layer's input, in [0, 1)"""
    heads: int = 1
    """gat: attention heads of every hidden layer, concatenated (PyG's Cora GAT: 8)"""
    out_heads: int = 1
    """gat: attention heads of the last layer, averaged (GAT paper: 1 on Cora, 8 on PubMed)"""
    attn_dropout: float = 0.0
    """gat: dropout probability of the attention coefficients, in [0, 1) (PyG's example: 0.6)"""

    def check(self, where: str) -> None:
        _need(self.arch in ("gcn", "sage", "gat"), where, "model.arch", self.arch,
              "use 'gcn', 'sage' or 'gat'")
        _need(self.hidden >= 1, where, "model.hidden", self.hidden, "use an integer >= 1")
        _need(self.layers >= 1, where, "model.layers", self.layers, "use an integer >= 1")
        _need(0.0 <= self.dropout < 1.0, where, "model.dropout", self.dropout,
              "use a probability in [0, 1)")
        for key in ("heads", "out_heads"):
            _need(getattr(self, key) >= 1, where, f"model.{key}", getattr(self, key),
                  "use an integer >= 1")
        _need(0.0 <= self.attn_dropout < 1.0, where, "model.attn_dropout", self.attn_dropout,
              "use a probability in [0, 1)")
        for key, default in (("heads", 1), ("out_heads", 1), ("attn_dropout", 0.0)):
            _need(self.arch == "gat" or getattr(self, key) == default, where, f"model.{key}",
                  getattr(self, key), "it applies to model.arch = 'gat' only; remove it")
        _need(self.layers > 1 or self.heads == 1, where, "model.heads", self.heads,
              "it sets the heads of the hidden layers, and with model.layers = 1 there is none "
              "(the one layer is the last); set model.out_heads instead")


@dataclass(frozen=True)
class DataConfig:
    normalize_features: bool = False
    """row-normalise the features (bag-of-words features such as Cora's)"""

    def check(self, where: str) -> None:
        pass


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 200
    """training epochs (full-batch: one step each)"""
    lr: float = 0.01
    """Adam learning rate"""
    weight_decay: float = 5e-4
    """Adam (L2) weight decay"""
    weight_decay_on: str = "all"
    """which parameters are decayed: all (every model parameter, the default) | first_layer
    (Kipf & Welling's GCN decays layer 0 only) | weights (weight matrices, no biases)"""
    weight_decay_codec: bool = False
    """decay the learned codec's encoder/decoder too (off: they are not model weights)"""
    seed: int = 0
    """seed of the initial parameters and of the dropout masks"""
    eval_every: int = 1
    """evaluate every this many epochs (and always at the last)"""
    eval_codec: str = "none"
    """none (evaluation exchanges uncompressed, the default) | train (through the training
    schedule's codecs of the evaluated epoch: what the compressed model sees). RETEXO evaluates
    on each stage's input rows as its one exchange sent them (through the schedule) either way"""
    keep_features: bool = False
    """a synchronous run fetches the features' halo rows once and keeps them on the rank (n_halo
    x F_in fp32): its first layer then computes the halo terms itself (dropout on the receiving
    side, keyed by global id) and never exchanges, forward or backward; the same model and the
    same losses up to rounding. A stale run always does this. Not with CAGNET, RETEXO or the
    learned codec"""
    eval_features: str = "auto"
    """how evaluation's first layer gets its halo rows: exchange (as a synchronous training
    layer does, at every evaluation) | kept (the features' halo rows are fetched once,
    uncompressed, and kept on the rank, n_halo x F_in fp32; evaluation's first layer then sends
    nothing) | auto (kept where training keeps them anyway: a stale run, or keep_features;
    exchange otherwise). Not with CAGNET or RETEXO; kept not with eval_codec = "train" where
    training exchanges its first layer"""
    betas: tuple = (0.9, 0.999)
    """Adam's (beta1, beta2)"""
    overlap: bool = False
    """overlap the halo exchange with the aggregation of the owned rows (Ialltoallv). Off by
    default: on CPU ranks over shared memory it cost 18 % of the epoch (bench/epoch.py), since
    Open MPI progresses the exchange only inside MPI calls; try it where the network or the
    MPI has asynchronous progress"""
    staleness: int = 0
    """0 = synchronous. s >= 1 (PipeGCN, Sylvie): the halo rows and halo gradients used at
    epoch t were exchanged at epoch t - s (non-blocking, while epochs t-s..t compute); the
    first s epochs exchange synchronously (a warm-up instead of PipeGCN's zeros)"""
    smoothing: float = 0.0
    """PipeGCN's correction of stale rows and gradients: avg <- m * avg + (1 - m) * received
    (0 = off; PipeGCN uses 0.95); with staleness >= 1 only"""
    method: str = "full"
    """full (every layer's halo rows exchanged every step) | retexo (RETEXO's lazy message
    passing: train layer by layer, each layer's input rows exchanged once; hpcgnn.train.retexo)"""
    rounds_per_layer: int = 200
    """retexo (only): rounds (full-batch steps) spent on each layer. ``train.epochs`` counts
    rounds over all layers, so it must equal ``model.layers * rounds_per_layer``"""

    def check(self, where: str) -> None:
        _need(self.epochs >= 1, where, "train.epochs", self.epochs, "use an integer >= 1")
        _need(self.staleness >= 0, where, "train.staleness", self.staleness,
              "use 0 (synchronous) or an integer >= 1 (epochs of staleness)")
        _need(0.0 <= self.smoothing < 1.0, where, "train.smoothing", self.smoothing,
              "use a momentum in [0, 1) (0 = off, PipeGCN: 0.95)")
        _need(self.lr > 0, where, "train.lr", self.lr, "use a positive learning rate")
        _need(self.weight_decay >= 0, where, "train.weight_decay", self.weight_decay, "use >= 0")
        _need(self.weight_decay_on in ("all", "first_layer", "weights"), where,
              "train.weight_decay_on", self.weight_decay_on, "use 'all', 'first_layer' or 'weights'")
        _need(0 <= self.seed < 2**31, where, "train.seed", self.seed, "use an integer in [0, 2^31)")
        _need(self.eval_every >= 1, where, "train.eval_every", self.eval_every, "use an integer >= 1")
        _need(self.eval_codec in ("none", "train"), where, "train.eval_codec", self.eval_codec,
              "use 'none' (uncompressed evaluation) or 'train' (the training codecs)")
        _need(self.eval_features in ("auto", "exchange", "kept"), where, "train.eval_features",
              self.eval_features, "use 'auto', 'exchange' or 'kept'")
        _need(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), where,
              "train.betas", list(self.betas), "use two numbers in [0, 1), e.g. [0.9, 0.999]")
        _need(self.method in METHODS, where, "train.method", self.method,
              "use 'full' or 'retexo'")
        _need(self.rounds_per_layer >= 1, where, "train.rounds_per_layer", self.rounds_per_layer,
              "use an integer >= 1")
        # keys that only one method reads: set elsewhere they would change nothing
        _need(self.smoothing == 0.0 or self.staleness >= 1, where, "train.smoothing",
              self.smoothing, "it corrects stale rows, so it applies with train.staleness >= 1 "
              "only; remove it, or set train.staleness")
        _need(self.method == "retexo" or self.rounds_per_layer == _default(TrainConfig,
                                                                           "rounds_per_layer"),
              where, "train.rounds_per_layer", self.rounds_per_layer,
              "it applies to train.method = 'retexo' only; remove it")


ALGORITHMS = ("halo", "1.5d", "2d", "3d")


@dataclass(frozen=True)
class ParallelConfig:
    algorithm: str = "halo"
    """halo (vertex partition, Alltoallv of boundary rows) | 1.5d (CAGNET: block rows
    replicated on `replication` ranks; the job has K * replication ranks for a K-part set) |
    2d (CAGNET SUMMA: P = q x q ranks, q dividing K) | 3d (CAGNET split-3D: P = q^3 ranks, q^2
    dividing K)"""
    replication: int = 1
    """1.5d: c, the ranks that hold each block row (the rank count must divide by c^2)"""

    def check(self, where: str) -> None:
        _need(self.algorithm in ALGORITHMS, where, "parallel.algorithm", self.algorithm,
              "use 'halo', '1.5d', '2d' or '3d'")
        _need(self.replication >= 1, where, "parallel.replication", self.replication,
              "use an integer >= 1")
        _need(self.algorithm == "1.5d" or self.replication == 1, where, "parallel.replication",
              self.replication, "replication applies to parallel.algorithm = '1.5d' only")


@dataclass(frozen=True)
class CommConfig:
    transport: str = "auto"
    """auto | alltoallv | neighbor (Neighbor_alltoallv on a dist-graph communicator); auto
    picks neighbor at >= 8 ranks when every rank exchanges with at most half of them.
    HPCGNN_EXCHANGE overrides it"""
    max_message: int = 2147483647
    """bytes one MPI call may move (what a rank sends, and what it receives, in one call); an
    exchange past it on any rank goes in rounds of max_message / k bytes a block (k: the most
    peers a rank exchanges with), the gradient Allreduce and the broadcasts of the parameters
    and the checkpoint in pieces of max_message bytes; at least P - 1 and 4 on P ranks (halo),
    refused at start-up below that (HPCGNN_MAX_MESSAGE)"""
    progress: str = "test"
    """how a non-blocking (stale) exchange advances: test (MPI_Test at layer boundaries) |
    fine (also between the products inside each layer, forward and backward) | thread (a
    progress thread; needs MPI_THREAD_MULTIPLE). HPCGNN_PROGRESS overrides it"""
    cuda_aware: str = "auto"
    """auto (ask the MPI library) | true (hand device buffers to MPI) | false (stage through
    pinned host memory). HPCGNN_CUDA_AWARE (1 / 0) overrides it"""

    def check(self, where: str) -> None:
        for key, allowed in (("transport", ("auto", "alltoallv", "neighbor")),
                             ("progress", ("test", "fine", "thread")),
                             ("cuda_aware", ("auto", "true", "false"))):
            value = getattr(self, key)
            _need(value in allowed, where, f"comm.{key}", value,
                  "use " + ", ".join(repr(a) for a in allowed))
        _need(1 <= self.max_message <= 2147483647, where, "comm.max_message", self.max_message,
              "use a byte count in [1, 2^31 - 1]")


@dataclass(frozen=True)
class RunConfig:
    out: str = "runs/latest"
    """run directory: metrics.jsonl, summary.json, checkpoint.pt"""
    checkpoint_every: int = 0
    """write a checkpoint every this many epochs; 0 = only at the end"""

    def check(self, where: str) -> None:
        _need(bool(self.out), where, "run.out", self.out, "give a directory path")
        _need(self.checkpoint_every >= 0, where, "run.checkpoint_every", self.checkpoint_every,
              "use an integer >= 0 (0 = only at the end)")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return asdict(self)


METHODS = ("full", "retexo")


_SECTION_TYPES = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "comm": CommConfig,
                  "parallel": ParallelConfig, "run": RunConfig}
SECTIONS = tuple(_SECTION_TYPES)
"""The run config's sections (a schedule file holding one is a run config given as a schedule)."""


def _default(cls: type, key: str) -> Any:
    """The default of field ``key`` of the config section ``cls``."""
    return next(f.default for f in fields(cls) if f.name == key)


def _need(ok: bool, where: str, key: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {key} = {toml_value(value)} is not allowed; {fix}")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read the run config at ``path`` (defaults only if None), apply ``overrides``, validate."""
    raw = _read_toml(path) if path is not None else {}
    for item in overrides:
        section, key, value = _parse_override(item)
        raw.setdefault(section, {})[key] = value
    return build_config(raw, config_source(path, overrides))


def config_source(path: str | Path | None, overrides: list[str] = ()) -> str:
    """How errors name a run config: its file (or ``<defaults>``), and whether --set changed it."""
    where = str(path) if path is not None else "<defaults>"
    return where + (" (with --set overrides)" if overrides else "")


def build_config(raw: dict, where: str = "<config>") -> Config:
    """Nested dict (as read from TOML) -> validated Config."""
    parts = {}
    for section, table in raw.items():
        if section not in _SECTION_TYPES and not isinstance(table, dict):
            raise ConfigError(f"{where}: '{section}' is a key outside any [section], and a run "
                              f"config holds only the sections {sorted(_SECTION_TYPES)}; fix: if "
                              f"this file is a compression schedule (codec, kind, ...), pass it "
                              f"with --schedule and give --config a run config such as "
                              f"configs/cora.toml; else move '{section}' into its section")
        if section not in _SECTION_TYPES:
            raise ConfigError(f"{where}: unknown section [{section}]; "
                              f"{_did_you_mean(section, _SECTION_TYPES)}valid sections are "
                              f"{sorted(_SECTION_TYPES)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: '{section}' must be a table [{section}]")
        parts[section] = _build_section(_SECTION_TYPES[section], section, table, where)
    cfg = Config(**parts)
    for section in _SECTION_TYPES:
        getattr(cfg, section).check(where)
    check_combination(cfg, where=where)
    return cfg


def _build_section(cls: type, section: str, table: dict, where: str):
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key {section}.{key}; "
                              f"{_did_you_mean_key(section, key)}valid keys of "
                              f"[{section}] are {sorted(known)}")
        values[key] = _coerce(value, known[key].type, f"{section}.{key}", where,
                              known[key].default)
    return replace(cls(), **values)


def _did_you_mean(name: str, valid, prefix: str = "") -> str:
    """'did you mean 'train.epochs'? ' for the closest valid name, or '' when none is close."""
    near = difflib.get_close_matches(name, sorted(valid), n=1)
    return f"did you mean '{prefix}{near[0]}'? " if near else ""


def _did_you_mean_key(section: str, key: str) -> str:
    """The closest key of ``[section]``, else the same key in another section ('' if none)."""
    hint = _did_you_mean(key, [f.name for f in fields(_SECTION_TYPES[section])], f"{section}.")
    elsewhere = [s for s, cls in _SECTION_TYPES.items() if key in {f.name for f in fields(cls)}]
    return hint or (f"did you mean '{elsewhere[0]}.{key}'? " if elsewhere else "")


def _coerce(value: Any, type_name: Any, key: str, where: str, default: Any = None) -> Any:
    """Check a TOML value against the field's type (ints are accepted for floats; a ``tuple``
    field takes an array of numbers); a wrong type is refused with the field's default as the
    example of a right one."""
    if str(type_name) == "tuple":
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{where}: {key} = {value!r} must be an array of numbers, "
                              f"e.g. [0.9, 0.999]")
        if not all(math.isfinite(v) for v in value):
            raise ConfigError(f"{where}: {key} = {value!r} is not allowed; every number of the "
                              f"run config must be finite (TOML's inf and nan are refused)")
        return tuple(float(v) for v in value)
    want = {"int": int, "float": float, "bool": bool, "str": str}[str(type_name)]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: {key} = {value!r} is not allowed; every number of the run "
                          f"config must be finite (TOML's inf and nan are refused)")
    if isinstance(value, want) and not (want is int and isinstance(value, bool)):
        return value
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    example = (json.dumps(default) if isinstance(default, want) and not (want is int and
               isinstance(default, bool)) else None)
    raise ConfigError(f"{where}: {key} = {value!r} has type {type(value).__name__}; it must be "
                      f"{words[want]}" + (f", e.g. {key} = {example}" if example else ""))


def _read_toml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; pass an existing TOML file to --config "
                          f"(e.g. configs/cora.toml)")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc}); fix the syntax") from exc


def _parse_override(item: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value parsed as a TOML value, else a string)."""
    name, sep, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set train.epochs=10")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return section, key.strip(), value
