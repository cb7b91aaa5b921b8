"""How the exchange runs: the run config's ``[comm]`` section, with the site's environment
variables on top (a site fact or an override beats the config), resolved once at start-up and
recorded in ``RUN_DIR/run.json``.

| key | values | environment override |
|---|---|---|
| ``transport`` | auto, alltoallv, neighbor | ``HPCGNN_EXCHANGE`` |
| ``max_message`` | bytes one MPI call may move (at least ``least_message``) | ``HPCGNN_MAX_MESSAGE`` |
| ``progress`` | test, fine, thread | ``HPCGNN_PROGRESS`` |
| ``cuda_aware`` | auto, true, false | ``HPCGNN_CUDA_AWARE`` (1 / 0) |

``transport = auto`` uses ``Neighbor_alltoallv`` when every rank exchanges with at most half of
the ranks (at 8 ranks or more), else ``Alltoallv`` (``hpcgnn.comm.transport``). ``progress``:
how a non-blocking (stale) exchange advances (``hpcgnn.comm.progress``). ``cuda_aware``: hand
device buffers to MPI (``true``), stage them through pinned host memory (``false``), or ask the
library (``auto``; ``hpcgnn info`` says what it answers).

A ``max_message`` below what one call must carry cannot be kept: a round of the halo exchange
moves at least one byte of each non-empty block (up to ``P - 1`` of them), and a split
collective at least one whole element (4-byte values; CAGNET's 2D/3D rounds one per rank of a
``q``-rank group, and 8-byte indices on a graph past 2^31 entries). Start-up refuses such a
value on every rank (``check_message_limit``); the small fixed-size agreements (tens of bytes)
are not split and not counted.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

INT_MAX = 2**31 - 1
ENV = {"transport": "HPCGNN_EXCHANGE", "max_message": "HPCGNN_MAX_MESSAGE",
       "progress": "HPCGNN_PROGRESS", "cuda_aware": "HPCGNN_CUDA_AWARE"}
CHOICES = {"transport": ("auto", "alltoallv", "neighbor"), "progress": ("test", "fine", "thread"),
           "cuda_aware": ("auto", "true", "false")}
ENV_PREFIX = "HPCGNN_"


@dataclass(frozen=True)
class CommSettings:
    """The resolved ``[comm]`` settings of one run."""

    transport: str = "auto"
    max_message: int = INT_MAX
    progress: str = "test"
    cuda_aware: str = "auto"

    @classmethod
    def resolve(cls, section=None, environ=None) -> "CommSettings":
        """``section`` (a ``CommConfig``, its dict, or None for the defaults) with the
        environment's overrides; a bad override raises ``ValueError`` naming the variable and
        the fix."""
        environ = os.environ if environ is None else environ
        if section is not None and not isinstance(section, dict):
            section = asdict(section)
        base = cls(**section) if section else cls()
        over = {}
        for key, var in ENV.items():
            if environ.get(var) not in (None, ""):
                over[key] = _parse(key, var, environ[var])
        return replace(base, **over)

    def overridden(self, environ=None) -> dict[str, str]:
        """``{key: "VAR=value"}`` of the keys an environment variable set."""
        environ = os.environ if environ is None else environ
        return {k: f"{v}={environ[v]}" for k, v in ENV.items() if environ.get(v) not in (None, "")}


def _parse(key: str, var: str, text: str):
    text = text.strip()
    if key == "max_message":
        if not text.isdigit() or not 1 <= int(text) <= INT_MAX:
            raise ValueError(f"{var}={text!r}: expected a byte count; use an integer of bytes in "
                             f"[1, {INT_MAX}] (the MPI count limit), or unset it")
        return int(text)
    if key == "cuda_aware":                  # the variable is 1 or 0 (hpcgnn.comm.gpu reads it too)
        if text not in ("1", "0"):
            raise ValueError(f"{var}={text!r}: expected 1 (device buffers to MPI) or 0 (stage "
                             f"through host memory); unset it to ask the library")
        return "true" if text == "1" else "false"
    if text not in CHOICES[key]:
        raise ValueError(f"{var}={text!r}: expected one of {', '.join(CHOICES[key])}; unset it "
                         f"or fix it")
    return text


VALUE_BYTES = 4          # the trainer's values (float32): the gradients, the parameters, CAGNET's rows


def least_message(size: int) -> int:
    """The least ``max_message`` the halo algorithm keeps on ``size`` ranks: a round carries a
    byte of each of up to ``size - 1`` peers' blocks (a part sends itself nothing), and the
    gradient ``Allreduce`` and the parameters' ``Bcast`` split between whole 4-byte values.
    One rank makes no MPI call."""
    return 1 if size <= 1 else max(size - 1, VALUE_BYTES)


def check_message_limit(settings: CommSettings, least: int, why: str, where: str,
                        environ=None) -> None:
    """Raise ``ValueError`` when ``settings.max_message`` is below ``least`` (what ``why``
    says one call must carry), naming where the value came from (``where``: the config file,
    or ``HPCGNN_MAX_MESSAGE``), the least value and the fix."""
    if settings.max_message >= least:
        return
    var = ENV["max_message"]
    if settings.overridden(environ).get("max_message"):
        said, fix = f"{var}={settings.max_message}", f"set {var} to {least} or more, or unset it"
    else:
        said = f"{where}: comm.max_message = {settings.max_message}"
        fix = (f"set comm.max_message to {least} or more (or override it with {var}={least}), "
               f"or drop it for the default {INT_MAX}")
    raise ValueError(f"{said} is below {least} bytes, the least one MPI call of this run must "
                     f"carry ({why}), so a call would pass the limit; {fix}")


def check_halo_message(section, size: int, where: str, environ=None) -> None:
    """The halo algorithm's ``check_message_limit`` on ``size`` ranks (``section``: the run's
    ``[comm]``, as ``CommSettings.resolve`` takes it)."""
    check_message_limit(CommSettings.resolve(section, environ), least_message(size),
                        f"on {size} ranks a round of the halo exchange carries a byte of each "
                        f"of up to {size - 1} peers' blocks, and the gradient Allreduce moves "
                        f"whole {VALUE_BYTES}-byte values", where, environ)


def hpcgnn_environment(environ=None) -> dict[str, str]:
    """Every ``HPCGNN_*`` variable that is set (what ``run.json`` records)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIX)}
