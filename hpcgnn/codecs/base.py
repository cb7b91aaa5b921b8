"""The seam between the halo exchange and the compressors.

A ``WireCodec`` turns the rows that one rank sends to its peers into bytes and back, in three
stages that always nest in this order:

1. **rows** (BNS-GCN ``sample``): keep ``kept_rows(rows, keep)`` rows of each peer block, the
   rows of smallest ``rng.row_scores``, drawn from the block's row key (both ends agree): a
   function of the seed, the epoch and the pair (src, dst) alone, so every layer's exchange of
   an epoch keeps the same rows of a block, as BNS-GCN draws one boundary sample an epoch;
2. **channels** (VARCO): ``all``, the first ``k`` (``truncate``; ``learned`` is the same on the
   wire, after the learned encoder), or ``k`` drawn per block from its channel key, which also
   holds the layer (``random``);
3. **values**: fp32 (``bits = 32``) or ``b``-bit stochastic rounding (``quant``).

The receiver undoes the stages: the values are decoded, the channels and rows that did not
travel are zeros, and the kept rows of a sampled block are scaled by ``rows / kept`` — unless
the codec is ``scaled = False`` (GAT's layers ask for that: their receiver masks the rows that
did not travel out of the attention instead, ``hpcgnn.nn.gat``), both ways.

**The backward exchange is the adjoint of the forward.** The forward computes
``y = S^T V(S x)`` (S: the selection of stages 1-2 with its scale; V: the value stage, whose
gradient is taken as the identity since it is an unbiased estimate). Its gradient is
``S^T S g``: the halo gradients of exactly the rows and channels the forward sent, scaled the
same way, and nothing for the rest. ``backward_codec(forward, backward)`` is that codec: the
forward's selection (same keys), with the scale applied by the sender, and the backward
schedule's value stage on top. Where the forward selects nothing (identity, quant), the
backward codec is used as it is.

Every call is batched over all peer blocks on the input's device (``rng.Blocks`` holds the
layout). CUDA tensors go through the fused Triton kernels (``codecs.fused``: one or two launches
a call, the same bytes) when Triton is installed; CPU tensors through the torch code below and
the C kernels of the value stage. ``block_bytes`` depends only on the row count, the width and
the codec, so every rank derives every peer's byte count from the plan and the schedule alone —
no size handshake.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from hpcgnn.codecs import fused, native
from hpcgnn.codecs.rng import kept_rows
from hpcgnn.codecs.quant import FP32, decode_values, encode_values, row_bytes
from hpcgnn.codecs.rng import Blocks, channel_scores, row_scores
from hpcgnn.kernels import use_triton

CHANNEL_MODES = ("all", "truncate", "learned", "random")
MIN_KEEP = 0.125
"""The smallest kept fraction of the sample stage: a kept row is scaled by at most 8, which
bounds the variance the scaling adds to a neighbour sum (BNS-GCN's own runs keep >= 0.1)."""


@dataclass(frozen=True)
class Selection:
    """Which entries of an ``(R, F)`` buffer travel: rows ``index`` (None: all) with their
    ``scale`` (None: 1), channels ``chan`` per kept row (None: all, or the first ``k``)."""

    index: torch.Tensor | None
    scale: torch.Tensor | None
    chan: torch.Tensor | None
    rows: int


@dataclass(frozen=True)
class WireCodec:
    """One exchange's codec; ``WireCodec()`` is the identity (fp32 rows as they are)."""

    keep: float = 1.0          # rows stage: fraction of each block sent
    channels: str = "all"      # channels stage: all | truncate | learned | random
    k: int = 0                 # channels sent when channels != "all"
    bits: int = FP32           # values stage: 32 (fp32) or 1, 2, 4, 8 (quant)
    adjoint: bool = False      # the backward of a selecting forward: the sender scales
    scaled: bool = True        # rows stage: kept rows scaled by rows / kept (GAT: False)

    def __post_init__(self):
        if not 0.0 < self.keep <= 1.0:
            raise ValueError(f"sample: keep fraction must be in (0, 1], got {self.keep}")
        if self.channels not in CHANNEL_MODES:
            raise ValueError(f"channels must be one of {CHANNEL_MODES}, got {self.channels!r}")
        if self.channels != "all" and self.k < 1:
            raise ValueError(f"{self.channels}: k must be >= 1 channel, got {self.k}")
        if self.bits not in (1, 2, 4, 8, FP32):
            raise ValueError(f"quant: bits must be one of (1, 2, 4, 8), got {self.bits}")

    @property
    def name(self) -> str:
        unscaled = "" if self.scaled else ",unscaled"
        parts = ([f"sample({self.keep:g}{unscaled})"] if self.keep < 1 else []) + \
                ([f"{self.channels}(k={self.k})"] if self.channels != "all" else []) + \
                ([f"quant({self.bits})"] if self.bits != FP32 else [])
        return ("adjoint:" if self.adjoint else "") + ("+".join(parts) or "none")

    def __repr__(self) -> str:
        return self.name

    @property
    def selects(self) -> bool:
        return self.keep < 1.0 or self.channels != "all"

    def width_sent(self, width: int) -> int:
        if self.channels == "all":
            return width
        if self.k > width:
            raise ValueError(f"{self.channels}: k={self.k} channels exceed the row width {width}")
        return self.k

    def block_bytes(self, rows: int, width: int) -> int:
        """Exact bytes on the wire for one peer block of ``rows`` rows of ``width`` channels."""
        return kept_rows(rows, self.keep) * row_bytes(self.width_sent(width), self.bits)

    def byte_counts(self, counts: Sequence[int], width: int) -> list[int]:
        """Per-peer byte counts for the Alltoallv."""
        return [self.block_bytes(int(c), width) if c else 0 for c in counts]

    # -- the selection (stages 1 and 2), batched over blocks -----------------------------
    def select(self, blocks: Blocks, keys: torch.Tensor, width: int) -> Selection:
        """The rows (with their scales) and channels sent from every block: a function of the
        blocks, their keys and the selecting stages alone (not of ``bits`` or ``adjoint``), so
        on CPU ranks the last few are kept on ``blocks`` and a backward exchange reuses its
        forward's."""
        if not self.selects or keys.device.type != "cpu":
            return self._select(blocks, keys, width)
        memo = (self.keep, self.channels, self.k, width, tuple(keys.tolist()))
        sel = blocks.selections.get(memo)
        if sel is None:
            sel = self._select(blocks, keys, width)
            if len(blocks.selections) >= SELECTIONS_KEPT:
                blocks.selections.pop(next(iter(blocks.selections)), None)      # the oldest
            blocks.selections[memo] = sel
        return sel

    def _select(self, blocks: Blocks, keys: torch.Tensor, width: int) -> Selection:
        index = scale = chan = None
        rows, block = blocks.rows, blocks.block_of_row
        if self.keep < 1.0:
            index, kept = _sample(blocks, keys, self.keep)
            per_block = blocks.counts_t.to(torch.float32) / kept.clamp(min=1).to(torch.float32)
            rows = int(index.shape[0])        # the kept rows, ascending: block by block
            block = torch.repeat_interleave(torch.arange(len(blocks.counts), device=index.device),
                                            kept, output_size=rows)
            scale = per_block[block]
        if self.channels == "random":
            chan = _random_channels(keys, width, self.width_sent(width))[block]
        return Selection(index, scale, chan, rows)

    def _gather(self, x: torch.Tensor, sel: Selection) -> torch.Tensor:
        scale = sel.scale if self.adjoint and self.scaled else None
        if sel.index is not None and native.takes(x):        # the rows and their scale, one pass
            y = native.gather_rows(x, sel.index, scale)
        else:
            y = x if sel.index is None else x.index_select(0, sel.index)
            if scale is not None:
                y = y * scale[:, None]
        if self.channels in ("truncate", "learned"):
            return y[:, : self.width_sent(x.shape[1])]
        return y if sel.chan is None else y.gather(1, sel.chan)

    def _place(self, y: torch.Tensor, sel: Selection, rows: int, width: int) -> torch.Tensor:
        if sel.chan is not None:
            y = torch.zeros(y.shape[0], width, device=y.device).scatter_(1, sel.chan, y)
        elif y.shape[1] != width:
            y = torch.nn.functional.pad(y, (0, width - y.shape[1]))
        if sel.index is None:
            return y
        scale = sel.scale if self.scaled and not self.adjoint else None
        if native.takes(y):                      # zeros, the rows and their scale in one pass
            return native.place_rows(y, sel.index, scale, rows)
        if scale is not None:
            y = y * scale[:, None]
        return torch.zeros(rows, width, device=y.device).index_copy_(0, sel.index, y)

    # -- the wire --------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, blocks: Blocks, keys: torch.Tensor, noise_key: int = 0) -> torch.Tensor:
        """``(R, F)`` float -> uint8 ``[sum(block_bytes)]``, blocks in order, on ``x``'s device.
        ``keys``: ``(P,)`` block keys (both ends); ``noise_key``: the sender's rounding key."""
        if not self.selects and self.bits == FP32:
            return x.detach().to(torch.float32).contiguous().view(torch.uint8).reshape(-1)
        if use_triton(x) and x.shape[1]:
            return fused.encode(self, x, blocks, keys, noise_key)
        sel = self.select(blocks, keys, x.shape[1])
        return encode_values(self._gather(x.detach(), sel), self.bits, noise_key).reshape(-1)

    def decode(self, buf: torch.Tensor, blocks: Blocks, width: int, keys: torch.Tensor) -> torch.Tensor:
        """uint8 blocks -> ``(R, width)`` float32: the inverse (or estimate) of ``encode``."""
        if not self.selects and self.bits == FP32:
            return buf.view(torch.float32).reshape(-1, width)
        if use_triton(buf) and width:
            return fused.decode(self, buf, blocks, width, keys)
        sel = self.select(blocks, keys, width)
        w = self.width_sent(width)
        y = decode_values(buf.reshape(sel.rows, row_bytes(w, self.bits)), w, self.bits)
        return self._place(y, sel, blocks.rows, width)


IDENTITY = WireCodec()


def backward_codec(forward: WireCodec, backward: WireCodec) -> WireCodec:
    """The codec of the backward exchange: the adjoint of ``forward``'s selection with
    ``backward``'s value stage, or ``backward`` itself when ``forward`` selects nothing."""
    if not forward.selects:
        return backward
    return replace(forward, bits=backward.bits, adjoint=True)


SELECTIONS_KEPT = 4
"""Selections ``WireCodec.select`` keeps per ``Blocks`` (an exchange's forward and backward draw
the same one in a step; a probe's candidates share theirs)."""

SELECT_BLOCK_ROWS = 1024
"""Mean rows per block from which ``_sample`` selects block by block (a linear-time k-th
smallest per block) rather than with one sort of every row: the same rows either way."""


def _sample(blocks: Blocks, keys: torch.Tensor, keep: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted indices of the kept rows, kept count per block): the ``kept_rows`` rows of
    smallest score in each block, ties to the lower row."""
    counts = blocks.counts
    kept_list = [kept_rows(c, keep) for c in counts]
    kept = torch.tensor(kept_list, dtype=torch.int64, device=blocks.device)
    if blocks.device.type == "cpu" and native.lib() is not None and counts:
        return native.sample_rows(keys, blocks.counts_t, kept_list), kept     # C: the same rows
    if not counts or blocks.rows < SELECT_BLOCK_ROWS * len(counts):
        order = torch.sort((blocks.block_of_row << 32) | row_scores(blocks, keys), stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.shape[0], device=order.device) - blocks.starts_t[blocks.block_of_row[order]]
        return torch.nonzero(rank < kept[blocks.block_of_row]).reshape(-1), kept
    # (score, row in block) as one int64, unique within a block: a row is kept where its key is
    # at most the block's k-th smallest (a block holds fewer than 2^31 rows)
    key = (row_scores(blocks, keys) << 31) | blocks.row_in_block
    keep_mask = torch.zeros(blocks.rows, dtype=torch.bool, device=key.device)
    start = 0
    for count, k in zip(counts, kept_list):
        if k == count:
            keep_mask[start:start + count] = True
        elif k:
            block = key[start:start + count]
            keep_mask[start:start + count] = block <= torch.kthvalue(block, k).values
        start += count
    return torch.nonzero(keep_mask).reshape(-1), kept


def _random_channels(keys: torch.Tensor, width: int, k: int) -> torch.Tensor:
    """``(P, k)`` sorted channels of every block: the ``k`` of smallest score."""
    score = channel_scores(keys, width) * width + torch.arange(width, device=keys.device)
    return torch.topk(score, k, dim=1, largest=False).values.remainder(width).sort(dim=1).values


class CompressionPolicy:
    """What each halo exchange does at a given epoch and layer. This base is full precision.

    ``hpcgnn.schedule.load_schedule(path)`` returns a subclass built from a schedule file. The
    trainer asks it, every epoch and layer, for the ratio (for the metrics) and for the forward
    and backward codecs; evaluation always uses ``IDENTITY``. A policy may also give a layer a
    learned encoder/decoder pair (VARCO's ``learned`` codec): the model registers them as
    submodules, so their gradients are all-reduced and stepped with the model's, applies the
    encoder to the rows it sends before ``encode`` and the decoder to the halo rows after
    ``decode`` — while the forward codec is ``learned`` (``k < F``), never at ratio 1 or in
    evaluation.
    """

    adaptive = False
    """True for a closed-loop policy (``kind = "auto"``, ``hpcgnn.autotune.AutoPolicy``): the
    trainer measures the candidates ``probe`` lists and hands the policy its figures."""

    def bind(self, epochs: int, num_layers: int,
             silent: frozenset = frozenset()) -> "CompressionPolicy":
        """Tell the policy the run's epoch count and layer count; call once, before training.

        Schedules such as VARCO's ``linear`` need the total number of epochs ``T`` (the authors'
        formula divides by ``T - 2``), and per-layer overrides are checked against the layer
        count here, so a bad schedule fails before any rank communicates. ``silent``: the layers
        whose training steps exchange nothing (a first layer on kept feature rows,
        ``train.keep_features`` or staleness): a schedule gives them ratio 1 in the metrics, a
        closed-loop policy leaves them out. Returns the policy
        (this base needs nothing and returns itself).
        """
        return self

    def ratio(self, epoch: int, layer: int, num_layers: int) -> float:
        """Compression ratio (fp32 bytes / bytes sent) of ``layer``'s exchange at ``epoch``."""
        return 1.0

    def compresses_layer(self, layer: int, num_layers: int) -> bool:
        """Whether the policy's settings reach ``layer``'s exchange at all (its layer rules,
        e.g. ``compress_last_layer``), whatever the codec and the epoch."""
        return False

    def forward_codec(self, epoch: int, layer: int, num_layers: int, width: int) -> WireCodec:
        """Codec of the forward (activation) exchange."""
        return IDENTITY

    def backward_codec(self, epoch: int, layer: int, num_layers: int, width: int) -> WireCodec:
        """Codec the schedule gives the backward (halo-gradient) exchange; the exchange sends
        ``base.backward_codec(forward, this)``, its adjoint-exact form."""
        return IDENTITY

    def probe(self, epoch: int, layer: int, num_layers: int, direction: str
              ) -> tuple[WireCodec, ...]:
        """The codecs whose error and cost ``layer``'s exchange in ``direction`` (``forward`` |
        ``backward``) measures at ``epoch`` on the rows it sends (``ExchangeSettings.probe``);
        a schedule measures nothing."""
        return ()

    def layer_modules(self, layer: int, width: int) -> tuple[torch.nn.Module | None,
                                                             torch.nn.Module | None]:
        """(encoder, decoder) applied around ``layer``'s exchange; ``(None, None)`` for none."""
        return None, None

    def learned_layers(self, num_layers: int) -> list[int]:
        """The layers whose exchange uses a learned encoder/decoder (``layer_modules``)."""
        return []


FULL_PRECISION = CompressionPolicy()
