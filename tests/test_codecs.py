"""Codecs: exact byte counts, exactness at ratio 1, unbiased quantisation, composition."""
import math

import pytest
import torch

from hpcgnn.codecs import (IDENTITY, LearnedCodec, QuantCodec, RandomChannelCodec, SampleCodec,
                           TruncateCodec, bits_for, build_codec, channels_for, kept_rows,
                           parse_codec)
from hpcgnn.codecs.learned import learned_pair
from hpcgnn.codecs.quant import _bf16_outward, _bf16_value

RATIOS = (1, 2, 4, 8, 16, 32, 64, 128)
WIDTHS = (1, 7, 16, 100)
COUNTS = [(5,), (3, 0, 11), (0, 0), (1, 2, 0, 4)]
NAMES = ("none", "truncate", "learned", "random", "quant", "sample", "truncate+quant",
         "sample+random", "sample+learned+quant")


def _roundtrip(codec, x, counts, keys=None):
    keys = keys or [17 * (i + 1) for i in range(len(counts))]
    buf = codec.encode(x, counts, keys)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == sum(codec.byte_counts(counts, x.shape[1]))
    return codec.decode(buf, counts, x.shape[1], keys)


def _formula(name: str, ratio: float, rows: int, width: int, bits=4, keep=0.5) -> int:
    """Hand-written byte formula of one block, independent of the codec classes."""
    spec = parse_codec(name)
    row_width = width
    if spec.channels:
        row_width = max(1, min(width, math.floor(width / ratio)))
    if spec.sample:
        p = 1 / ratio if spec.rate_stage == "sample" else keep
        rows = 0 if rows == 0 else min(rows, max(1, math.ceil(rows * p)))
    b = ({1: None, 2: None, 4: 8, 8: 4, 16: 2, 32: 1, 64: 1, 128: 1}[ratio]
         if spec.rate_stage == "quant" else (bits if spec.quant else None))
    per_row = row_width * 4 if b is None else 4 + math.ceil(row_width * b / 8)
    return rows * per_row


def _build(name, ratio, width):
    spec = parse_codec(name)
    bits = 4 if spec.quant and spec.rate_stage != "quant" else None
    keep = 0.5 if spec.sample and spec.rate_stage != "sample" else None
    spec = type(spec)(spec.sample, spec.channels, spec.quant, bits=bits, keep=keep)
    return build_codec(spec, ratio, width)


@pytest.mark.parametrize("name", NAMES)
def test_bytes_equal_formula_for_every_ratio(name):
    for ratio in RATIOS:
        for width in WIDTHS:
            codec = _build(name, ratio, width)
            for counts in COUNTS:
                want = [_formula(name, ratio, c, width) for c in counts]
                assert codec.byte_counts(counts, width) == want, (name, ratio, width, counts)
                x = torch.randn(sum(counts), width)
                assert _roundtrip(codec, x, counts).shape == x.shape


@pytest.mark.parametrize("name", ("none", "truncate", "learned", "random", "quant", "sample"))
def test_ratio_one_is_exact(name):
    codec = _build(name, 1, 16)
    assert codec is IDENTITY
    x = torch.randn(9, 16)
    assert torch.equal(_roundtrip(codec, x, [4, 5]), x)


def test_truncate_sends_first_k_and_zero_pads():
    x = torch.randn(6, 10)
    y = _roundtrip(TruncateCodec(3), x, [2, 4])
    assert torch.equal(y[:, :3], x[:, :3]) and not y[:, 3:].any()


def test_k_is_guarded_to_at_least_one():
    assert channels_for(16, 128) == 1 and channels_for(3, 4.0) == 1
    assert channels_for(16, 1) == 16 and channels_for(16, 5) == 3
    with pytest.raises(ValueError, match="k must be >= 1"):
        TruncateCodec(0)
    with pytest.raises(ValueError, match="exceed the row width"):
        TruncateCodec(8).byte_counts([3], 4)


def test_random_channels_shared_by_key_and_differ_across_keys():
    x = torch.randn(8, 32)
    codec = RandomChannelCodec(4)
    y = _roundtrip(codec, x, [4, 4], keys=[1, 2])
    kept = [set(torch.nonzero(y[i]).flatten().tolist()) for i in (0, 4)]
    assert all(len(k) == 4 for k in kept) and kept[0] != kept[1]
    cols = sorted(kept[0])
    assert torch.equal(y[:4, cols], x[:4, cols])


def test_quant_codes_stay_within_one_step():
    x = torch.randn(50, 33) * 3 + 1
    for bits in (1, 2, 4, 8):
        y = _roundtrip(QuantCodec(bits), x, [20, 30])
        span = (x.amax(1) - x.amin(1)) / (2 ** bits - 1)
        assert ((y - x).abs() <= span[:, None] * 1.02 + 1e-6).all(), bits


def test_quant_is_unbiased_and_error_shrinks_with_samples():
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    codec = QuantCodec(1)

    def mean_error(n):
        est = sum(_roundtrip(codec, x, [4], keys=[1000 + i]) for i in range(n)) / n
        return (est - x).abs().mean().item()

    small, large = mean_error(16), mean_error(1024)
    assert large < small / 4  # ~1/sqrt(n): 8x fewer with 64x the samples
    assert large < 0.1  # one step is ~5 here: a biased rounding would sit near 1


def test_quant_bf16_range_rounds_outward():
    x = torch.tensor([0.3, -0.3, 1e-9, -7e8, 123.456])
    down, up = _bf16_value(_bf16_outward(x, True)), _bf16_value(_bf16_outward(x, False))
    assert (down <= x).all() and (up >= x).all()
    assert ((up - down) <= x.abs() * 2 ** -7).all()


@pytest.mark.parametrize("scale", (1e-9, 1e6))
def test_quant_handles_tiny_gradients_and_large_values(scale):
    x = torch.randn(10, 16) * scale
    y = _roundtrip(QuantCodec(8), x, [10])
    assert torch.isfinite(y).all()
    assert (y - x).abs().max() <= (x.amax(1) - x.amin(1)).max() / 255 * 1.05


def test_quant_constant_rows():
    x = torch.full((3, 5), 0.3)
    assert torch.allclose(_roundtrip(QuantCodec(2), x, [3]), x, atol=1e-3)
    assert torch.equal(_roundtrip(QuantCodec(2), torch.zeros(3, 5), [3]), torch.zeros(3, 5))


def test_sample_keeps_rows_scaled_and_is_unbiased():
    x = torch.randn(10, 4)
    y = _roundtrip(SampleCodec(0.3), x, [10], keys=[5])
    kept = y.abs().sum(1) > 0
    assert kept.sum() == kept_rows(10, 0.3) == 3
    assert torch.allclose(y[kept], x[kept] * 10 / 3)
    est = sum(_roundtrip(SampleCodec(0.3), x, [10], keys=[k]) for k in range(3000)) / 3000
    assert (est - x).abs().max() < 0.25


def test_composite_truncate_quant():
    x = torch.randn(12, 64)
    codec = TruncateCodec(16, QuantCodec(4))
    assert codec.byte_counts([12], 64) == [12 * (4 + 8)]
    y = _roundtrip(codec, x, [12])
    assert not y[:, 16:].any() and (y[:, :16] - x[:, :16]).abs().max() < 1.0


def test_learned_wire_is_truncate_and_pair_starts_as_identity():
    x = torch.randn(5, 8)
    assert torch.equal(_roundtrip(LearnedCodec(2), x, [5]), _roundtrip(TruncateCodec(2), x, [5]))
    enc, dec = learned_pair(8)
    assert torch.allclose(dec(enc(x)), x)


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
