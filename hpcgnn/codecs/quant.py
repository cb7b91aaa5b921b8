"""The value stage of a codec: fp32 rows as they are, or stochastic rounding (AdaQP, Sylvie) to
``b`` in {1, 2, 4, 8} bits per value, bit-packed.

Quantisation of one row ``x`` (``F`` values):
``lo = min(x)`` (fp32, exact), ``step = (max(x) - lo) / (2^b - 1)`` rounded *up* to bfloat16
and at least ``2^-126`` (``MIN_STEP_BITS``; 0 for a constant row),
``q = min(2^b - 1, floor((x - lo) / step + u))`` with ``u = (u16 + 1/2) / 2^16`` from the
counter-based noise of ``rng.noise_u16``, ``x^ = lo + q * step``. Since ``lo`` is exact and
``step`` only rounds up, every ``x^`` is within one step of ``x`` (``|x^ - x| < step <=
max((max - min) / (2^b - 1) * (1 + 2^-7), 2^-126)``), and ``E[x^] = x`` up to the noise grid
(bias below ``2^-17`` of a step) and the fp32 rounding of ``(x - lo) / step``. bfloat16 keeps
fp32's exponent range, so tiny halo gradients neither flush to zero nor overflow; the
``2^-126`` floor (the smallest normal float) keeps ``1 / step`` finite for a row whose range is
a few subnormals. A row's range must itself be finite (``max - min`` below about ``3.4e38``),
and its values too: the paths differ on a NaN or an infinity (the C kernels, built with
``-ffinite-math-only``, may send a row holding a NaN as finite values with another minimum;
the torch path sends it as NaN).

Wire layout of one row: ``lo`` (4 bytes) | ``step`` (2) | ``ceil(F * b / 8)`` bytes of codes,
``8 / b`` codes per byte, lowest bits first — ``6 + ceil(F * b / 8)`` bytes a row.

CPU tensors go through the C kernels of ``hpcgnn.codecs.native`` when they are built (one pass,
no temporaries); CUDA tensors through the Triton kernels of ``hpcgnn.kernels.codec`` when Triton
is installed (one launch each way); the rest through the torch code below. All give the same
bytes.
"""
from __future__ import annotations

import torch

from hpcgnn.codecs import fused, native
from hpcgnn.codecs.rng import col_seeds, noise_u16
from hpcgnn.kernels import use_triton

BITS = (1, 2, 4, 8)
FP32 = 32
HEADER_BYTES = 6  # lo float32, step bfloat16
MIN_STEP_BITS = 0x00800000
"""The smallest step of a row that is not constant, as float32 bits: 2^-126 (the smallest normal
float, a bfloat16), so that ``1 / step`` is finite (a subnormal step's reciprocal overflows)."""


def row_bytes(width: int, bits: int) -> int:
    """Bytes of one row of ``width`` values at ``bits`` (32: fp32)."""
    if bits == FP32:
        return 4 * width
    return HEADER_BYTES + -(-width * bits // 8)


def encode_values(y: torch.Tensor, bits: int, key: int) -> torch.Tensor:
    """``(R, F)`` float -> ``(R, row_bytes(F, bits))`` uint8 on ``y``'s device."""
    y = y.detach().to(torch.float32).contiguous()
    if bits == FP32:
        return y.view(torch.uint8).reshape(y.shape[0], 4 * y.shape[1])
    rb = row_bytes(y.shape[1], bits)
    if y.shape[0] == 0 or y.shape[1] == 0:
        return torch.zeros(y.shape[0], rb, dtype=torch.uint8, device=y.device)
    if y.device.type == "cpu" and native.lib() is not None:
        return native.quant_encode(y, bits, key, col_seeds(-(-y.shape[1] // 2), y.device), rb)
    if use_triton(y):
        return fused.encode_values(y, bits, key).view(-1, rb)
    return _encode_torch(y, bits, key)


def decode_values(table: torch.Tensor, width: int, bits: int) -> torch.Tensor:
    """``(R, row_bytes)`` uint8 -> ``(R, width)`` float32 on ``table``'s device."""
    if bits == FP32:
        return table.contiguous().view(torch.float32).reshape(table.shape[0], width)
    if table.shape[0] == 0 or width == 0:
        return torch.zeros(table.shape[0], width, device=table.device)
    if table.device.type == "cpu" and native.lib() is not None:
        return native.quant_decode(table, width, bits)
    if use_triton(table):
        return fused.decode_values(table, width, bits)
    return _decode_torch(table, width, bits)


def _bf16_up(v: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 rounded up to bfloat16; returns the int32 bit patterns."""
    b = v.contiguous().view(torch.int32)
    inexact = (b & 0xFFFF) != 0
    return (b & -65536) + (inexact.to(torch.int32) << 16)


def _encode_torch(y: torch.Tensor, bits: int, key: int) -> torch.Tensor:
    levels = (1 << bits) - 1
    lo = y.amin(dim=1)
    hi = y.amax(dim=1)
    step_bits = torch.where(hi > lo, _bf16_up((hi - lo) / levels).clamp_(min=MIN_STEP_BITS),
                            torch.zeros_like(lo, dtype=torch.int32))
    step = step_bits.view(torch.float32)
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    u = (noise_u16(y.shape[0], y.shape[1], key, y.device).to(torch.float32) + 0.5) * (1.0 / 65536.0)
    t = (y - lo[:, None]) * inv[:, None]
    q = (t + u).to(torch.int32).clamp_(max=levels).to(torch.uint8)   # t + u >= 0: truncation = floor
    header = torch.cat([lo[:, None].view(torch.uint8),
                        (step_bits >> 16).to(torch.int16)[:, None].view(torch.uint8)], dim=1)
    return torch.cat([header, _pack(q, bits)], dim=1)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, F) codes -> (R, ceil(F * b / 8)) bytes, code ``j`` of a byte at bit ``j * b``."""
    per = 8 // bits
    pad = -q.shape[1] % per
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    packed = q[:, 0::per].clone()
    for j in range(1, per):
        packed |= q[:, j::per] << (j * bits)
    return packed


def _decode_torch(table: torch.Tensor, width: int, bits: int) -> torch.Tensor:
    per, mask = 8 // bits, (1 << bits) - 1
    table = table.contiguous()
    lo = table[:, :4].contiguous().view(torch.float32)                  # (R, 1)
    step = (table[:, 4:6].contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    packed = table[:, HEADER_BYTES:]
    shifts = torch.arange(per, device=table.device, dtype=torch.uint8) * bits
    codes = (packed[:, :, None] >> shifts) & mask                        # (R, nbytes, per)
    codes = codes.reshape(table.shape[0], -1)[:, :width].to(torch.float32)
    return codes * step + lo
