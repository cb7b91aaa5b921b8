"""Compile every launch of ``hpcgnn.kernels`` for a GPU that is not here.

    python tests/_compile_kernels.py [ARCH]      # ARCH: CUDA compute capability, default 90 (H100)

Triton is made to capture each launch instead of running it (``JITFunction.run`` replaced):
the launch's real arguments give the signature, which is compiled to PTX and a cubin with
Triton's bundled ptxas for ``sm_ARCH``. The launchers are driven with CPU tensors through every
codec shape and the dropout. Prints one JSON line per call (``{"call": ..., "launches": n}``)
and one per compiled variant (kernel, constexprs, counts of ``fma.rn.f32`` and ``div.rn.f32``
and of approximate divisions in its PTX). Must run without ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import json
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction, mangle_type

_launches: list[str] = []
_seen: set = set()


def _compile(fn: JITFunction, args, kwargs, target: GPUTarget) -> None:
    bound = dict(zip(fn.arg_names, args)) | {k: v for k, v in kwargs.items() if k in fn.arg_names}
    options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    sig, const = {}, {}
    for p in fn.params:
        value = bound[p.name]
        if p.is_constexpr or _is_one(value):     # the launcher makes an integer 1 a constexpr
            sig[p.name], const[p.name] = "constexpr", value
        else:
            sig[p.name] = mangle_type(value)
    # what Triton's launcher specialises on a GPU: integers that are multiples of 16 and tensors
    # whose address is, marked divisible by 16 (it changes the layouts and the vector widths)
    aligned = tuple(i for i, p in enumerate(fn.params) if sig[p.name] != "constexpr" and _aligned(bound[p.name]))
    key = (fn.__name__, tuple(sorted(const.items())), tuple(sig.items()), tuple(sorted(options.items())),
           aligned)
    _launches.append(fn.__name__)
    if key in _seen:
        return
    _seen.add(key)
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    ptx = triton.compile(src, target=target, options=options).asm["ptx"]
    print(json.dumps({"kernel": fn.__name__, "constexprs": const, "options": options,
                      "aligned": [fn.params[i].name for i in aligned],
                      "fma": ptx.count("fma.rn.f32"), "div_rn": ptx.count("div.rn.f32"),
                      "div_approx": ptx.count("div.full.f32") + ptx.count("div.approx.f32"),
                      "wide_shifts": _wide_shifts(ptx)}), flush=True)


def _is_one(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == 1


def _aligned(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


_CONST = r"(-?(?:0[xX][0-9a-fA-F]+|\d+))"


def _wide_shifts(ptx: str) -> list[str]:
    """32-bit shifts whose amount is, or may be, a constant of 32 or more: a constant amount, or a
    register set from such a constant (``mov``/``selp``). In LLVM such a shift is poison, which
    the optimiser may fold into anything (Triton 3.6 made a 2-bit wire's step 0 from one)."""
    wide = set()
    for reg, consts in re.findall(r"(?:mov|selp)\.b32\s+(%r\d+),\s*([^;]*);", ptx):
        operands = [o.strip() for o in consts.split(",")]
        if any(re.fullmatch(_CONST, o) and int(o, 0) >= 32 for o in operands):
            wide.add(reg)
    found = []
    for line in re.findall(r"\b(?:shl|shr)\.[bsu]32\s+[^;]*;", ptx):
        amount = line.rstrip(";").split(",")[-1].strip()
        if amount in wide or (re.fullmatch(_CONST, amount) and int(amount, 0) >= 32):
            found.append(line)
    return found


def _call(name: str, f) -> None:
    start = len(_launches)
    f()
    print(json.dumps({"call": name, "launches": len(_launches) - start}), flush=True)


def _drive() -> None:
    from hpcgnn.codecs import IDENTITY, WireCodec, backward_codec, fused
    from hpcgnn.codecs.rng import Blocks
    from hpcgnn.kernels import dropout as kd
    counts, width = (5, 0, 7), 24
    blocks, keys = Blocks.of(counts), torch.tensor([3, 2**31 + 5, 7], dtype=torch.int64)
    x = torch.randn(sum(counts), width)
    forward = [WireCodec(bits=b) for b in (1, 2, 4, 8)] + [
        WireCodec(keep=0.5), WireCodec(channels="random", k=5), WireCodec(channels="truncate", k=5, bits=4),
        WireCodec(keep=0.5, channels="random", k=5, bits=2)]
    codecs = forward + [backward_codec(c, b) for c in forward if c.selects
                        for b in (IDENTITY, WireCodec(bits=1))]
    for codec in codecs:
        wire = torch.zeros(sum(codec.byte_counts(counts, width)), dtype=torch.uint8)
        _call(f"encode {codec}", lambda: fused.encode(codec, x, blocks, keys, 2**32 - 1))
        _call(f"decode {codec}", lambda: fused.decode(codec, wire, blocks, width, keys))
    # rows of 16 bytes (2-bit codes of 37 channels: 6 + 10): row_bytes specialised as aligned
    narrow, codec = Blocks.of((1, 2, 0, 4)), WireCodec(bits=2)
    x37 = torch.randn(7, 37)
    wire = torch.zeros(sum(codec.byte_counts(narrow.counts, 37)), dtype=torch.uint8)
    _call(f"encode {codec}, 16-byte rows", lambda: fused.encode(codec, x37, narrow, keys[:1].repeat(4), 5))
    _call(f"decode {codec}, 16-byte rows", lambda: fused.decode(codec, wire, narrow, 37, keys[:1].repeat(4)))
    # arguments of 1 (a key, one row, one channel) arrive as constexprs on a GPU
    one, codec = Blocks.of((1,)), WireCodec(keep=0.5, channels="random", k=1, bits=2)
    x1, ones = torch.randn(1, 1), torch.ones(1, dtype=torch.int64)
    wire = torch.zeros(sum(codec.byte_counts(one.counts, 1)), dtype=torch.uint8)
    _call(f"encode {codec}, key 1, 1 x 1", lambda: fused.encode(codec, x1, one, ones, 1))
    _call(f"decode {codec}, key 1, 1 x 1", lambda: fused.decode(codec, wire, one, 1, ones))
    big, wide = Blocks.of((3000, 0, 700)), 300          # wide select steps (8 warps), wide tiles
    xb, codec = torch.randn(3700, wide), WireCodec(keep=0.5, channels="random", k=40, bits=4)
    wire = torch.zeros(sum(codec.byte_counts(big.counts, wide)), dtype=torch.uint8)
    _call(f"encode {codec}, 3700 x {wide}", lambda: fused.encode(codec, xb, big, keys, 1))
    _call(f"decode {codec}, 3700 x {wide}", lambda: fused.decode(codec, wire, big, wide, keys))
    gid = torch.arange(sum(counts), dtype=torch.int64)
    xg = x.clone().requires_grad_()
    _call("forward dropout, key 1", lambda: kd.dropout(x, gid, 0.5, 1))
    _call("dropout forward+backward", lambda: kd.dropout(xg, gid, 0.5, 2**32 - 3).sum().backward())
    _call("keep_mask", lambda: kd.keep_mask(gid, width, 0.5, 9))
    _call("edge dropout", lambda: kd.dropout(x, gid, 0.6, 9, src=gid.flip(0)))
    _call("edge keep_mask", lambda: kd.keep_mask(gid, 4, 0.6, 9, src=gid.flip(0)))


def main(arch: int = 90) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this compiles the kernels")
    target = GPUTarget("cuda", arch, 32)

    def run(self, *args, grid, warmup, **kwargs):
        _compile(self, args, kwargs, target)
    JITFunction.run = run
    _drive()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
