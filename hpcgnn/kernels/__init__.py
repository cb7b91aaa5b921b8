"""Fused Triton kernels for CUDA tensors: the wire codecs (``codec``) and the counter-based
dropout (``dropout``), computing bit for bit what the torch and C paths compute.

Triton is an extra of the GPU install (``pip install hpcgnn[gpu]``), never a requirement: this
package imports no Triton until a kernel is asked for, and ``use_triton(t)`` says whether the
callers should ask (a CUDA tensor, Triton importable, ``HPCGNN_TRITON`` not ``0``). CPU tensors
keep their C (``hpcgnn.codecs.native``) and torch paths.

Tests run the kernels on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set
before Triton is imported, and only where there is no GPU: a GPU machine must compile them).
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

_importable: bool | None = None


def triton_importable() -> bool:
    """Whether ``import triton`` would work here (checked once, without importing it)."""
    global _importable
    if _importable is None:
        _importable = importlib.util.find_spec("triton") is not None
    return _importable


def use_triton(t: torch.Tensor) -> bool:
    """Whether ``t`` goes through the Triton kernels: on CUDA, with Triton installed, unless
    ``HPCGNN_TRITON=0`` asks for the torch path."""
    return t.is_cuda and os.environ.get("HPCGNN_TRITON", "1") != "0" and triton_importable()


def pow2(n: int, lo: int, hi: int) -> int:
    """The power of two at or above ``n``, within ``[lo, hi]`` (plain Python: Triton's
    ``next_power_of_2`` and ``cdiv`` are constexpr functions, microseconds a call from Python)."""
    return max(lo, min(hi, 1 << (max(n, 1) - 1).bit_length()))


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for a launch grid."""
    return -(-a // b)


def explained(launcher):
    """Decorate a kernel launcher: a Triton error (a kernel that does not compile with this Triton
    or this GPU) is raised again naming the version and the way back to the torch path."""
    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        try:
            return launcher(*args, **kwargs)
        except Exception as exc:
            import triton  # noqa: PLC0415  (imported already: a kernel was launched)
            if not isinstance(exc, getattr(triton, "TritonError", ())):
                raise
            raise RuntimeError(
                f"hpcgnn's Triton kernel {launcher.__qualname__} failed with triton "
                f"{triton.__version__} (tested with 3.9.0): {type(exc).__name__}: {exc}\n"
                "Set HPCGNN_TRITON=0 to use the torch path on CUDA (same results, slower), or "
                "install a Triton that matches your torch.") from exc
    return launch
