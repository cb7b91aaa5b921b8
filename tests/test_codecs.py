"""Codecs: exact byte counts, exactness at ratio 1, the selections and the quantiser against an
independent numpy re-implementation of the documented hashes, the error bound, unbiasedness,
and the backward (adjoint) codec. ``tests/test_codecs_gpu.py`` runs the same on CUDA."""
import math

import numpy as np
import pytest
import torch

from hpcgnn.codecs import (IDENTITY, MIN_KEEP, WireCodec, backward_codec, bits_for, build_codec,
                           channels_for, parse_codec)
from hpcgnn.codecs.learned import learned_pair
from hpcgnn.codecs.rng import Blocks

RATIOS = (1, 2, 4, 8, 16, 32, 64, 128)
WIDTHS = (1, 7, 16, 100)
COUNTS = [(5,), (3, 0, 11), (0, 0), (1, 2, 0, 4)]
NAMES = ("none", "truncate", "learned", "random", "quant", "sample", "truncate+quant",
         "sample+random", "sample+learned+quant")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def dev(request):
    """Every test runs on the CPU and, where there is one, on a GPU."""
    return request.param


# -- an independent reference of the documented randomness (numpy, uint32 arithmetic) --------

def np_hash32(x):
    x = np.asarray(x, dtype=np.uint64) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & np.uint64(0xFFFFFFFF)
    return x ^ (x >> np.uint64(16))


def np_col(g):
    return np_hash32((np.asarray(g, dtype=np.uint64) * np.uint64(0x9E3779B1) + np.uint64(0x7F4A7C15))
                     & np.uint64(0xFFFFFFFF))


def row_half(key: int) -> int:
    """The row key of a packed block key: its high 32 bits (documented in hpcgnn/codecs/rng.py)."""
    return (int(key) >> 32) & 0xFFFFFFFF


def channel_half(key: int) -> int:
    """The channel key of a packed block key: its low 32 bits."""
    return int(key) & 0xFFFFFFFF


def ref_kept_rows(key: int, rows: int, keep: float) -> list[int]:
    """Row sample of one block with row key ``key`` (32 bits): the ceil(rows * keep) rows of
    smallest score (ties: lower row)."""
    n = 0 if rows == 0 else min(rows, max(1, math.ceil(rows * keep - 1e-9)))
    score = np_hash32((np.uint64(key) ^ np.uint64(0x5A17E5)) ^ np_hash32(np.arange(rows)))
    return sorted(np.lexsort((np.arange(rows), score))[:n].tolist())


def ref_channels(key: int, width: int, k: int) -> list[int]:
    score = np_hash32((np.uint64(key) ^ np.uint64(0xC4A22E)) ^ np_col(np.arange(width)))
    return sorted(np.lexsort((np.arange(width), score))[:k].tolist())


def ref_quant_parts(x: np.ndarray, bits: int, key: int):
    """(lo float32, step float32, codes) of each row: lo exact, step rounded up to bfloat16 and
    at least 2^-126 (the smallest normal float) where the row is not constant, stochastic rounding with u16 = half (c % 2) of hash32(hash32(key ^ hash32(r)) ^ col(c // 2))."""
    x = x.astype(np.float32)
    levels = np.float32(2 ** bits - 1)
    lo, hi = x.min(1), x.max(1)
    span = ((hi - lo) / levels).astype(np.float32)
    b = span.view(np.uint32).astype(np.uint64)
    up = np.where(b & 0xFFFF, (b & 0xFFFF0000) + 0x10000, b).astype(np.uint32).view(np.float32)
    step = np.where(hi > lo, np.maximum(up, np.float32(2.0 ** -126)), np.float32(0))   # >= FLT_MIN
    with np.errstate(divide="ignore"):
        inv = np.where(step > 0, np.float32(1) / step, np.float32(0)).astype(np.float32)
    u16 = ref_noise_u16(*x.shape, key)
    u = ((u16.astype(np.float32) + np.float32(0.5)) * np.float32(1 / 65536)).astype(np.float32)
    t = ((x - lo[:, None]) * inv[:, None]).astype(np.float32)
    q = np.minimum(np.floor((t + u).astype(np.float32)), levels).astype(np.float32)
    return lo, step, q


def ref_noise_u16(rows: int, width: int, key: int) -> np.ndarray:
    """The 16-bit noise ``u16`` of every value: half ``c % 2`` of
    ``hash32(hash32(key ^ hash32(r)) ^ col(c // 2))``."""
    row = np_hash32(np_hash32(np.arange(rows)) ^ np.uint64(key & 0xFFFFFFFF))
    h = np_hash32(row[:, None] ^ np_col(np.arange((width + 1) // 2))[None, :])
    return np.stack([h & 0xFFFF, h >> np.uint64(16)], axis=2).reshape(rows, -1)[:, :width]


def ref_quant(x: np.ndarray, bits: int, key: int) -> np.ndarray:
    """What the receiver gets: ``lo + q * step`` of ``ref_quant_parts``."""
    lo, step, q = ref_quant_parts(x, bits, key)
    return (q * step[:, None]).astype(np.float32) + lo[:, None]


# -- helpers ---------------------------------------------------------------------------------

def _keys(n, base=17, device="cpu"):
    """``n`` packed block keys: row key (high 32 bits, some >= 2^31: a negative int64) and
    channel key (low 32 bits), both varying."""
    vals = []
    for i in range(n):
        row = (base * (i + 1) * 2654435761) & 0xFFFFFFFF
        chan = (base * (i + 7) * 40503 + 12345) & 0xFFFFFFFF
        v = (row << 32) | chan
        vals.append(v - (1 << 64) if v >= 1 << 63 else v)
    return torch.tensor(vals, dtype=torch.int64, device=device)


def _roundtrip(codec, x, counts, keys=None, noise=7):
    blocks = Blocks.of(counts, x.device)
    keys = _keys(len(counts), device=x.device) if keys is None else keys
    buf = codec.encode(x, blocks, keys, noise)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.device == x.device
    assert buf.numel() == sum(codec.byte_counts(counts, x.shape[1]))
    y = codec.decode(buf, blocks, x.shape[1], keys)
    assert y.device == x.device and y.shape == x.shape
    return y


def _formula(name: str, ratio: float, rows: int, width: int, bits=4, keep=0.5) -> int:
    """Hand-written byte formula of one block, independent of the codec classes."""
    spec = parse_codec(name)
    row_width = width
    if spec.channels:
        row_width = max(1, min(width, math.floor(width / ratio)))
    if spec.sample:
        p = max(1 / ratio, 1 / 8) if spec.rate_stage == "sample" else keep
        rows = 0 if rows == 0 else min(rows, max(1, math.ceil(rows * p)))
    b = ({1: None, 2: None, 4: 8, 8: 4, 16: 2, 32: 1, 64: 1, 128: 1}[ratio]
         if spec.rate_stage == "quant" else (bits if spec.quant else None))
    per_row = row_width * 4 if b is None else 6 + math.ceil(row_width * b / 8)
    return rows * per_row


def _build(name, ratio, width):
    spec = parse_codec(name)
    bits = 4 if spec.quant and spec.rate_stage != "quant" else None
    keep = 0.5 if spec.sample and spec.rate_stage != "sample" else None
    spec = type(spec)(spec.sample, spec.channels, spec.quant, bits=bits, keep=keep)
    return build_codec(spec, ratio, width)


# -- bytes, identity, stages -------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_bytes_equal_formula_for_every_ratio(name, dev):
    for ratio in RATIOS:
        for width in WIDTHS:
            codec = _build(name, ratio, width)
            for counts in COUNTS:
                want = [_formula(name, ratio, c, width) for c in counts]
                assert codec.byte_counts(counts, width) == want, (name, ratio, width, counts)
                x = torch.randn(sum(counts), width, device=dev)
                _roundtrip(codec, x, counts)


@pytest.mark.parametrize("name", ("none", "truncate", "learned", "random", "quant", "sample"))
def test_ratio_one_is_exact(name, dev):
    codec = _build(name, 1, 16)
    assert codec == IDENTITY
    x = torch.randn(9, 16, device=dev)
    assert torch.equal(_roundtrip(codec, x, [4, 5]), x)


def test_truncate_sends_first_k_and_zero_pads(dev):
    x = torch.randn(6, 10, device=dev)
    y = _roundtrip(WireCodec(channels="truncate", k=3), x, [2, 4])
    assert torch.equal(y[:, :3], x[:, :3]) and not y[:, 3:].any()


def test_k_is_guarded_to_at_least_one():
    assert channels_for(16, 128) == 1 and channels_for(3, 4.0) == 1
    assert channels_for(16, 1) == 16 and channels_for(16, 5) == 3
    with pytest.raises(ValueError, match="k must be >= 1"):
        WireCodec(channels="truncate", k=0)
    with pytest.raises(ValueError, match="exceed the row width"):
        WireCodec(channels="truncate", k=8).byte_counts([3], 4)


def test_random_channels_are_the_documented_draw_per_block(dev):
    counts = [4, 0, 5]
    keys = _keys(3, base=5, device=dev)
    x = torch.randn(9, 32, device=dev)
    y = _roundtrip(WireCodec(channels="random", k=4), x, counts, keys)
    starts = [0, 4, 4]
    for p, c in enumerate(counts):
        if not c:
            continue
        cols = ref_channels(channel_half(keys[p]), 32, 4)
        block = y[starts[p]:starts[p] + c]
        assert torch.equal(block[:, cols], x[starts[p]:starts[p] + c, cols])
        rest = [j for j in range(32) if j not in cols]
        assert not block[:, rest].any()
    assert ref_channels(channel_half(keys[0]), 32, 4) != ref_channels(channel_half(keys[2]), 32, 4)


@pytest.mark.parametrize("native", (True, False), ids=("c", "torch"))
@pytest.mark.parametrize("keep", (0.3, 0.125, 0.999))
@pytest.mark.parametrize("counts", ([10, 3, 0, 7], [3000, 0, 2500, 1, 1200], [2, 1, 64, 5]),
                         ids=("small", "per-block", "tiny"))   # per-block: >= SELECT_BLOCK_ROWS a block
def test_sample_keeps_the_documented_rows_scaled(counts, keep, native, monkeypatch, dev):
    """The kept rows are the numpy reference's (CPU ranks: the C selection and placement, and
    the torch code), each scaled by rows / kept as a float32 product; the rest are zero."""
    if not native:
        monkeypatch.setenv("HPCGNN_NATIVE", "0")
    keys = _keys(len(counts), base=3, device=dev)
    x = torch.randn(sum(counts), 4, device=dev) + 5   # no zero rows
    y = _roundtrip(WireCodec(keep=keep), x, counts, keys)
    start = 0
    for p, c in enumerate(counts):
        kept = ref_kept_rows(row_half(keys[p]), c, keep)
        got = torch.nonzero(y[start:start + c].abs().sum(1) > 0).flatten().tolist()
        assert got == kept, p
        scale = np.float32(c) / np.float32(max(len(kept), 1))
        want = x[start:start + c].cpu().numpy()[kept] * scale
        assert np.array_equal(y[start:start + c].cpu().numpy()[kept], want), p
        start += c


@pytest.mark.parametrize("native", (True, False), ids=("c", "torch"))
def test_unscaled_sample_sends_the_same_rows_as_they_are(native, monkeypatch, dev):
    """``scaled = False`` (GAT's): the documented rows, unscaled, and the adjoint returns the
    gradients of exactly those rows, unscaled too."""
    if not native:
        monkeypatch.setenv("HPCGNN_NATIVE", "0")
    counts = [10, 3, 0, 7]
    keys = _keys(len(counts), base=3, device=dev)
    x = torch.randn(sum(counts), 4, device=dev) + 5
    codec = WireCodec(keep=0.3, scaled=False)
    assert codec.name == "sample(0.3,unscaled)"
    y = _roundtrip(codec, x, counts, keys)
    g = _roundtrip(backward_codec(codec, IDENTITY), x, counts, keys)
    start, sent = 0, torch.zeros(sum(counts), dtype=torch.bool)
    for p, c in enumerate(counts):
        sent[[start + r for r in ref_kept_rows(row_half(keys[p]), c, 0.3)]] = True
        start += c
    for got in (y, g):
        assert torch.equal(got[sent.to(dev)], x[sent.to(dev)]) and not got[~sent.to(dev)].any()


def test_the_torch_path_chosen_on_purpose_is_no_missing_kernel(monkeypatch, tmp_path):
    """``native.unavailable`` (the start-up's "no C kernels on host" warning): None where the
    kernels load and where ``HPCGNN_NATIVE=0`` chooses the torch path; where they cannot be
    built (no compiler, an empty cache), why."""
    from hpcgnn.codecs import native
    assert native.lib() is not None and native.unavailable() is None
    monkeypatch.setenv("HPCGNN_NATIVE", "0")
    assert native.lib() is None and native.unavailable() is None
    monkeypatch.delenv("HPCGNN_NATIVE")
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_candidates", lambda: [tmp_path / "absent.so"])
    monkeypatch.setenv("CC", "false")
    assert native.lib() is None and "absent.so: cannot build it" in native.unavailable()


def test_sample_is_unbiased_and_its_scale_is_bounded(dev):
    x = torch.randn(10, 4, device=dev)
    est = sum(_roundtrip(WireCodec(keep=0.3), x, [10], keys=_keys(1, base=k + 1, device=dev)) for k in range(3000)) / 3000
    assert (est - x).abs().max() < 0.25
    heavy = build_codec(parse_codec("sample"), 128.0, 16)
    assert heavy.keep == MIN_KEEP
    y = _roundtrip(heavy, torch.ones(100, 2, device=dev), [100])
    assert y.max() <= 1 / MIN_KEEP + 1e-5 and (y.abs().sum(1) > 0).sum() == 13


# -- quantisation ------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", (1, 2, 4, 8))
@pytest.mark.parametrize("native", (True, False))
def test_quant_equals_the_numpy_reference(bits, native, monkeypatch, dev):
    if not native:
        monkeypatch.setenv("HPCGNN_NATIVE", "0")
    torch.manual_seed(bits)
    x = torch.randn(57, 37, device=dev) * 3 + 1
    x[3] = 0.25                                            # a constant row
    y = _roundtrip(WireCodec(bits=bits), x, [20, 0, 37], noise=12345)
    want = ref_quant(x.cpu().numpy(), bits, 12345)
    assert np.array_equal(y.cpu().numpy(), want)


@pytest.mark.parametrize("native", (True, False), ids=("c", "torch"))
def test_quant_noise_is_the_middle_of_its_cell(native, monkeypatch, dev):
    """``u = (u16 + 1/2) / 2^16``: a value a quarter of a noise cell below a code boundary,
    ``t = m + 1 - (u16 + 1/4) / 2^16`` with the ``u16`` it draws, rounds up to ``m + 1``; a
    noise without the half (``u16 / 2^16``) rounds it down, and on random rows the two agree
    but for about one value in 2^17 (``test_quant_equals_the_numpy_reference`` cannot tell)."""
    if not native:
        monkeypatch.setenv("HPCGNN_NATIVE", "0")
    rows, width, key = 6, 40, 4321
    m = (np.arange(rows)[:, None] + np.arange(width)[None, :]) % 3      # codes 1..3 wanted
    x = m + 1 - (ref_noise_u16(rows, width, key).astype(np.float64) + 0.25) / 65536
    x[:, 0], x[:, 1] = 0.0, 3.0                           # lo = 0, step = 3 / (2^2 - 1) = 1
    x = x.astype(np.float32)
    y = _roundtrip(WireCodec(bits=2), torch.from_numpy(x).to(dev), [2, 4], noise=key)
    want = np.asarray(m + 1, dtype=np.float32)
    want[:, 0], want[:, 1] = 0.0, 3.0
    assert np.array_equal(y.cpu().numpy(), want)


@pytest.mark.parametrize("scale", (1e-9, 1.0, 1e6))
def test_quant_error_is_within_one_step(scale, dev):
    x = (torch.randn(50, 33, device=dev) * 3 + 100) * scale     # |x| >> range: no |x| floor
    for bits in (1, 2, 4, 8):
        y = _roundtrip(WireCodec(bits=bits), x, [20, 30])
        step = (x.amax(1) - x.amin(1)) / (2 ** bits - 1)
        assert ((y - x).abs() <= step[:, None] * (1 + 2 ** -7)).all(), bits
        assert torch.isfinite(y).all()


@pytest.mark.parametrize("native", (True, False))
def test_rows_of_tiny_range_land_within_one_step(native, monkeypatch, dev):
    """Rows whose range is below ``2^-126 (2^b - 1)`` (halo gradients can be that small): the step
    is at least 2^-126, so ``1 / step`` is finite, every value lands within one step, and every
    path sends the reference's bytes. With the step a subnormal, ``1 / step`` overflowed: the C
    and Triton kernels sent every value of such a row as the top code, the torch path as 0."""
    if not native:
        monkeypatch.setenv("HPCGNN_NATIVE", "0")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 9, generator=g)
    x[0::4] *= 1e-38
    x[1::4] *= 1e-40
    x[2::4] *= 1e-44                                       # a few subnormal steps wide
    x[3::4] = 0.0
    x[3::4, 4] = 1e-45                                     # one value of the smallest subnormal
    x = x.to(dev)
    for bits in (1, 2, 4, 8):
        y = _roundtrip(WireCodec(bits=bits), x, [10, 14], noise=77)
        assert np.array_equal(y.cpu().numpy(), ref_quant(x.cpu().numpy(), bits, 77)), bits
        step = torch.clamp((x.amax(1) - x.amin(1)) / (2 ** bits - 1) * (1 + 2 ** -7), min=2.0 ** -126)
        assert torch.isfinite(y).all() and ((y - x).abs() <= step[:, None]).all(), bits


def test_quant_is_unbiased_and_error_shrinks_with_samples(dev):
    torch.manual_seed(0)
    x = torch.randn(4, 64, device=dev)
    codec = WireCodec(bits=1)

    def mean_error(n):
        est = sum(_roundtrip(codec, x, [4], noise=1000 + i) for i in range(n)) / n
        return (est - x).abs().mean().item()

    small, large = mean_error(16), mean_error(1024)
    assert large < small / 4  # ~1/sqrt(n): 8x fewer with 64x the samples
    assert large < 0.1  # one step is ~5 here: a biased rounding would sit near 1


@pytest.mark.parametrize("native", (True, False), ids=("c", "torch"))
def test_quant_is_unbiased_on_rows_far_from_zero(native, monkeypatch, dev):
    """The mean of many draws (noise keys) is the row, to within the sampling error, at every
    width, on rows whose minimum is large next to their range. A quantiser that sends the
    minimum or the scale in bfloat16 (AdaQP's: ``100.3`` arrives as ``100.5``) shifts such a
    row by thousands of sampling errors. Each draw's error is within one step ``d``, so its
    standard deviation is at most ``d / 2`` and the mean of ``n`` draws is within
    ``6 d / (2 sqrt(n))`` of the row."""
    if not native:
        monkeypatch.setenv("HPCGNN_NATIVE", "0")
    g = torch.Generator().manual_seed(5)
    x = torch.rand(6, 40, generator=g, dtype=torch.float64)
    x = x * torch.tensor([0.1, 0.1, 3.0, 1e-3, 2.0, 1e-30], dtype=torch.float64)[:, None]
    x += torch.tensor([100.3, -77.7, 0.0, 1.0, -1.0, 3e-29], dtype=torch.float64)[:, None]
    x = x.to(torch.float32).to(dev)
    n = 600
    for bits in (1, 2, 4, 8):
        codec = WireCodec(bits=bits)
        total = torch.zeros(x.shape, dtype=torch.float64, device=dev)
        for i in range(n):
            total += _roundtrip(codec, x, [2, 4], noise=9000 + 31 * i).double()
        err = total / n - x.double()
        d = (x.amax(1) - x.amin(1)).double() / (2 ** bits - 1) * (1 + 2 ** -7)
        assert (err.abs() <= 6 * d[:, None] / (2 * math.sqrt(n))).all(), bits
        # the row's mean error: 40 independent values, so a common shift shows even more
        assert (err.mean(1).abs() <= 6 * d / (2 * math.sqrt(n * x.shape[1]))).all(), bits


def test_composite_truncate_quant(dev):
    x = torch.randn(12, 64, device=dev)
    codec = WireCodec(channels="truncate", k=16, bits=4)
    assert codec.byte_counts([12], 64) == [12 * (6 + 8)]
    y = _roundtrip(codec, x, [12])
    assert not y[:, 16:].any()
    want = ref_quant(x[:, :16].cpu().numpy(), 4, 7)
    assert np.array_equal(y[:, :16].cpu().numpy(), want)


# -- the backward codec is the adjoint of the forward ----------------------------------------

@pytest.mark.parametrize("codec", [WireCodec(keep=0.4), WireCodec(channels="random", k=3),
                                   WireCodec(channels="truncate", k=2),
                                   WireCodec(keep=0.5, channels="random", k=5)], ids=repr)
@pytest.mark.parametrize("native", (True, False), ids=("c", "torch"))
def test_backward_is_the_adjoint_of_the_forward(codec, native, monkeypatch, dev):
    """<F x, g> == <x, F* g> for the fp32 forward F and its backward codec F* (same keys)."""
    if not native:
        monkeypatch.setenv("HPCGNN_NATIVE", "0")
    counts = [6, 0, 9, 4]
    keys = _keys(4, base=11, device=dev)
    x = torch.randn(19, 8, device=dev, dtype=torch.float32)
    g = torch.randn(19, 8, device=dev, dtype=torch.float32)
    fx = _roundtrip(codec, x, counts, keys)
    adj = backward_codec(codec, IDENTITY)
    assert adj.adjoint and adj.byte_counts(counts, 8) == codec.byte_counts(counts, 8)
    ag = _roundtrip(adj, g, counts, keys)
    assert torch.allclose((fx * g).sum(), (x * ag).sum(), rtol=1e-5)
    sent = fx != 0                                          # the entries the forward sent
    assert not ag[~sent].any()                             # nothing flows back for the others


def test_backward_takes_the_backward_value_stage():
    fwd = WireCodec(channels="random", k=4, bits=1)
    bwd = backward_codec(fwd, WireCodec(bits=8))
    assert (bwd.channels, bwd.k, bwd.bits, bwd.adjoint) == ("random", 4, 8, True)
    assert backward_codec(WireCodec(bits=2), WireCodec(bits=4)) == WireCodec(bits=4)
    assert backward_codec(WireCodec(keep=0.5), IDENTITY).bits == 32


def test_learned_wire_is_truncate_and_pair_starts_as_identity(dev):
    x = torch.randn(5, 8, device=dev)
    assert torch.equal(_roundtrip(WireCodec(channels="learned", k=2), x, [5]),
                       _roundtrip(WireCodec(channels="truncate", k=2), x, [5]))
    enc, dec = learned_pair(8)
    assert torch.allclose(dec(enc(x.cpu())), x.cpu())


def test_bits_for_ratio():
    assert [bits_for(r) for r in (1, 3.9, 4, 8, 16, 31, 32, 128)] == \
        [None, None, 8, 4, 2, 2, 1, 1]


@pytest.mark.parametrize("bad,match", [("zip", "unknown codec"), ("truncate+truncate", "twice"),
                                       ("truncate+random", "at most one"), ("none+quant", "none")])
def test_parse_codec_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_codec(bad)


def test_stage_order_does_not_matter():
    assert parse_codec("quant+truncate") == parse_codec("truncate+quant")


def test_the_c_row_stage_refuses_an_index_it_cannot_take():
    """The C placement takes a strictly ascending index within the rows (what the selection
    writes) and the C gather an index within ``x``: anything else raises instead of writing
    rows out of place or reading outside ``x``."""
    from hpcgnn.codecs import native
    if native.lib() is None:
        pytest.skip("the C kernels are not built here")
    y = torch.ones(3, 4)
    assert torch.equal(native.place_rows(y, torch.tensor([0, 2, 5]), None, 6).sum(1),
                       torch.tensor([4.0, 0, 4, 0, 0, 4]))
    for bad in ([0, 2, 2], [2, 1, 3], [0, 1, 6], [-1, 0, 1]):
        with pytest.raises(ValueError, match="ascending"):
            native.place_rows(y, torch.tensor(bad), None, 6)
    x = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(native.gather_rows(x, torch.tensor([5, 0]), torch.tensor([2.0, 1.0])),
                       torch.tensor([[20.0, 22.0], [0.0, 1.0]]))
    for bad in ([6], [-1]):
        with pytest.raises(IndexError, match="outside"):
            native.gather_rows(x, torch.tensor(bad), None)


def test_a_backward_exchange_reuses_its_forwards_selection():
    """CPU ranks keep the last few selections on their ``Blocks``: the backward codec (the
    forward's adjoint, other bits) draws the same selection object, other keys a new one, and
    what each sends is what a fresh draw gives."""
    counts = [40, 0, 25]
    blocks = Blocks.of(counts)
    keys = _keys(3, base=5)
    fwd = WireCodec(keep=0.3, channels="random", k=3, bits=4)
    bwd = backward_codec(fwd, WireCodec(bits=8))
    first = fwd.select(blocks, keys, 8)
    assert bwd.select(blocks, keys, 8) is first and len(blocks.selections) == 1
    other = fwd.select(blocks, _keys(3, base=6), 8)
    assert other is not first and len(blocks.selections) == 2
    fresh = fwd.select(Blocks.of(counts), keys, 8)
    for a, b in zip((first.index, first.scale, first.chan), (fresh.index, fresh.scale, fresh.chan)):
        assert torch.equal(a, b)
    for base in range(7, 20):                              # bounded: the oldest go first
        fwd.select(blocks, _keys(3, base=base), 8)
    assert len(blocks.selections) <= 4
