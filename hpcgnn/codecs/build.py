"""A codec from its name (``"truncate+quant"``), the schedule's ratio and the fixed settings.

Stages always nest in one order, whatever order the name lists them in: ``sample`` (rows) ->
one channel stage (``truncate`` | ``learned`` | ``random``) -> ``quant`` (values; fp32 without it).
The schedule's ratio ``r`` drives exactly one stage, the *rate stage*: the channel stage if there
is one (``k = floor(F / r)``), else ``sample`` (keep ``max(1 / r, MIN_KEEP)`` of the rows: a
kept row is never scaled by more than 8), else ``quant`` (the fewest bits ``b`` with
``32 / b <= r``, fp32 below ``r = 4``). The other stages use their fixed setting (``bits``,
``keep``). ``r = 1`` of a channel or sample rate stage sends every channel or row.
"""
from __future__ import annotations

from dataclasses import dataclass

from dataclasses import replace

from hpcgnn.codecs.base import IDENTITY, MIN_KEEP, WireCodec
from hpcgnn.codecs.channels import channels_for
from hpcgnn.codecs.quant import BITS

CHANNEL_STAGES = ("truncate", "learned", "random")
STAGES = ("none", "sample", *CHANNEL_STAGES, "quant")


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec name plus the settings of its fixed stages."""

    sample: bool = False
    channels: str | None = None  # truncate | learned | random
    quant: bool = False
    bits: int | None = None  # quant's bits when quant is not the rate stage
    keep: float | None = None  # sample's keep fraction when sample is not the rate stage

    @property
    def rate_stage(self) -> str | None:
        if self.channels:
            return "channels"
        if self.sample:
            return "sample"
        return "quant" if self.quant else None

    @property
    def learned(self) -> bool:
        return self.channels == "learned"


def parse_codec(name: str) -> CodecSpec:
    """``"truncate+quant"`` -> CodecSpec; raises ValueError naming the bad part."""
    parts = [p.strip() for p in str(name).split("+")]
    unknown = [p for p in parts if p not in STAGES]
    if unknown:
        raise ValueError(f"unknown codec {unknown[0]!r}; choose from {', '.join(STAGES)} "
                         f"(combine with '+', e.g. 'truncate+quant')")
    if len(set(parts)) != len(parts):
        raise ValueError(f"codec {name!r} names a stage twice")
    if "none" in parts and len(parts) > 1:
        raise ValueError(f"codec {name!r}: 'none' cannot be combined with other stages")
    channels = [p for p in parts if p in CHANNEL_STAGES]
    if len(channels) > 1:
        raise ValueError(f"codec {name!r}: at most one of truncate, learned, random")
    return CodecSpec(sample="sample" in parts, channels=channels[0] if channels else None,
                     quant="quant" in parts)


def bits_for(ratio: float) -> int | None:
    """The fewest bits ``b`` in BITS with ``32 / b <= ratio``; None (fp32) when ``ratio < 4``."""
    fitting = [b for b in BITS if 32 / b <= ratio + 1e-9]
    return min(fitting) if fitting else None


def build_codec(spec: CodecSpec, ratio: float, width: int) -> WireCodec:
    """The wire codec of ``spec`` at schedule ratio ``ratio`` for rows of ``width`` channels."""
    rate = spec.rate_stage
    codec = IDENTITY
    bits = bits_for(ratio) if rate == "quant" else spec.bits
    if spec.quant and bits is not None:
        codec = replace(codec, bits=bits)
    if spec.channels:
        k = channels_for(width, ratio)
        if k < width:
            codec = replace(codec, channels=spec.channels, k=k)
    if spec.sample:
        keep = max(1.0 / ratio, MIN_KEEP) if rate == "sample" else max(spec.keep, MIN_KEEP)
        if keep < 1.0:
            codec = replace(codec, keep=keep)
    return codec
