"""Codec throughput: encode + decode of realistic halo buffers, against the device's copy bandwidth.

    python bench/codecs.py [--rows 2000 20000] [--widths 16 128 256] [--peers 4] [--repeat 20]
                           [--device cpu|cuda] [--paths triton,torch] [--out bench/results/codecs]

One buffer of ``rows`` boundary rows (Cora-sized and cSBM-sized halos) split evenly over
``peers`` peer blocks, every codec at the ratios the study uses; best of ``repeat`` per
direction. Reported per codec: encode and decode ms; GB/s of fp32 input (``4 R F`` bytes over
encode + decode, each call timed between two synchronisations); the same for encode + decode
pairs issued back to back with one synchronisation at the end (``streamed_time``: a call's host
side then overlaps the GPU's work on the calls before it, as in a training step); the share of
the device's copy bandwidth (a ``copy_`` measured in the same run)
that the minimum traffic reaches (fp32 read + wire written, wire read + fp32 written); and on
CUDA the kernel launches of one encode and one decode and their GPU time (torch profiler: the
kernels alone, without the host side of the call that the wall-clock times include). On CUDA
every codec runs on each of ``--paths``: ``triton`` (the fused kernels) and ``torch``
(``HPCGNN_TRITON=0``). Writes ``OUT.json`` and ``OUT.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hpcgnn
from hpcgnn.codecs import build_codec, parse_codec  # noqa: E402
from hpcgnn.codecs.build import CodecSpec  # noqa: E402
from hpcgnn.codecs.rng import Blocks, epoch_keys, pair_keys  # noqa: E402
from gpu_meter import best_time, copy_bandwidth, device_name, device_seconds, launches, streamed_time  # noqa: E402

CASES = [("none", 1), ("truncate", 8), ("truncate", 128), ("random", 8), ("quant", 4),
         ("quant", 8), ("quant", 16), ("quant", 32), ("sample", 4), ("truncate+quant", 8),
         ("sample+random", 8)]


def _spec(name: str) -> CodecSpec:
    spec = parse_codec(name)
    fixed_bits = 4 if spec.quant and spec.rate_stage != "quant" else None
    fixed_keep = 0.5 if spec.sample and spec.rate_stage != "sample" else None
    return CodecSpec(spec.sample, spec.channels, spec.quant, bits=fixed_bits, keep=fixed_keep)


def measure(codec, x, blocks, keys, repeat: int) -> dict:
    """Times, rates and launches of one codec on one buffer."""
    dev, width = x.device, x.shape[1]
    buf = codec.encode(x, blocks, keys, 12345)
    enc = best_time(lambda: codec.encode(x, blocks, keys, 12345), dev, repeat)
    dec = best_time(lambda: codec.decode(buf, blocks, width, keys), dev, repeat)
    fp32, wire = x.numel() * 4, buf.numel()
    pair = streamed_time(lambda: codec.decode(codec.encode(x, blocks, keys, 12345), blocks, width, keys), dev,
                         calls=repeat, rounds=3)
    n_enc = launches(lambda: codec.encode(x, blocks, keys, 12345), dev)
    n_dec = launches(lambda: codec.decode(buf, blocks, width, keys), dev)
    g_enc = device_seconds(lambda: codec.encode(x, blocks, keys, 12345), dev)
    g_dec = device_seconds(lambda: codec.decode(buf, blocks, width, keys), dev)
    gpu = {} if g_enc is None else {
        "encode_gpu_ms": g_enc * 1e3, "decode_gpu_ms": g_dec * 1e3,
        "GB_per_s_gpu": fp32 / (g_enc + g_dec) / 1e9 if g_enc + g_dec > 0 else float("inf")}
    return {"wire_ratio": fp32 / max(wire, 1), "encode_ms": enc * 1e3, "decode_ms": dec * 1e3,
            "GB_per_s": fp32 / (enc + dec) / 1e9, "pair_streamed_ms": pair * 1e3,
            "GB_per_s_streamed": fp32 / pair / 1e9, "traffic_GB_per_s": 2 * (fp32 + wire) / (enc + dec) / 1e9,
            "launches_encode": n_enc, "launches_decode": n_dec, **gpu}


def run(row_sizes: list[int], widths: list[int], peers: int, repeat: int, device: str = "cpu",
        paths: tuple[str, ...] = ("cpu",)) -> list[dict]:
    torch.manual_seed(0)
    out = []
    keys = epoch_keys(pair_keys(0, 0, 0, None, peers, device), 0)   # as training's: rows, channels
    for rows, width in [(r, w) for r in row_sizes for w in widths]:
        blocks = Blocks.of([rows // peers] * peers, device)
        x = torch.randn(blocks.rows, width, device=device)
        for (name, ratio), path in [(c, p) for c in CASES for p in paths]:
            codec = build_codec(_spec(name), ratio, width)
            os.environ["HPCGNN_TRITON"] = "0" if path == "torch" else "1"
            try:
                r = measure(codec, x, blocks, keys, repeat)
            except Exception as exc:            # noqa: BLE001  (reported, not hidden)
                print(f"{name} at ratio {ratio}, {rows} x {width} on {device} ({path}): FAILED: {exc!r}")
                raise
            out.append({"codec": repr(codec) if name != "none" else "none", "ratio": ratio,
                        "path": path, "rows": blocks.rows, "width": width, **r})
    os.environ.pop("HPCGNN_TRITON", None)
    return out


def _n(counts: dict | None) -> str:
    if counts is None:
        return "–"
    extra = [f"{v} {k}" for k, v in counts.items() if k != "kernels" and v]
    return str(counts["kernels"]) + (f" (+{', '.join(extra)})" if extra else "")


def to_markdown(results: list[dict], note: str, copy_bw: float) -> str:
    lines = [note, "", f"Device copy bandwidth (``copy_``, read + write): {copy_bw / 1e9:.0f} GB/s.", "",
             "| codec | path | width | rows | wire ratio | encode ms | decode ms | GB/s fp32 in "
             "| enc + dec back to back: ms, GB/s "
             "| traffic / copy bw | launches enc | launches dec | GPU ms enc / dec | GB/s on GPU time |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        gpu = (f"{r['encode_gpu_ms']:.3f} / {r['decode_gpu_ms']:.3f} | {r['GB_per_s_gpu']:.0f}"
               if "encode_gpu_ms" in r else "– | –")
        lines.append(f"| {r['codec']} | {r['path']} | {r['width']} | {r['rows']} | {r['wire_ratio']:.1f} | "
                     f"{r['encode_ms']:.3f} | {r['decode_ms']:.3f} | {r['GB_per_s']:.2f} | "
                     f"{r['pair_streamed_ms']:.3f}, {r['GB_per_s_streamed']:.2f} | "
                     f"{100 * r['traffic_GB_per_s'] * 1e9 / copy_bw:.1f} % | "
                     f"{_n(r['launches_encode'])} | {_n(r['launches_decode'])} | {gpu} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2000, 20000])
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 128, 256])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default="bench/results/codecs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--paths", default="triton,torch", help="cuda: which paths to run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    paths = tuple(args.paths.split(",")) if args.device.startswith("cuda") else ("cpu",)
    copy_bw = copy_bandwidth(args.device)
    results = run(args.rows, args.widths, args.peers, args.repeat, args.device, paths)
    note = (f"Codec throughput, {device_name(args.device)} (torch {torch.__version__}), rows split "
            f"over {args.peers} peer blocks, best of {args.repeat} per direction.")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"note": note, "copy_GB_per_s": copy_bw / 1e9,
                                                    "results": results}, indent=1))
    out.with_suffix(".md").write_text(to_markdown(results, note, copy_bw))
    print(to_markdown(results, note, copy_bw))


if __name__ == "__main__":
    main()
