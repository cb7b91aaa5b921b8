"""Where a fused codec call's wall-clock goes on a GPU: its cost layer by layer, each timed back
to back (``streamed_time``: calls issued with one synchronisation at the end, so a layer's host
side is what is timed wherever the GPU keeps up).

On the H200 (2026-11-27) a quant encode or decode of 20000 x 256 took 0.011 ms of GPU time but
35-80 µs a call wall-clock; on CPU tensors the Python around the launches is 6-14 µs
(``bench/codec_host.py``). This splits the rest:

1. ``torch.empty`` of the output on the device;
2. a Triton kernel that does nothing, through ``kernel[grid](...)``, with 2 and with 17 arguments
   (the encode kernel's count): Triton's launcher alone;
3. the same kernels through the compiled handle ``kernel.warmup(...)`` returns, which skips
   the per-call binding and specialisation (what a direct-launch path would save);
4. ``kernels.codec.encode`` / ``decode`` (allocation + launch + their Python);
5. ``codecs.fused.encode`` / ``decode`` (+ the layout lookup and the select launch, if any);
6. ``WireCodec.encode`` / ``decode``: what the exchange calls.

    python bench/launch_cost.py [--rows 20000 --width 256 --peers 4 --calls 500] [--out FILE]
    TRITON_INTERPRET=1 python bench/launch_cost.py --dry-run-on-cpu   # the script's check, no GPU

Needs CUDA and Triton; prints a table in µs a call (and writes it to ``--out`` with ``.md``).
A layer that fails (an API another Triton lacks) prints its error and the rest go on.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hpcgnn
from gpu_meter import device_name, streamed_time  # noqa: E402


def _noop_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def noop2(x_ptr, n, BLOCK: tl.constexpr):
        if tl.program_id(0) < 0:                      # never: keeps the arguments live
            tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros((BLOCK,), tl.float32), mask=tl.arange(0, BLOCK) < n)

    @triton.jit
    def noop17(a, b, c, d, e, f, n1, n2, n3, n4, n5,
               B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr, B4: tl.constexpr,
               BR: tl.constexpr, CW: tl.constexpr):
        if tl.program_id(0) < 0:
            tl.store(a + tl.arange(0, BR), tl.zeros((BR,), tl.float32) + n1 + n2 + n3 + n4 + n5,
                     mask=tl.arange(0, BR) < n1)
    return noop2, noop17


def measure(rows: int, width: int, peers: int, calls: int, device: str = "cuda") -> list[tuple[str, str]]:
    from hpcgnn.codecs import fused
    from hpcgnn.codecs.base import WireCodec
    from hpcgnn.codecs.rng import Blocks

    dev = torch.device(device)
    x = torch.randn(rows, width, device=dev)
    out: list[tuple[str, str]] = []

    def time_it(name: str, fn) -> None:
        try:
            fn()
            us = 1e6 * streamed_time(fn, dev, calls=calls, rounds=5)
            out.append((name, f"{us:.1f}"))
        except Exception as exc:                      # noqa: BLE001  (report and go on)
            out.append((name, f"failed: {type(exc).__name__}: {str(exc)[:120]}"))
        print(f"{out[-1][0]:58s} {out[-1][1]}", flush=True)

    time_it("torch.empty(rows x width fp32)", lambda: torch.empty(rows * width, device=dev))
    time_it("torch.empty(wire bytes, uint8)", lambda: torch.empty(rows * (6 + width // 4), dtype=torch.uint8, device=dev))
    noop2, noop17 = _noop_kernels()
    n = torch.empty(1, dtype=torch.int64, device=dev)
    time_it("Triton no-op, 2 args, kernel[grid](...)", lambda: noop2[(1,)](x, 5, BLOCK=16))
    args17 = (x, x, x, n, n, n, 5, 7, 9, 11, 13)
    consts = dict(B1=2, B2=0, B3=0, B4=0, BR=16, CW=64)
    time_it("Triton no-op, 17 args, kernel[grid](...)", lambda: noop17[(1,)](*args17, **consts))
    try:
        c2 = noop2.warmup(x, 5, BLOCK=16, grid=(1,))
        c17 = noop17.warmup(*args17, **consts, grid=(1,))
        time_it("Triton no-op, 2 args, compiled handle", lambda: c2[(1, 1, 1)](x, 5, 16))
        time_it("Triton no-op, 17 args, compiled handle",
                lambda: c17[(1, 1, 1)](*args17, *consts.values()))
    except Exception as exc:                          # noqa: BLE001
        out.append(("compiled handle", f"failed: {type(exc).__name__}: {str(exc)[:120]}"))
        print(out[-1])

    blocks = Blocks.of([rows // peers] * (peers - 1) + [rows - (rows // peers) * (peers - 1)], device=dev)
    keys = torch.arange(peers, dtype=torch.int64, device=dev) + 7
    k = fused._kernels()
    for codec_name, codec in {"quant(2)": WireCodec(bits=2),
                              "sample(0.5)+quant(2)": WireCodec(keep=0.5, bits=2)}.items():
        lay = fused.layout(codec, blocks, width)
        sel = k.select(lay, keys)
        wire = k.encode(x, lay, sel, 3)
        time_it(f"{codec_name}: kernels.codec.select", lambda: k.select(lay, keys))
        time_it(f"{codec_name}: kernels.codec.encode", lambda: k.encode(x, lay, sel, 3))
        time_it(f"{codec_name}: kernels.codec.decode", lambda: k.decode(wire, lay, sel))
        time_it(f"{codec_name}: fused.encode", lambda: fused.encode(codec, x, blocks, keys, 3))
        time_it(f"{codec_name}: fused.decode", lambda: fused.decode(codec, wire, blocks, width, keys))
        time_it(f"{codec_name}: WireCodec.encode", lambda: codec.encode(x, blocks, keys, 3))
        time_it(f"{codec_name}: WireCodec.decode", lambda: codec.decode(wire, blocks, width, keys))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--out", type=Path, default=None, help="write the table to OUT.md")
    ap.add_argument("--dry-run-on-cpu", action="store_true",
                    help="run every layer on CPU tensors under TRITON_INTERPRET=1 (checks the script; "
                         "its times mean nothing)")
    args = ap.parse_args(argv)
    if args.dry_run_on_cpu:
        measure(200, 32, args.peers, 3, device="cpu")
        return 0
    if not torch.cuda.is_available():
        print("bench/launch_cost.py needs a CUDA device (and Triton): nothing measured", file=sys.stderr)
        return 2
    import triton
    head = (f"# A fused codec call's cost, layer by layer ({device_name('cuda')}, torch {torch.__version__}, "
            f"triton {triton.__version__})\n\n{args.rows} x {args.width} fp32, {args.peers} blocks; µs a call, "
            f"{args.calls} calls back to back, best of 5 (`python bench/launch_cost.py`).\n\n"
            "| layer | µs a call |\n|---|---:|\n")
    rows = measure(args.rows, args.width, args.peers, args.calls)
    text = head + "".join(f"| {name} | {val} |\n" for name, val in rows)
    if args.out:
        args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
