"""The hashes of ``hpcgnn.hashing`` as Triton device functions, on uint32 tensors (uint32
products wrap modulo 2^32, as the masks of the torch versions do)."""
import triton
# the interpreter and the compiler look triton.language up in a jit function's globals
import triton.language as tl  # noqa: F401


@triton.jit
def lowbias32(x):
    """lowbias32 (C. Wellons) of uint32 ``x`` = ``hashing.hash32``."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def col_seed(g):
    """``hashing.col_seeds``: ``lowbias32(g * GOLDEN + COL_OFFSET)`` of uint32 ``g``."""
    return lowbias32(g * 0x9E3779B1 + 0x7F4A7C15)


@triton.jit
def golden_hash(c):
    """``hashing.golden_hashes``: ``lowbias32(c * GOLDEN)`` of uint32 ``c``."""
    return lowbias32(c * 0x9E3779B1)
