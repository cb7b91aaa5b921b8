"""The wire codec (``hpcgnn.codecs.base.WireCodec``) as fused Triton kernels: the same bytes as
the C and torch paths, bit for bit, in one launch per stage over all peer blocks.

- ``select`` (one launch, only for a codec that selects): one program per peer block draws the
  block's row sample (the ``kept[b]`` rows of smallest ``row_scores``, ties to the lower row) and,
  for ``random``, one per block its ``k`` channels of smallest ``channel_scores``. A radix select
  on the 32-bit scores (8 passes of 4 bits, each a 16-bin histogram) finds the threshold; a last
  pass writes the kept rows/channels in order. Reads nothing but the keys: ``9 * rows`` hashes
  per block (the scores are hashed again in each pass rather than stored).
- ``encode`` (one launch): gathers the kept rows and channels of ``x``, scales them (the adjoint
  of ``sample``), and writes fp32 or the quantised row (header ``lo`` fp32 | ``step`` bf16,
  then the codes, ``8 / b`` a byte, lowest bits first) with the counter-based rounding noise of
  ``rng.noise_u16``. Traffic: ``4 R k`` bytes read, ``R row_bytes`` written.
- ``decode`` (one launch): writes every element of the ``(R, F)`` float32 output: the decoded
  value (scaled for ``sample``) where it travelled, 0 elsewhere. Traffic: ``R row_bytes`` read,
  ``4 R F`` written.

Float arithmetic follows the torch path operation by operation: ``div_rn`` for the two
divisions (Triton's ``/`` is not correctly rounded) and ``enable_fp_fusion=False`` so that no
multiply-add is contracted into an FMA. Sizes: rows < 2^31, elements per tensor < 2^63.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hpcgnn.kernels import cdiv, explained, pow2
from hpcgnn.kernels.hash import col_seed, lowbias32

HEADER = 6
TILE = 4096             # elements of one program's (rows x channels) tile
MAX_CW = 1024           # channels of one tile; wider rows loop over channel chunks
MAX_SAMPLED_ROWS = 2**31 - 1   # the row sample's draws (index, slot) and block starts are int32
SELECT_CHUNK = 1024     # the most scores per step of the select kernel (one program a block:
                        # few, wide steps; 8 warps from 512 on)
OPTS = {"enable_fp_fusion": False}


@dataclass(frozen=True)
class Layout:
    """One exchange's blocks and codec, as the kernels need them (tensors on the device).

    ``counts``/``starts`` int64 ``(P,)``; ``block_of_row``
    int64 ``(R,)``; ``kept``/``kept_start`` int64 ``(P,)`` and ``scale`` float32 ``(P,)`` (the
    row sample; None without); ``n_out`` rows on the wire; ``k`` channels sent of ``width``;
    ``longest`` the longest segment a select program scans (block rows or ``width``)."""

    counts: torch.Tensor
    starts: torch.Tensor
    block_of_row: torch.Tensor
    kept: torch.Tensor | None
    kept_start: torch.Tensor | None
    scale: torch.Tensor | None
    rows: int
    n_out: int
    width: int
    k: int
    bits: int
    random: bool
    adjoint: bool
    salt_rows: int
    salt_channels: int
    longest: int = 0

    @property
    def sample(self) -> bool:
        return self.kept is not None

    @property
    def row_bytes(self) -> int:
        return 4 * self.k if self.bits == 32 else HEADER + -(-self.k * self.bits // 8)


def values_layout(rows: int, width: int, bits: int, device: torch.device) -> Layout:
    """The layout of the value stage alone: ``rows`` rows of ``width`` channels, one block."""
    none = torch.empty(0, dtype=torch.int64, device=device)
    return Layout(counts=none, starts=none, block_of_row=none, kept=None,
                  kept_start=None, scale=None, rows=rows, n_out=rows, width=width, k=width,
                  bits=bits, random=False, adjoint=False, salt_rows=0, salt_channels=0)


@dataclass(frozen=True)
class Selected:
    """The draw of ``select``: ``index`` int32 ``(n_out,)`` source row of each wire row;
    ``slot`` int32 ``(R,)`` wire row of each row or -1; ``chan`` int32 ``(P, k)`` the sent
    channels, ascending; ``chan_pos`` int32 ``(P, F)`` wire column of each channel or -1."""

    index: torch.Tensor | None = None
    slot: torch.Tensor | None = None
    chan: torch.Tensor | None = None
    chan_pos: torch.Tensor | None = None


_NOTHING = Selected()


def _tile(width: int) -> tuple[int, int]:
    """(rows, channels) of a program's tile for rows of ``width`` channels."""
    cw = pow2(width, 8, MAX_CW)
    return max(1, TILE // cw), cw


# -- select ------------------------------------------------------------------------------------

@triton.jit
def _score(key, i, salt, ROWS: tl.constexpr):
    """Row (``rng.row_scores``) or channel (``rng.channel_scores``) scores of indices ``i``."""
    if ROWS:
        return lowbias32((key ^ salt) ^ lowbias32(i.to(tl.uint32)))
    else:
        return lowbias32((key ^ salt) ^ col_seed(i.to(tl.uint32)))


@triton.jit
def _threshold(key, salt, length, n, ROWS: tl.constexpr, CH: tl.constexpr):
    """The ``n``-th smallest score of a segment of ``length`` (radix select, 4 bits a pass, most
    significant first: 8 passes over the segment, each a 16-bin histogram)."""
    bins = tl.arange(0, 16)
    prefix = (key * 0).to(tl.uint32)          # the digits found so far
    high = (key * 0).to(tl.uint32)            # their mask
    need = n
    for d in range(8):
        shift = prefix * 0 + (28 - 4 * d)        # uint32, a runtime loop (fast to compile)
        hist = tl.zeros((16,), tl.int32)
        for c0 in range(0, length, CH):
            i = c0 + tl.arange(0, CH)
            s = _score(key, i, salt, ROWS)
            hit = (i < length) & ((s & high) == prefix)
            digit = ((s >> shift) & 15).to(tl.int32)
            hist += tl.sum(((digit[:, None] == bins[None, :]) & hit[:, None]).to(tl.int32), axis=0)
        found = tl.sum((tl.cumsum(hist, 0) < need).to(tl.int32))
        need -= tl.sum(tl.where(bins < found, hist, 0))
        prefix = prefix | (found.to(tl.uint32) << shift)
        high = high | (tl.full((), 15, tl.uint32) << shift)
    return prefix


@triton.jit
def _keep_smallest(key, salt, length, n, val_ptr, val_off, pos_ptr, pos_off,
                   ROWS: tl.constexpr, CH: tl.constexpr):
    """Keep the ``n`` smallest scores of a segment of ``length``: the ``j``-th kept index ``i``
    (ascending) is written as ``val_ptr[j] = i + val_off``, and every index's ``pos_ptr[i]`` =
    ``j + pos_off``, or -1 where not kept. The scores of a segment are distinct (lowbias32 and
    the column seeds are bijections of 32 bits), so the kept set is ``score <= threshold``."""
    t = _threshold(key, salt, length, n, ROWS, CH)
    kept_seen = n * 0
    for c0 in range(0, length, CH):
        i = c0 + tl.arange(0, CH)
        m = i < length
        keep = m & (_score(key, i, salt, ROWS) <= t) & (i * 0 < n)
        keep_i = keep.to(tl.int32)
        pos = kept_seen + tl.cumsum(keep_i, 0) - keep_i
        tl.store(val_ptr + pos, i + val_off, mask=keep)
        tl.store(pos_ptr + i, tl.where(keep, pos + pos_off, -1), mask=m)
        kept_seen += tl.sum(keep_i)


@triton.jit
def _select_kernel(keys_ptr, counts_ptr, starts_ptr, kept_ptr, kept_start_ptr,
                   index_ptr, slot_ptr, chan_ptr, chan_pos_ptr, n_blocks, width, k,
                   salt_rows, salt_channels,
                   SAMPLE: tl.constexpr, RANDOM: tl.constexpr, CH: tl.constexpr):
    """Programs ``[0, P)``: block ``pid``'s row sample (SAMPLE); the next ``P`` (or the first,
    without SAMPLE): block ``pid - P``'s channels (RANDOM)."""
    pid = tl.program_id(0)
    if SAMPLE:
        if pid < n_blocks:
            key = ((tl.load(keys_ptr + pid) >> 32) & 0xFFFFFFFF).to(tl.uint32)   # the row half
            start = tl.load(starts_ptr + pid).to(tl.int32)
            _keep_smallest(key, salt_rows.to(tl.uint32), tl.load(counts_ptr + pid).to(tl.int32),
                           tl.load(kept_ptr + pid).to(tl.int32), index_ptr + tl.load(kept_start_ptr + pid),
                           start, slot_ptr + start, tl.load(kept_start_ptr + pid).to(tl.int32),
                           True, CH)
    if RANDOM:
        b = pid - n_blocks if SAMPLE else pid
        if b >= 0:
            key = (tl.load(keys_ptr + b) & 0xFFFFFFFF).to(tl.uint32)    # the channel half
            _keep_smallest(key, tl.cast(salt_channels, tl.uint32), width, k, chan_ptr + b.to(tl.int64) * k, 0,
                           chan_pos_ptr + b.to(tl.int64) * width, 0, False, CH)


@explained
def select(lay: Layout, keys: torch.Tensor) -> Selected:
    """The rows and channels ``lay``'s codec sends from each block with packed block ``keys``
    (int64 ``(P,)``, ``rng.pack``: rows from the high halves, channels from the low): one
    launch; none, and ``Selected()``, for a codec that draws nothing."""
    if not (lay.sample or lay.random):
        return _NOTHING
    if lay.sample and lay.rows > MAX_SAMPLED_ROWS:
        raise ValueError(f"the Triton row sample indexes a buffer's rows in int32, and this "
                         f"exchange's buffer has {lay.rows} rows (past 2^31 - 1); set "
                         f"HPCGNN_TRITON=0 (the torch path indexes in int64), or use more ranks")
    dev, p = keys.device, int(keys.shape[0])
    i32 = dict(dtype=torch.int32, device=dev)
    index = slot = chan = chan_pos = None
    if lay.sample:
        index, slot = torch.empty(lay.n_out, **i32), torch.empty(lay.rows, **i32)
    if lay.random:
        chan, chan_pos = torch.empty(p, lay.k, **i32), torch.empty(p, lay.width, **i32)
    programs = p * (int(lay.sample) + int(lay.random))
    ch = pow2(lay.longest, 16, SELECT_CHUNK)
    if programs:
        dummy = lay.counts
        _select_kernel[(programs,)](
            keys, lay.counts, lay.starts, lay.kept if lay.sample else dummy,
            lay.kept_start if lay.sample else dummy, _or(index, dummy), _or(slot, dummy),
            _or(chan, dummy), _or(chan_pos, dummy), p, lay.width, lay.k, lay.salt_rows,
            lay.salt_channels, SAMPLE=lay.sample, RANDOM=lay.random, CH=ch,
            num_warps=8 if ch >= 512 else 4, **OPTS)
    return Selected(index, slot, chan, chan_pos)


def _or(t: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    return other if t is None else t


# -- encode ------------------------------------------------------------------------------------

@triton.jit
def _load_tile(x_ptr, src, rmask, blk, scale, chan_ptr, c0, width, k,
               RANDOM: tl.constexpr, SCALE: tl.constexpr, CW: tl.constexpr):
    """Wire columns ``[c0, c0 + CW)`` of the tile's rows: ``(y, columns, valid)``."""
    cols = c0 + tl.arange(0, CW)
    m = rmask[:, None] & (cols < k)[None, :]
    if RANDOM:
        src_col = tl.load(chan_ptr + blk[:, None].to(tl.int64) * k + cols[None, :], mask=m, other=0)
    else:
        src_col = cols[None, :]
    y = tl.load(x_ptr + src[:, None].to(tl.int64) * width + src_col, mask=m, other=0.0)
    if SCALE:
        y = y * scale[:, None]
    return y, cols, m


@triton.jit
def _row_range(y, m):
    lo = tl.min(tl.where(m, y, float("inf")), axis=1)
    hi = tl.max(tl.where(m, y, float("-inf")), axis=1)
    return lo, hi


@triton.jit
def _step(lo, hi, BITS: tl.constexpr):
    """(step bits as uint32, 1 / step or 0): ``(hi - lo) / levels`` rounded up to bfloat16, at
    least 2^-126 (``quant.MIN_STEP_BITS``: its reciprocal is finite)."""
    span = tl.math.div_rn(hi - lo, ((1 << BITS) - 1) * 1.0).to(tl.uint32, bitcast=True)
    up = (span & 0xFFFF0000) + (((span & 0xFFFF) != 0).to(tl.uint32) << 16)
    up = tl.maximum(up, 0x00800000)
    step_bits = tl.where(hi > lo, up, 0).to(tl.uint32)
    step = step_bits.to(tl.float32, bitcast=True)
    inv = tl.where(step > 0, tl.math.div_rn(1.0, step), 0.0)
    return step_bits, inv


@triton.jit
def _header_shift(j):
    """Bit position of header byte ``j`` (0-7) in its 32-bit word: ``lo``'s bytes 0-3 at 0-24,
    the step's bytes 4-5 at 16 and 24 (its bfloat16 is the word's high half). Bytes 6 and 7 are
    not header: shift 0, never 32 or 40 -- a shift by the word's width or more is undefined in
    LLVM (poison), and Triton 3.6 folded the step of a 2-bit wire with 16-byte rows to 0
    on an H100 from it."""
    return tl.where(j < 4, 8 * j, tl.where(j < 6, 8 * j - 16, 0)).to(tl.uint32)


@triton.jit
def _store_header(out_ptr, rows, rmask, row_bytes, lo, step_bits):
    """Bytes 0-3: ``lo`` (fp32), 4-5: the step's bfloat16, little endian."""
    j = tl.arange(0, 8)
    word = tl.where((j < 4)[None, :], lo.to(tl.uint32, bitcast=True)[:, None], step_bits[:, None])
    shift = _header_shift(j)
    byte = ((word >> shift[None, :]) & 0xFF).to(tl.uint8)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * row_bytes + j[None, :], byte,
             mask=rmask[:, None] & (j < 6)[None, :])


@triton.jit
def _store_codes(out_ptr, y, cols, m, lo, inv, row_hash, rows, rmask, row_bytes, c0, n_bytes,
                 BITS: tl.constexpr, BR: tl.constexpr, CW: tl.constexpr):
    """Stochastic rounding of one tile and its packed codes (``8 / BITS`` a byte)."""
    PER: tl.constexpr = 8 // BITS
    t = (y - lo[:, None]) * inv[:, None]
    h = lowbias32(row_hash[:, None] ^ col_seed((cols >> 1).to(tl.uint32))[None, :])
    u16 = (h >> ((cols & 1) * 16).to(tl.uint32)[None, :]) & 0xFFFF
    u = (u16.to(tl.float32) + 0.5) * (1.0 / 65536.0)
    q = tl.minimum(t + u, (1 << BITS) - 1.0).to(tl.int32)      # t + u >= 0: truncation = floor
    q = tl.where(m, q, 0)
    if PER == 1:
        packed = q
    else:
        shifts = tl.arange(0, PER) * BITS
        packed = tl.sum(tl.reshape(q, (BR, CW // PER, PER)) << shifts[None, None, :], axis=2)
    b = c0 // PER + tl.arange(0, CW // PER)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * row_bytes + 6 + b[None, :], packed.to(tl.uint8),
             mask=rmask[:, None] & (b < n_bytes)[None, :])


@triton.jit
def _encode_kernel(x_ptr, out_ptr, index_ptr, block_ptr, chan_ptr, scale_ptr,
                   n_rows, width, k, row_bytes, key,
                   BITS: tl.constexpr, SAMPLE: tl.constexpr, RANDOM: tl.constexpr,
                   SCALE: tl.constexpr, BR: tl.constexpr, CW: tl.constexpr):
    """Wire rows ``[pid * BR, pid * BR + BR)``: fp32 (BITS 32) or quantised."""
    key = tl.cast(key, tl.uint32)             # a key of 1 arrives as a constexpr (no .to)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)   # int32 wraps at 2^31 rows
    rmask = rows < n_rows
    src = tl.load(index_ptr + rows, mask=rmask, other=0) if SAMPLE else rows
    blk = tl.load(block_ptr + src, mask=rmask, other=0) if (RANDOM or SCALE) else rows
    scale = tl.load(scale_ptr + blk, mask=rmask, other=1.0) if SCALE else 1.0
    if BITS == 32:
        for c0 in range(0, k, CW):
            y, cols, m = _load_tile(x_ptr, src, rmask, blk, scale, chan_ptr, c0, width, k, RANDOM, SCALE, CW)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * k + cols[None, :], y, mask=m)
    else:
        lo = tl.full((BR,), float("inf"), tl.float32)
        hi = tl.full((BR,), float("-inf"), tl.float32)
        for c0 in range(0, k, CW):              # pass 1: the row range
            y, cols, m = _load_tile(x_ptr, src, rmask, blk, scale, chan_ptr, c0, width, k, RANDOM, SCALE, CW)
            a, b = _row_range(y, m)
            lo = tl.minimum(lo, a)
            hi = tl.maximum(hi, b)
        step_bits, inv = _step(lo, hi, BITS)
        _store_header(out_ptr, rows, rmask, row_bytes, lo, step_bits)
        row_hash = lowbias32(lowbias32(rows.to(tl.uint32)) ^ key)
        n_bytes = row_bytes - 6
        for c0 in range(0, k, CW):              # pass 2 (a wide row's tiles come from cache)
            y, cols, m = _load_tile(x_ptr, src, rmask, blk, scale, chan_ptr, c0, width, k, RANDOM, SCALE, CW)
            _store_codes(out_ptr, y, cols, m, lo, inv, row_hash, rows, rmask, row_bytes, c0, n_bytes,
                         BITS, BR, CW)


@explained
def encode(x: torch.Tensor, lay: Layout, sel: Selected, key: int) -> torch.Tensor:
    """float32 ``(R, F)`` -> uint8 ``[n_out * row_bytes]`` (one launch); ``key``: the sender's
    rounding key."""
    fp32 = lay.bits == 32
    out = torch.empty(lay.n_out * (lay.k if fp32 else lay.row_bytes),
                      dtype=torch.float32 if fp32 else torch.uint8, device=x.device)
    if lay.n_out:
        br, cw = _tile(lay.k)
        dummy = lay.block_of_row
        _encode_kernel[(cdiv(lay.n_out, br),)](
            x, out, _or(sel.index, dummy), lay.block_of_row, _or(sel.chan, dummy),
            _or(lay.scale, x), lay.n_out, lay.width, lay.k, lay.row_bytes, key & 0xFFFFFFFF,
            BITS=lay.bits, SAMPLE=lay.sample, RANDOM=lay.random, SCALE=lay.sample and lay.adjoint,
            BR=br, CW=cw, **OPTS)
    return out.view(torch.uint8) if fp32 else out


# -- decode ------------------------------------------------------------------------------------

@triton.jit
def _header(buf_ptr, slot, live, row_bytes):
    """(lo, step) of wire rows ``slot``."""
    j = tl.arange(0, 8)
    m = live[:, None] & (j < 6)[None, :]
    b = tl.load(buf_ptr + slot[:, None] * row_bytes + j[None, :], mask=m, other=0).to(tl.uint32)
    part = b << _header_shift(j)[None, :]
    lo = tl.sum(tl.where((j < 4)[None, :], part, 0), axis=1).to(tl.float32, bitcast=True)
    step = tl.sum(tl.where(((j >= 4) & (j < 6))[None, :], part, 0), axis=1).to(tl.float32, bitcast=True)
    return lo, step


@triton.jit
def _decode_kernel(buf_ptr, out_ptr, slot_ptr, block_ptr, chan_pos_ptr, scale_ptr,
                   n_rows, width, k, row_bytes,
                   BITS: tl.constexpr, SAMPLE: tl.constexpr, RANDOM: tl.constexpr,
                   SCALE: tl.constexpr, BR: tl.constexpr, CW: tl.constexpr):
    """Output rows ``[pid * BR, pid * BR + BR)``, every channel."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)   # int32 wraps at 2^31 rows
    rmask = rows < n_rows
    slot = tl.load(slot_ptr + rows, mask=rmask, other=-1) if SAMPLE else rows
    live = rmask & (slot >= 0)
    slot = tl.where(live, slot, 0).to(tl.int64)
    blk = tl.load(block_ptr + rows, mask=rmask, other=0) if (RANDOM or SCALE) else rows
    scale = tl.load(scale_ptr + blk, mask=rmask, other=1.0) if SCALE else 1.0
    if BITS != 32:
        lo, step = _header(buf_ptr, slot, live, row_bytes)
    for c0 in range(0, width, CW):
        cols = c0 + tl.arange(0, CW)
        cm = rmask[:, None] & (cols < width)[None, :]
        if RANDOM:
            j = tl.load(chan_pos_ptr + blk[:, None].to(tl.int64) * width + cols[None, :], mask=cm, other=-1)
        else:
            j = tl.where(cols < k, cols, -1)[None, :]
        ok = cm & live[:, None] & (j >= 0)
        j = tl.where(ok, j, 0)
        if BITS == 32:
            v = tl.load(buf_ptr + slot[:, None] * k + j, mask=ok, other=0.0)
        else:
            byte = tl.load(buf_ptr + slot[:, None] * row_bytes + 6 + j // (8 // BITS), mask=ok, other=0)
            code = (byte.to(tl.int32) >> ((j % (8 // BITS)) * BITS)) & ((1 << BITS) - 1)
            v = code.to(tl.float32) * step[:, None] + lo[:, None]
        if SCALE:
            v = v * scale[:, None]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], tl.where(ok, v, 0.0), mask=cm)


@explained
def decode(buf: torch.Tensor, lay: Layout, sel: Selected) -> torch.Tensor:
    """uint8 ``[n_out * row_bytes]`` -> float32 ``(R, F)`` (one launch)."""
    out = torch.empty(lay.rows, lay.width, dtype=torch.float32, device=buf.device)
    if lay.rows and lay.width:
        br, cw = _tile(lay.width)
        src = buf.view(torch.float32) if lay.bits == 32 else buf
        dummy = lay.block_of_row
        _decode_kernel[(cdiv(lay.rows, br),)](
            src, out, _or(sel.slot, dummy), lay.block_of_row, _or(sel.chan_pos, dummy),
            _or(lay.scale, out), lay.rows, lay.width, lay.k, lay.row_bytes,
            BITS=lay.bits, SAMPLE=lay.sample, RANDOM=lay.random, SCALE=lay.sample and not lay.adjoint,
            BR=br, CW=cw, **OPTS)
    return out
