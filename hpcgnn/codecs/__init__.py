"""Compressors for the halo exchange: pure torch, no MPI, each with an exact byte count.

``base`` is the seam (``WireCodec``, ``CompressionPolicy``); ``channels`` holds VARCO's
truncate/learned/random, ``quant`` stochastic-rounding quantisation, ``sample`` BNS-GCN
boundary-node sampling; ``build`` composes them from a name such as ``"truncate+quant"``.
"""
from hpcgnn.codecs.base import FULL_PRECISION, IDENTITY, CompressionPolicy, WireCodec
from hpcgnn.codecs.build import CodecSpec, bits_for, build_codec, parse_codec
from hpcgnn.codecs.channels import (LearnedCodec, RandomChannelCodec, TruncateCodec,
                                    channels_for)
from hpcgnn.codecs.quant import QuantCodec
from hpcgnn.codecs.sample import SampleCodec, kept_rows

__all__ = [
    "FULL_PRECISION", "IDENTITY", "CompressionPolicy", "WireCodec", "CodecSpec", "bits_for",
    "build_codec", "parse_codec", "LearnedCodec", "RandomChannelCodec", "TruncateCodec",
    "channels_for", "QuantCodec", "SampleCodec", "kept_rows",
]
