"""Codec throughput: encode + decode of realistic halo buffers, in MB/s of fp32 input.

    python bench/codecs.py [--rows 2000 20000] [--widths 16 128 256] [--peers 4] [--repeat 5]
                           [--out bench/results/codecs]

One buffer of ``rows`` boundary rows (Cora-sized and cSBM-sized halos) split evenly over
``peers`` peer blocks, every codec at the ratios the study uses; best of ``repeat``. Writes
``OUT.json`` and ``OUT.md``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hpcgnn.codecs import build_codec, parse_codec
from hpcgnn.codecs.build import CodecSpec
from hpcgnn.codecs.rng import Blocks, epoch_keys

CASES = [("none", 1), ("truncate", 8), ("truncate", 128), ("random", 8), ("quant", 4),
         ("quant", 8), ("quant", 16), ("quant", 32), ("sample", 4), ("truncate+quant", 8),
         ("sample+random", 8)]


def _spec(name: str) -> CodecSpec:
    spec = parse_codec(name)
    fixed_bits = 4 if spec.quant and spec.rate_stage != "quant" else None
    fixed_keep = 0.5 if spec.sample and spec.rate_stage != "sample" else None
    return CodecSpec(spec.sample, spec.channels, spec.quant, bits=fixed_bits, keep=fixed_keep)


def _sync(x: torch.Tensor) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def _time_one(codec, x, counts, keys, repeat: int) -> tuple[float, float, int]:
    best_enc = best_dec = float("inf")
    for _ in range(repeat + 1):                 # the first round warms up (CUDA: kernel loads)
        _sync(x)
        t0 = time.perf_counter()
        buf = codec.encode(x, counts, keys, 12345)
        _sync(x)
        t1 = time.perf_counter()
        codec.decode(buf, counts, x.shape[1], keys)
        _sync(x)
        t2 = time.perf_counter()
        best_enc, best_dec = min(best_enc, t1 - t0), min(best_dec, t2 - t1)
    return best_enc, best_dec, buf.numel()


def run(row_sizes: list[int], widths: list[int], peers: int, repeat: int,
        device: str = "cpu") -> list[dict]:
    torch.manual_seed(0)
    out = []
    keys = epoch_keys(torch.arange(1, peers + 1, device=device), 0)
    for rows, width in [(r, w) for r in row_sizes for w in widths]:
        counts = Blocks.of([rows // peers] * peers, device)
        x = torch.randn(counts.rows, width, device=device)
        for name, ratio in CASES:
            codec = build_codec(_spec(name), ratio, width)
            try:
                enc, dec, nbytes = _time_one(codec, x, counts, keys, repeat)
            except Exception as exc:            # noqa: BLE001  (reported, not hidden)
                print(f"{name} at ratio {ratio}, {rows} x {width} on {device}: FAILED: {exc!r}")
                raise
            mb = x.numel() * 4 / 1e6
            out.append({"codec": repr(codec) if name != "none" else "none", "ratio": ratio,
                        "rows": counts.rows, "width": width, "wire_ratio": x.numel() * 4 / nbytes,
                        "encode_ms": enc * 1e3, "decode_ms": dec * 1e3,
                        "MB_per_s": mb / (enc + dec)})
    return out


def to_markdown(results: list[dict], note: str) -> str:
    lines = [note, "", "| codec | width | rows | wire ratio | encode ms | decode ms | MB/s (enc+dec) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['codec']} | {r['width']} | {r['rows']} | {r['wire_ratio']:.1f} | "
                     f"{r['encode_ms']:.2f} | {r['decode_ms']:.2f} | {r['MB_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2000, 20000])
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 128, 256])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="bench/results/codecs")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = run(args.rows, args.widths, args.peers, args.repeat, args.device)
    where = "one thread" if args.device == "cpu" else f"{args.device} ({torch.cuda.get_device_name()})"
    note = (f"Codec throughput, {where} (torch {torch.__version__}), rows split over "
            f"{args.peers} peer blocks, best of {args.repeat}; MB/s counts fp32 input bytes.")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"note": note, "results": results}, indent=1))
    out.with_suffix(".md").write_text(to_markdown(results, note))
    print(to_markdown(results, note))


if __name__ == "__main__":
    main()
