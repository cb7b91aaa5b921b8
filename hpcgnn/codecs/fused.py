"""A ``WireCodec`` call on the fused Triton kernels (``hpcgnn.kernels.codec``): the same bytes
and the same decoded rows as ``WireCodec.encode``/``decode``'s torch path, in one launch for
``quant`` or the fp32 selections, two with a row sample or random channels (their draw, then the
codec). ``WireCodec`` (and ``quant.encode_values``/``decode_values``) send CUDA tensors here when
``kernels.use_triton`` says so.

Launches per call: identity 0; quant 1 each way; sample, random (any value stage) 2 each way.
The per-block kept counts, their starts and the sample's scale depend only on the block counts
and the keep fraction: they are made once (host arithmetic, as ``kept_rows`` does it) and cached
on the device, so a call copies nothing from the host.
"""
from __future__ import annotations

import weakref
from functools import lru_cache

import torch

from hpcgnn.codecs.rng import SALT_CHANNELS, SALT_ROWS, Blocks, kept_rows


_codec_kernels = None


def _kernels():
    """``hpcgnn.kernels.codec``, imported at the first call (it imports Triton)."""
    global _codec_kernels
    if _codec_kernels is None:
        from hpcgnn.kernels import codec  # noqa: PLC0415  (imports triton: only when asked)
        _codec_kernels = codec
    return _codec_kernels


@lru_cache(maxsize=256)
def _sample_plan(counts: tuple[int, ...], keep: float, device: torch.device):
    """(kept int64 (P,), kept_start int64 (P,), scale float32 (P,), total kept) on ``device``;
    ``scale = counts / max(kept, 1)`` in float32, as the torch path computes it."""
    kept = [kept_rows(c, keep) for c in counts]
    starts = [sum(kept[:p]) for p in range(len(kept))]
    scale = (torch.tensor(counts, dtype=torch.float32)
             / torch.tensor(kept, dtype=torch.int64).clamp(min=1).to(torch.float32))
    as64 = dict(dtype=torch.int64, device=device)
    return torch.tensor(kept, **as64), torch.tensor(starts, **as64), scale.to(device), sum(kept)


_layouts: dict[int, dict] = {}      # id(blocks) -> {(codec, width): Layout without keys}


def _forget(blocks_id: int) -> None:
    _layouts.pop(blocks_id, None)


def layout(codec, blocks: Blocks, width: int):
    """The kernels' view of ``codec`` (a ``WireCodec``) on ``blocks``.

    A codec call's host side is most of its cost at the sizes exchanged on a GPU, so the layout
    is made once per (blocks, codec, width) and kept while ``blocks`` lives (blocks are made once
    per plan and direction); the block keys go to the select kernel alone."""
    per_blocks = _layouts.get(id(blocks))
    if per_blocks is None:
        per_blocks = _layouts[id(blocks)] = {}
        weakref.finalize(blocks, _forget, id(blocks))
    lay = per_blocks.get((codec, width))
    if lay is None:
        lay = per_blocks[(codec, width)] = _make_layout(codec, blocks, width)
    return lay


def _make_layout(codec, blocks: Blocks, width: int):
    kept = kept_start = scale = None
    n_out = blocks.rows
    if codec.keep < 1.0:
        kept, kept_start, scale, n_out = _sample_plan(blocks.counts, codec.keep, blocks.device)
        if not codec.scaled:          # rows as they are (GAT): a scale of 1 is exact
            scale = torch.ones_like(scale)
    return _kernels().Layout(
        counts=blocks.counts_t, starts=blocks.starts_t, block_of_row=blocks.block_of_row,
        kept=kept, kept_start=kept_start, scale=scale, rows=blocks.rows, n_out=n_out,
        width=width, k=codec.width_sent(width), bits=codec.bits, random=codec.channels == "random",
        adjoint=codec.adjoint, salt_rows=SALT_ROWS, salt_channels=SALT_CHANNELS,
        longest=max((*blocks.counts, width if codec.channels == "random" else 0), default=0))


def encode(codec, x: torch.Tensor, blocks: Blocks, keys: torch.Tensor, noise_key: int) -> torch.Tensor:
    """``codec.encode`` on the kernels: float32 ``(R, F)`` -> uint8 blocks."""
    k = _kernels()
    lay = layout(codec, blocks, x.shape[1])
    if x.dtype is not torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    return k.encode(x, lay, k.select(lay, keys), noise_key)


def decode(codec, buf: torch.Tensor, blocks: Blocks, width: int, keys: torch.Tensor) -> torch.Tensor:
    """``codec.decode`` on the kernels: uint8 blocks -> float32 ``(R, width)``."""
    k = _kernels()
    lay = layout(codec, blocks, width)
    return k.decode(buf if buf.is_contiguous() else buf.contiguous(), lay, k.select(lay, keys))


def encode_values(y: torch.Tensor, bits: int, key: int) -> torch.Tensor:
    """``quant.encode_values`` on the kernels: float32 ``(R, F)`` -> uint8 ``[R * row_bytes]``."""
    k = _kernels()
    return k.encode(y, k.values_layout(*y.shape, bits, y.device), k.Selected(), key)


def decode_values(table: torch.Tensor, width: int, bits: int) -> torch.Tensor:
    """``quant.decode_values`` on the kernels: uint8 ``(R, row_bytes)`` -> float32 ``(R, width)``."""
    k = _kernels()
    lay = k.values_layout(table.shape[0], width, bits, table.device)
    return k.decode(table.contiguous().reshape(-1), lay, k.Selected())
