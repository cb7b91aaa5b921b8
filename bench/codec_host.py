"""The host side of a fused codec call: the Python around the Triton launches, timed with the
launches replaced by no-ops, on CPU tensors (no GPU needed).

On a GPU a codec call at the exchanged sizes costs its host side more than its kernels (the H100
run of 2026-11-26: 55-100 µs a call at every size), so this is the part that a change to the call
path can move without a GPU to measure on. Triton's own launcher is not in it (a no-op replaces
it): on a GPU add that.

    python bench/codec_host.py [--rows 20000 --width 256 --peers 4 --repeat 3000]

Prints the best of 5 means of ``--repeat`` calls, in µs, for encode and decode of each codec.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")        # import Triton without a GPU driver

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hpcgnn
from hpcgnn.codecs import fused  # noqa: E402
from hpcgnn.codecs.base import WireCodec  # noqa: E402
from hpcgnn.codecs.rng import Blocks  # noqa: E402
from gpu_meter import streamed_time  # noqa: E402

CODECS = {"quant(2)": WireCodec(bits=2), "quant(8)": WireCodec(bits=8),
          "sample(0.5)+quant(2)": WireCodec(keep=0.5, bits=2),
          "random(k=128)+quant(4)": WireCodec(channels="random", k=128, bits=4)}


class _NoLaunch:
    """Stands for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3000)
    args = ap.parse_args(argv)
    kernels = fused._kernels()
    for name in ("_encode_kernel", "_decode_kernel", "_select_kernel"):
        setattr(kernels, name, _NoLaunch())
    torch.set_num_threads(1)
    x = torch.randn(args.rows, args.width)
    blocks = Blocks.of([args.rows // args.peers] * args.peers)
    keys = torch.arange(args.peers, dtype=torch.int64) + 7
    print(f"host side of a fused codec call (launches are no-ops), {args.rows} x {args.width}, "
          f"{args.peers} blocks, best of 5 means of {args.repeat} calls")
    for name, codec in CODECS.items():
        wire = fused.encode(codec, x, blocks, keys, 3)
        for _ in range(200):                                   # warm: caches, allocator
            fused.decode(codec, fused.encode(codec, x, blocks, keys, 3), blocks, args.width, keys)
        enc = 1e6 * streamed_time(lambda: fused.encode(codec, x, blocks, keys, 3), "cpu", args.repeat)
        dec = 1e6 * streamed_time(lambda: fused.decode(codec, wire, blocks, args.width, keys), "cpu", args.repeat)
        print(f"{name:24s} encode {enc:6.1f} µs   decode {dec:6.1f} µs")


if __name__ == "__main__":
    main()
