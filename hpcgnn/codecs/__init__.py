"""Compressors for the halo exchange: pure torch, no MPI, each with an exact byte count.

``base`` is the seam (``WireCodec``: rows -> channels -> values stages, and its backward
adjoint; ``CompressionPolicy``); ``quant`` the value stage (fp32 or stochastic rounding, with C
kernels in ``native``); ``rng`` the counter-based randomness; ``channels`` VARCO's channel rule;
``build`` composes a codec from a name such as ``"truncate+quant"``.
"""
from hpcgnn.codecs.base import (FULL_PRECISION, IDENTITY, MIN_KEEP, CompressionPolicy, WireCodec,
                                backward_codec, kept_rows)
from hpcgnn.codecs.build import CodecSpec, bits_for, build_codec, parse_codec
from hpcgnn.codecs.channels import channels_for
from hpcgnn.codecs.quant import BITS

__all__ = [
    "FULL_PRECISION", "IDENTITY", "MIN_KEEP", "CompressionPolicy", "WireCodec", "backward_codec",
    "kept_rows", "CodecSpec", "bits_for", "build_codec", "parse_codec", "channels_for", "BITS",
]
