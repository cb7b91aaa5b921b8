"""The fused Triton kernels (``hpcgnn.kernels``) bit for bit against independent numpy
references: the documented hashes, row/channel draws and quantiser of ``tests/test_codecs.py``,
laid out as the wire format says, and the counter-based dropout's documented hash.

Without a GPU they run under Triton's interpreter on CPU tensors (``conftest`` sets
``TRITON_INTERPRET=1``), so CI runs them; with CUDA they run compiled (``-m gpu``).
``tests/test_kernels_compile.py`` compiles them for an H100 without one."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from hpcgnn.codecs import IDENTITY, WireCodec, backward_codec, fused  # noqa: E402
from hpcgnn.codecs.rng import Blocks  # noqa: E402
from test_codecs import (_keys, channel_half, np_hash32, ref_channels,  # noqa: E402
                         ref_kept_rows, ref_quant, ref_quant_parts, row_half)
from test_exchange_exact import mix  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the interpreter's numpy
CASES = [(1, (5,)), (7, (3, 0, 11)), (8, (0, 0)), (37, (1, 2, 0, 4)), (16, (6, 0, 9, 4))]  # width, counts
FORWARD = [WireCodec(bits=1), WireCodec(bits=2), WireCodec(bits=4), WireCodec(bits=8),
           WireCodec(keep=0.4), WireCodec(keep=0.3, bits=2), WireCodec(channels="random", k=3),
           WireCodec(channels="random", k=5, bits=1), WireCodec(channels="truncate", k=5, bits=4),
           WireCodec(keep=0.5, channels="random", k=5, bits=8),
           WireCodec(keep=0.4, bits=2, scaled=False)]                  # GAT's: rows unscaled
CODECS = FORWARD + [backward_codec(FORWARD[4], WireCodec(bits=2)), backward_codec(FORWARD[6], IDENTITY),
                    backward_codec(FORWARD[8], WireCodec(bits=1)),
                    backward_codec(FORWARD[9], WireCodec(bits=8)),
                    backward_codec(FORWARD[10], IDENTITY)]


@pytest.fixture(params=[
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="Triton's interpreter is set where there is no GPU")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs CUDA")])])
def dev(request):
    return request.param


# -- the wire, in numpy ------------------------------------------------------------------------

def ref_pack(q: np.ndarray, bits: int) -> np.ndarray:
    """(R, w) codes -> (R, ceil(w * bits / 8)) bytes; code c at bit (c % (8 / bits)) * bits."""
    per = 8 // bits
    out = np.zeros((q.shape[0], -(-q.shape[1] * bits // 8)), dtype=np.uint8)
    for c in range(q.shape[1]):
        out[:, c // per] |= (q[:, c].astype(np.uint8) << np.uint8(c % per * bits))
    return out


def ref_wire(y: np.ndarray, bits: int, key: int) -> np.ndarray:
    """The rows on the wire: fp32 as they are, or lo (fp32) | step (bf16) | packed codes."""
    y = y.astype(np.float32)
    if bits == 32 or y.shape[0] == 0:
        return y.astype("<f4").view(np.uint8).reshape(-1)
    lo, step, q = ref_quant_parts(y, bits, key)
    header = np.concatenate([lo.astype("<f4").view(np.uint8).reshape(-1, 4),
                             (step.view(np.uint32) >> 16).astype("<u2").view(np.uint8).reshape(-1, 2)], 1)
    return np.concatenate([header, ref_pack(q, bits)], 1).reshape(-1)


def ref_codec(codec: WireCodec, x: np.ndarray, counts, keys, noise: int):
    """(wire bytes, decoded (R, F)) of ``codec`` by its documented stages."""
    width, rows, chans, scales, start = x.shape[1], [], [], [], 0
    k = codec.width_sent(width)
    for p, c in enumerate(counts):
        kept = ref_kept_rows(row_half(keys[p]), c, codec.keep) if codec.keep < 1 else list(range(c))
        ch = ref_channels(channel_half(keys[p]), width, k) if codec.channels == "random" else list(range(k))
        scale = np.float32(c) / np.float32(max(len(kept), 1))
        rows += [start + r for r in kept]
        chans += [ch] * len(kept)
        scales += [scale] * len(kept)
        start += c
    idx, chans, scales = np.array(rows, dtype=np.int64), np.array(chans, dtype=np.int64).reshape(-1, k), \
        np.array(scales, dtype=np.float32)
    sent = x[idx[:, None], chans].astype(np.float32)
    if codec.adjoint and codec.keep < 1 and codec.scaled:
        sent = sent * scales[:, None]
    got = sent if codec.bits == 32 or not len(idx) else ref_quant(sent, codec.bits, noise)
    if not codec.adjoint and codec.keep < 1 and codec.scaled:
        got = got * scales[:, None]
    out = np.zeros_like(x, dtype=np.float32)
    out[idx[:, None], chans] = got
    return ref_wire(sent, codec.bits, noise), out


def _input(rows: int, width: int, dev: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * 3 + 1
    x[1::5] = 0.25                                   # constant rows (step 0)
    x[2::7] = 0.0                                    # zero rows
    x[3::11] *= 1e-40                                # rows of a subnormal range (step 2^-126)
    return x.to(dev)


# -- the codec kernels ---------------------------------------------------------------------------

@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_codec_kernels_equal_the_numpy_reference(codec, dev):
    for n, (width, counts) in enumerate(CASES):
        if codec.channels != "all" and codec.k > width:
            continue
        x = _input(sum(counts), width, dev, seed=n + width)
        keys = _keys(len(counts), base=n + 3, device=dev)
        blocks = Blocks.of(counts, dev)
        want_wire, want = ref_codec(codec, x.cpu().numpy(), counts, keys.tolist(), 99 + n)
        wire = fused.encode(codec, x, blocks, keys, 99 + n)
        assert wire.device == x.device and wire.dtype == torch.uint8
        assert wire.numel() == sum(codec.byte_counts(counts, width))
        assert np.array_equal(wire.cpu().numpy(), want_wire), (width, counts)
        got = fused.decode(codec, wire, blocks, width, keys)
        assert got.shape == x.shape and got.device == x.device
        assert np.array_equal(got.cpu().numpy(), want), (width, counts)


def test_one_blocks_many_epochs_and_codecs(dev):
    """As training calls them: one ``Blocks`` per plan and direction, new block keys every epoch,
    several codecs and widths on it. The layout kept per (blocks, codec, width) must not keep the
    keys of an earlier call, and goes when its blocks go."""
    import gc
    counts = (9, 0, 14, 5)
    blocks = Blocks.of(counts, dev)
    codecs = [WireCodec(bits=2), WireCodec(keep=0.5, bits=4), WireCodec(channels="random", k=5, bits=8),
              WireCodec(keep=0.4, channels="random", k=3)]
    for epoch in range(2):
        for codec in codecs:
            for width in ((11, 6) if epoch else (11,)):
                x = _input(sum(counts), width, dev, seed=epoch * 7 + width)
                keys = _keys(len(counts), base=100 * epoch + width, device=dev)
                want_wire, want = ref_codec(codec, x.cpu().numpy(), counts, keys.tolist(), epoch)
                wire = fused.encode(codec, x, blocks, keys, epoch)
                assert np.array_equal(wire.cpu().numpy(), want_wire), (epoch, codec, width)
                assert np.array_equal(fused.decode(codec, wire, blocks, width, keys).cpu().numpy(), want)
    assert fused.layout(codecs[0], blocks, 11) is fused.layout(codecs[0], blocks, 11)
    assert len(fused._layouts[id(blocks)]) == len(codecs) * 2
    gone = id(blocks)
    del blocks
    gc.collect()
    assert gone not in fused._layouts


@pytest.mark.parametrize("codec", [WireCodec(bits=2), WireCodec(keep=0.4, channels="random", k=9, bits=1),
                                   backward_codec(WireCodec(keep=0.3, channels="truncate", k=20),
                                                  WireCodec(bits=4))], ids=repr)
def test_wide_rows_and_long_blocks_run_in_chunks(codec, dev, monkeypatch):
    """Rows wider than a tile and blocks longer than a select step loop over chunks."""
    from hpcgnn.kernels import codec as kc
    monkeypatch.setattr(kc, "MAX_CW", 8)
    monkeypatch.setattr(kc, "TILE", 16)
    monkeypatch.setattr(kc, "SELECT_CHUNK", 4)
    counts, width = (13, 0, 9), 37
    x, keys = _input(22, width, dev, seed=5), _keys(3, base=2, device=dev)
    want_wire, want = ref_codec(codec, x.cpu().numpy(), counts, keys.tolist(), 4)
    wire = fused.encode(codec, x, Blocks.of(counts, dev), keys, 4)
    assert np.array_equal(wire.cpu().numpy(), want_wire)
    assert np.array_equal(fused.decode(codec, wire, Blocks.of(counts, dev), width, keys).cpu().numpy(), want)


@pytest.mark.parametrize("bits", (1, 2, 4, 8))
def test_value_stage_alone_equals_the_reference(bits, dev):
    """``quant.encode_values``/``decode_values``'s kernel path (one block, nothing selected)."""
    x = _input(23, 13, dev, seed=bits)
    table = fused.encode_values(x, bits, 7)
    assert np.array_equal(table.cpu().numpy(), ref_wire(x.cpu().numpy(), bits, 7))
    rb = table.numel() // 23
    got = fused.decode_values(table.view(23, rb), 13, bits)
    assert np.array_equal(got.cpu().numpy(), ref_quant(x.cpu().numpy(), bits, 7))


@pytest.mark.parametrize("codec", [WireCodec(bits=1), WireCodec(keep=0.5, channels="random", k=4, bits=2)],
                         ids=repr)
def test_a_cpu_rank_and_a_kernel_rank_talk(codec, dev):
    """Bytes from the kernels decode on the CPU path (C kernels) and the other way round."""
    counts, width = (7, 0, 12), 19
    x, keys = _input(19, width, dev, seed=1), _keys(3, base=9, device=dev)
    blocks, cpu_blocks = Blocks.of(counts, dev), Blocks.of(counts)
    from_kernels = fused.encode(codec, x, blocks, keys, 5)
    from_cpu = codec.encode(x.cpu(), cpu_blocks, keys.cpu(), 5)
    assert torch.equal(from_kernels.cpu(), from_cpu)
    assert torch.equal(codec.decode(from_kernels.cpu(), cpu_blocks, width, keys.cpu()),
                       fused.decode(codec, from_cpu.to(dev), blocks, width, keys).cpu())


def test_wire_codec_sends_cuda_tensors_to_the_kernels(dev, monkeypatch):
    """``WireCodec.encode``/``decode`` dispatch: the kernels when ``use_triton`` says so (CUDA
    with Triton; here forced for CPU tensors under the interpreter), never for fp32 identity."""
    from hpcgnn.codecs import base
    calls = []
    for name in ("encode", "decode"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))
    monkeypatch.setattr(base, "use_triton", lambda t: True)
    codec, counts = WireCodec(channels="random", k=2, bits=4), (4, 3)
    x, keys = _input(7, 6, dev, seed=2), _keys(2, device=dev)
    want_wire, want = ref_codec(codec, x.cpu().numpy(), counts, keys.tolist(), 3)
    wire = codec.encode(x, Blocks.of(counts, dev), keys, 3)
    assert np.array_equal(codec.decode(wire, Blocks.of(counts, dev), 6, keys).cpu().numpy(), want)
    assert np.array_equal(wire.cpu().numpy(), want_wire) and calls == ["encode", "decode"]
    IDENTITY.encode(x, Blocks.of(counts, dev), keys)
    assert calls == ["encode", "decode"]


# -- the dropout kernel ----------------------------------------------------------------------------

def ref_keep(row_hash: np.ndarray, width: int, p: float) -> np.ndarray:
    golden = np_hash32((np.arange(width, dtype=np.uint64) * np.uint64(0x9E3779B1)) & np.uint64(0xFFFFFFFF))
    return np_hash32(row_hash[:, None] ^ golden[None, :]) >= np.uint64(int(p * 2**32))


def ref_node_keep(gid: np.ndarray, width: int, p: float, key: int) -> np.ndarray:
    """keep bits of ``nn.dropout.keep_mask``: row = hash32(hash32(gid) ^ key)."""
    return ref_keep(np_hash32(np_hash32(gid.astype(np.uint64)) ^ np.uint64(key)), width, p)


def ref_edge_keep(dst: np.ndarray, src: np.ndarray, heads: int, p: float, key: int) -> np.ndarray:
    """keep bits of ``nn.dropout.edge_keep_mask``: hash32(hash32(hash32(dst) ^ key) ^ src)."""
    row = np_hash32(np_hash32(np_hash32(dst.astype(np.uint64)) ^ np.uint64(key))
                    ^ (src.astype(np.uint64) & np.uint64(0xFFFFFFFF)))
    return ref_keep(row, heads, p)


def _ids(n: int, seed: int) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, 2**40, size=n, dtype=np.int64)  # > 2^32 too
    return ids


@pytest.mark.parametrize("width", (1, 7, 37, 130))
@pytest.mark.parametrize("p", (0.1, 0.5, 0.9))
def test_dropout_kernel_equals_the_numpy_hash(width, p, dev):
    from hpcgnn.kernels import dropout as kd
    for n in (0, 1, 50):
        gid = _ids(n, seed=width + n)
        key = (width * 2654435761 + n) & 0xFFFFFFFF
        keep = ref_node_keep(gid, width, p, key)
        x = _input(n, width, dev, seed=n).requires_grad_()
        assert np.array_equal(kd.keep_mask(torch.tensor(gid, device=dev), width, p, key).cpu().numpy(), keep)
        out = kd.dropout(x, torch.tensor(gid, device=dev), p, key)
        scale = np.where(keep, np.float32(1 / (1 - p)), np.float32(0))
        assert np.array_equal(out.detach().cpu().numpy(), x.detach().cpu().numpy() * scale)
        g = _input(n, width, dev, seed=n + 1)
        out.backward(g)
        assert np.array_equal(x.grad.cpu().numpy(), g.cpu().numpy() * scale)


@pytest.mark.parametrize("heads", (1, 3, 8))
def test_edge_dropout_kernel_equals_the_numpy_hash(heads, dev):
    from hpcgnn.kernels import dropout as kd
    dst, src, key, p = _ids(40, 1), _ids(40, 2), 0xC0FFEE, 0.6
    keep = ref_edge_keep(dst, src, heads, p, key)
    ids = dict(gid=torch.tensor(dst, device=dev), src=torch.tensor(src, device=dev))
    assert np.array_equal(kd.keep_mask(width=heads, p=p, key=key, **ids).cpu().numpy(), keep)
    alpha = torch.rand(40, heads, device=dev)
    out = kd.dropout(alpha, p=p, key=key, **ids)
    scale = np.where(keep, np.float32(1 / (1 - p)), np.float32(0))
    assert np.array_equal(out.cpu().numpy(), alpha.cpu().numpy() * scale)


def test_row_offsets_are_computed_in_int64():
    """A launch over 2^31 rows or more (GAT's attention dropout runs over a rank's edges, whose
    count may pass 2^31: ``nn/gat.py`` switches its indices to int64 there) must not wrap the
    row index: ``tl.program_id`` is int32, so ``program_id * BR`` is taken to int64 first
    (before, the rows past 2^31 went negative and passed ``rows < n_rows``). Checked in the
    source: a test launch of 2^31 rows needs more memory than CI has."""
    import inspect
    import re
    from hpcgnn.kernels import codec, dropout
    found = 0
    for module in (codec, dropout):
        for line in inspect.getsource(module).splitlines():
            if re.search(r"tl\.program_id\(\d\)[^#]*\*", line):
                found += 1
                assert "tl.program_id(0).to(tl.int64) *" in line, f"{module.__name__}: {line.strip()}"
    assert found == 3       # the encode, decode and dropout kernels' rows


def test_a_row_sample_past_2_31_rows_is_refused_before_any_launch():
    """The sample's draws are int32 (``Selected.index`` and ``slot``): a buffer of 2^31 rows
    would wrap them, so ``select`` refuses it, naming the limit and the way round, before it
    allocates or launches anything (the layout's tensors here are tiny)."""
    from hpcgnn.kernels import codec as kc
    one = torch.zeros(1, dtype=torch.int64)
    lay = kc.Layout(counts=one, starts=one, block_of_row=one, kept=one, kept_start=one,
                    scale=torch.ones(1), rows=2**31, n_out=1, width=4, k=4, bits=32,
                    random=False, adjoint=False, salt_rows=0, salt_channels=0, longest=1)
    with pytest.raises(ValueError, match=r"2147483648 rows \(past 2\^31 - 1\).*HPCGNN_TRITON=0"):
        kc.select(lay, one)


def test_nn_dropout_sends_cuda_tensors_to_the_kernel(dev, monkeypatch):
    """``nn.dropout``'s entry points on the kernel (forced for CPU tensors under the
    interpreter) give the documented bits: keys from (seed, epoch, layer), the sparse path too."""
    from hpcgnn.nn import dropout as nd
    monkeypatch.setattr(nd, "use_triton", lambda t: True)
    gid, width, p, seed, epoch, layer = _ids(30, 3), 11, 0.3, 5, 6, 7
    keep = ref_node_keep(gid, width, p, mix(seed, epoch, layer, 0xD209) & 0xFFFFFFFF)
    scale = np.where(keep, np.float32(1 / 0.7), np.float32(0))
    ids = torch.tensor(gid, device=dev)
    assert np.array_equal(nd.keep_mask(ids, width, p, seed, epoch, layer).cpu().numpy(), keep)
    x = _input(30, width, dev, seed=4)
    x[x.abs() < 1] = 0                                         # sparse, and its non-zeros given
    for nz in (None, x.nonzero(as_tuple=True)):
        out = nd.counter_dropout(x, ids, p, seed, epoch, layer, True, nz)
        assert np.array_equal(out.cpu().numpy(), x.cpu().numpy() * scale)
    dst, src = torch.tensor(_ids(20, 4), device=dev), torch.tensor(_ids(20, 5), device=dev)
    ekeep = ref_edge_keep(dst.cpu().numpy(), src.cpu().numpy(), 4, 0.6,
                          mix(seed, epoch, layer, 0xA77E) & 0xFFFFFFFF)
    assert np.array_equal(nd.edge_keep_mask(dst, src, 4, 0.6, seed, epoch, layer).cpu().numpy(), ekeep)
    alpha = torch.rand(20, 4, device=dev)
    out = nd.edge_dropout(alpha, dst, src, 0.6, seed, epoch, layer, True)
    assert np.array_equal(out.cpu().numpy(), alpha.cpu().numpy() * np.where(ekeep, np.float32(2.5), 0))


def test_a_kernel_that_fails_names_the_way_back(dev, monkeypatch):
    """A Triton error (e.g. a Triton that cannot compile a kernel) names the version and
    HPCGNN_TRITON=0."""
    import triton
    import triton.language as tl
    from hpcgnn.kernels import codec as kc

    @triton.jit
    def broken(x_ptr, out_ptr, index_ptr, block_ptr, chan_ptr, scale_ptr, n_rows, width, k, row_bytes,
               key, BITS: tl.constexpr, SAMPLE: tl.constexpr, RANDOM: tl.constexpr,
               SCALE: tl.constexpr, BR: tl.constexpr, CW: tl.constexpr):
        tl.static_assert(BITS == 0, "no such instruction here")
    monkeypatch.setattr(kc, "_encode_kernel", broken)
    with pytest.raises(RuntimeError, match=r"(?s)triton \S+ \(tested with 3.9.0\).*HPCGNN_TRITON=0"):
        fused.encode_values(_input(4, 5, dev, seed=0), 2, 1)
