"""The start-up agreement: every rank built its job, and every rank built it from the same inputs.

A job whose ranks read different inputs does not fail cleanly later: a rank with another shard
set's ``meta.json`` posts other message sizes (``MPI_ERR_TRUNCATE``, or memory errors), one with
another ``train.epochs`` or ``HPCGNN_EXCHANGE`` waits in a collective the others never enter,
and one with another ``train.lr`` or seed trains a model that is silently a mix. Launchers make
this easy (a per-node copy of the shards that is stale, a wrapper that passes other arguments,
an environment set on one node, a node with another install). So each rank condenses what it
will compute from into ``facts`` (the resolved config, the schedule, the shard set's
``meta.json`` sha256, the ``HPCGNN_*`` environment that changes what ranks compute or send, the
command's options, the package's version and source digest, and torch's version) and a 62-bit
digest of them, and the start-up ``Allreduce`` that tells whether any rank failed carries the
digest's minimum and maximum as well: still one small Allreduce on the good path. Where the
digests differ, rank 0 gathers every rank's facts and says which differ between which ranks;
every rank then ends with exit code 2, before any exchange.

Each rank checks its own part file against the sha256 in its ``meta.json`` when it loads it, so
equal ``meta.json`` digests mean equal shard sets, wherever each rank's copy lives.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from hpcgnn.comm.context import CommContext
from hpcgnn.comm.settings import hpcgnn_environment
from hpcgnn.train.records import flatten

# Settings each rank may hold for itself: they change neither a value computed nor a message's
# layout (logging, the allocator, whether MPI gets device buffers, the CPU kernel's build, the
# GPU kernels' use: the wire bytes are the same bit for bit).
LOCAL_ENV = frozenset({"HPCGNN_LOG_ALL_RANKS", "HPCGNN_MALLOC", "HPCGNN_CUDA_AWARE",
                       "HPCGNN_NATIVE", "HPCGNN_TRITON"})
SHARDS = "shard set meta.json"     # "sha256 <12 hex> (<path>)": only the sha256 must agree
FIX = ("fix: start every rank with the same --config, --set, --schedule, HPCGNN_* environment "
       "and hpcgnn install, and a copy of the same shard set (`python -m preprocess verify DIR` "
       "on each node; recopy a stale one)")


def startup_facts(record, args, version: str) -> dict[str, str]:
    """What this rank computes from, as ``{name: value}`` (strings), from its run ``record``
    (``hpcgnn.train.records.RunRecord``) and command-line ``args``."""
    facts = {f"config {k}": repr(v) for k, v in flatten(record.config).items()}
    env = {k: v for k, v in hpcgnn_environment().items() if k not in LOCAL_ENV}
    facts.update({f"environment {k}": v for k, v in env.items()})
    text = record.schedule_text
    facts["schedule"] = "none" if text is None else (
        f"{record.schedule_path} (sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]})")
    facts[SHARDS] = f"sha256 {record.meta_sha256[:12]} ({record.shards_path})"
    for opt in ("out", "resume", "force", "stop_after"):
        facts[f"--{opt.replace('_', '-')}"] = repr(getattr(args, opt, None))
    facts["hpcgnn version"] = f"{version} (source sha256 {source_digest()})"
    facts["torch version"] = torch.__version__     # every rank steps its own copy of the weights
    return facts


def source_digest() -> str:
    """12 hex digits of the sha256 of hpcgnn's Python source (names and bytes; 2 ms for its
    0.6 MB here): ranks that import different code under one version number differ here."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        h.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:12]


def digest(facts: dict[str, str]) -> int:
    """62 bits of the facts' sha256 (so that its negation fits an int64). The shard set's path
    is left out: equal contents at other paths (node-local copies) are the same input."""
    blob = json.dumps({k: _compared(k, v) for k, v in facts.items()}, sort_keys=True).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 2


def _compared(key: str, value: str) -> str:
    """The part of a fact that must agree: all of it, but the shard set's sha256 alone."""
    return value.split(" (")[0] if key == SHARDS else value


def agree(ctx: CommContext, failed: bool, mine: int) -> tuple[bool, bool]:
    """(any rank failed, the ranks' digests differ), the same on every rank: one Allreduce (MIN)
    of three int64 (a failed rank passes digest 0; its failure is what is reported)."""
    if ctx.size == 1:
        return failed, False
    from mpi4py import MPI
    v = np.array([-int(failed), mine, -mine], dtype=np.int64)
    ctx.comm.Allreduce(MPI.IN_PLACE, v, op=MPI.MIN)
    return bool(v[0] < 0), bool(v[1] != -v[2])


def differences(all_facts: list[dict[str, str]]) -> list[str]:
    """One line per fact that differs between ranks: ``train.lr: ranks 0-2 0.01; rank 3 0.1``."""
    from hpcgnn.train.early import rank_list
    lines = []
    for key in sorted(set().union(*all_facts)):
        groups: dict[str, list[int]] = {}
        for rank, facts in enumerate(all_facts):
            groups.setdefault(facts.get(key, "(unset)"), []).append(rank)
        if len({_compared(key, v) for v in groups}) > 1:
            lines.append(f"{key}: " + "; ".join(f"{rank_list(r)} {v}" for v, r in groups.items()))
    return lines


def report_differences(ctx: CommContext, facts: dict[str, str]) -> None:
    """Gather every rank's facts on rank 0, which logs what differs and the fix (one ERROR line
    a difference). Called on every rank once ``agree`` said the digests differ."""
    from hpcgnn.log import get_logger
    gathered = ctx.comm.gather(facts, root=0)
    if gathered is None:
        return
    log = get_logger()
    lines = differences(gathered)
    log.error("the ranks were started with different inputs; nothing was exchanged "
              "(%d difference%s):", len(lines), "s" * (len(lines) != 1))
    for line in lines:
        log.error("  %s", line)
    log.error("%s", FIX)
