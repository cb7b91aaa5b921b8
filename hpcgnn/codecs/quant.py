"""Stochastic-rounding quantisation (AdaQP, Sylvie) to ``b`` in {1, 2, 4, 8} bits per value.

Per row: ``lo <= min(x)``, ``step >= (max(x) - lo) / (2^b - 1)``, ``q = floor((x - lo) / step + u)``
with ``u ~ U(0, 1)`` drawn from the block's shared key (on a 2^15 grid, see ``_fill_noise``), ``x^ = lo + q * step``. ``E[x^] = x``
(unbiased) because ``lo`` and ``step`` are rounded *outward* to bfloat16 before quantising, so
the receiver reconstructs with exactly the values the sender used and ``(x - lo) / step`` stays
in ``[0, 2^b - 1]``. bfloat16 keeps fp32's exponent range, so neither activations nor tiny halo
gradients overflow or flush to zero (fp16 would for gradients below ~6e-8).

Wire layout of one row: ``lo`` (2 bytes) | ``step`` (2 bytes) | ``ceil(F * b / 8)`` bytes of
codes, ``8 / b`` codes per byte, lowest bits first. One peer block of ``rows`` rows costs
``rows * (4 + ceil(F * b / 8))`` bytes.
"""
from __future__ import annotations

from typing import Sequence

import torch

from hpcgnn.codecs.base import WireCodec
from hpcgnn.codecs.rng import blocks, generator

BITS = (1, 2, 4, 8)
HEADER_BYTES = 4  # lo and step, bfloat16 each
_LOW16 = 0xFFFF
_HIGH16 = -65536  # 0xFFFF0000 as int32


def _bf16_outward(x: torch.Tensor, down: bool) -> torch.Tensor:
    """int16 bfloat16 bit patterns of ``x`` (float32) rounded toward -inf (``down``) or +inf."""
    b = x.contiguous().view(torch.int32)
    inexact = (b & _LOW16) != 0
    away = (b < 0) if down else (b >= 0)  # bumping the magnitude moves -x down, +x up
    hi = (b & _HIGH16) + ((inexact & away).to(torch.int32) << 16)
    return (hi >> 16).to(torch.int16)


def _bf16_value(bits: torch.Tensor) -> torch.Tensor:
    """float32 value of int16 bfloat16 bit patterns."""
    return (bits.to(torch.int32) << 16).view(torch.float32)


def _fill_noise(out: torch.Tensor, counts: Sequence[int], keys: Sequence[int]) -> torch.Tensor:
    """Fill ``out`` (``(sum(counts), width)`` float32) with integers ``k`` uniform in
    ``[0, 2^15)``, each peer block from its key; ``u = (k + 1/2) / 2^15`` is then ``U(0, 1)`` on
    the midpoints of a ``2^15`` grid, so the rounding's bias stays below ``2^-16`` of a step.

    One 64-bit draw gives four 15-bit integers: the Mersenne Twister is the encoder's hot spot.
    """
    width, flat = out.shape[1], out.view(-1)
    for peer, start, rows in blocks(counts):
        n = rows * width
        draws = torch.empty(-(-n // 4), dtype=torch.int64).random_(generator=generator(keys[peer]))
        flat[start * width:start * width + n].copy_(draws.view(torch.int16)[:n] & 0x7FFF)
    return out


class QuantCodec(WireCodec):
    """``b``-bit stochastic rounding, bit-packed, with a bfloat16 ``lo`` and ``step`` per row."""

    name = "quant"

    def __init__(self, bits: int):
        if bits not in BITS:
            raise ValueError(f"quant: bits must be one of {BITS}, got {bits}")
        self.bits = int(bits)
        self.per_byte = 8 // self.bits
        self.levels = (1 << self.bits) - 1
        # byte value -> its 8 / b codes as floats, lowest bits first (the decoder's lookup table)
        shifts = torch.arange(self.per_byte) * self.bits
        self._lut = ((torch.arange(256)[:, None] >> shifts) & self.levels).to(torch.float32)

    def __repr__(self) -> str:
        return f"quant({self.bits})"

    def row_bytes(self, width: int) -> int:
        return HEADER_BYTES + -(-width * self.bits // 8)

    def block_bytes(self, rows: int, width: int) -> int:
        return rows * self.row_bytes(width)

    def _range(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row (lo, step) as int16 bfloat16 bits, rounded outward."""
        lo = _bf16_outward(x.amin(dim=1), down=True)  # amin + amax beat aminmax on CPU
        span = (x.amax(dim=1) - _bf16_value(lo)) / self.levels
        return lo, _bf16_outward(span, down=False)

    def encode(self, x: torch.Tensor, counts: Sequence[int], keys: Sequence[int]) -> torch.Tensor:
        x = x.detach().to(torch.float32).contiguous()  # row reductions on a strided view are slow
        if x.shape[0] == 0:
            return torch.empty(0, dtype=torch.uint8)
        lo, step = self._range(x)
        lo_f, step_f = _bf16_value(lo)[:, None], _bf16_value(step)[:, None]
        inv = torch.where(step_f > 0, 1.0 / step_f, torch.zeros_like(step_f))
        # q = floor((x - lo) / step + u) with u = k / 2^15 + 2^-16, in place on the noise buffer;
        # the sum is >= 0 after the clamp, so the cast to uint8 (truncation) is the floor
        q = _fill_noise(torch.empty_like(x), counts, keys).mul_(2.0 ** -15).addcmul_(x, inv)
        q = q.add_(2.0 ** -16 - lo_f * inv).clamp_(0, self.levels).to(torch.uint8)
        header = torch.stack([lo, step], dim=1).view(torch.uint8)  # (rows, 4)
        return torch.cat([header, self._pack(q)], dim=1).reshape(-1)

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        """(rows, F) codes -> (rows, ceil(F * b / 8)) bytes, code ``j`` of a byte at bit ``j * b``."""
        pad = -q.shape[1] % self.per_byte
        if pad:
            q = torch.nn.functional.pad(q, (0, pad))
        packed = q[:, 0::self.per_byte].clone()
        for j in range(1, self.per_byte):
            packed |= q[:, j::self.per_byte] << (j * self.bits)
        return packed

    def _unpack(self, packed: torch.Tensor, width: int) -> torch.Tensor:
        """(rows, nbytes) bytes -> (rows, F) float codes: one lookup of every byte's codes."""
        rows, nbytes = packed.shape
        if self.per_byte <= 2:  # 8 and 4 bits: shifts beat a lookup
            codes = torch.empty(rows, nbytes * self.per_byte, dtype=torch.float32)
            for j in range(self.per_byte):
                codes[:, j::self.per_byte] = (packed >> (j * self.bits)) & self.levels
            return codes[:, :width]
        codes = self._lut.index_select(0, packed.reshape(-1).to(torch.int64))
        return codes.view(rows, nbytes * self.per_byte)[:, :width]

    def decode(self, buf: torch.Tensor, counts: Sequence[int], width: int,
               keys: Sequence[int]) -> torch.Tensor:
        rows = int(sum(counts))
        if rows == 0:
            return torch.empty(0, width)
        table = buf.reshape(rows, self.row_bytes(width))
        header = table[:, :HEADER_BYTES].contiguous().view(torch.int16)  # (rows, 2)
        lo, step = _bf16_value(header[:, 0])[:, None], _bf16_value(header[:, 1])[:, None]
        return self._unpack(table[:, HEADER_BYTES:], width).mul_(step).add_(lo)
