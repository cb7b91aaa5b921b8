"""Counter-based dropout against torch's own, forward and forward + backward.

    python bench/dropout.py [--rows 500000] [--width 128] [--repeat 20] [--device cpu|cuda]
                            [--out bench/results/dropout]

Rows of ``width`` float32 activations (default: the cSBM-500k epoch's layer input), p = 0.5:
``torch.nn.functional.dropout`` (its fused Philox kernel; a mask no other rank can redraw),
hpcgnn's ``counter_dropout`` on the fused Triton kernel (CUDA with Triton), and the same on the
torch hash path (``HPCGNN_TRITON=0``). Reported: ms, GB/s of the minimum traffic (fp32 read and
written, 8 bytes an element; 16 with the backward), its share of the device's copy bandwidth
measured in the same run, and the kernel launches of one call (CUDA, torch profiler).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hpcgnn
from hpcgnn.nn.dropout import counter_dropout  # noqa: E402
from gpu_meter import best_time, copy_bandwidth, device_name, launches  # noqa: E402

P = 0.5


def variants(device: str) -> dict:
    """name -> (HPCGNN_TRITON value, dropout(x, gid))."""
    ours = lambda x, gid: counter_dropout(x, gid, P, 0, 3, 1, True)   # noqa: E731
    out = {"torch F.dropout": ("1", lambda x, gid: F.dropout(x, P, training=True)),
           "hpcgnn, torch hash path": ("0", ours)}
    if device.startswith("cuda"):
        out["hpcgnn, fused Triton kernel"] = ("1", ours)
    return out


def measure(fn, x, gid, repeat: int, backward: bool) -> dict:
    dev = x.device
    if backward:
        xg = x.clone().requires_grad_()
        call = lambda: fn(xg, gid).sum().backward()   # noqa: E731  (the sum is one more kernel)
    else:
        call = lambda: fn(x, gid)                     # noqa: E731
    t = best_time(call, dev, repeat)
    traffic = x.numel() * 4 * (4 if backward else 2)
    return {"ms": t * 1e3, "GB_per_s": traffic / t / 1e9, "launches": launches(call, dev)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench/results/dropout")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.rows, args.width, device=args.device)
    gid = torch.arange(args.rows, device=args.device) * 7 + 3
    copy_bw = copy_bandwidth(args.device)
    results = []
    for name, (env, fn) in variants(args.device).items():
        os.environ["HPCGNN_TRITON"] = env
        for backward in (False, True):
            r = measure(fn, x, gid, args.repeat, backward)
            results.append({"variant": name, "pass": "forward + backward" if backward else "forward", **r,
                            "copy_share": r["GB_per_s"] * 1e9 / copy_bw})
    os.environ.pop("HPCGNN_TRITON", None)
    note = (f"Dropout p = {P} of {args.rows} x {args.width} float32, {device_name(args.device)}, "
            f"torch {torch.__version__}, best of {args.repeat}; device copy bandwidth "
            f"{copy_bw / 1e9:.0f} GB/s (read + write).")
    lines = [note, "", "| variant | pass | ms | GB/s | share of copy bw | launches |",
             "|---|---|---:|---:|---:|---:|"]
    for r in results:
        n = "–" if r["launches"] is None else r["launches"]["kernels"]
        lines.append(f"| {r['variant']} | {r['pass']} | {r['ms']:.3f} | {r['GB_per_s']:.1f} | "
                     f"{100 * r['copy_share']:.1f} % | {n} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"note": note, "results": results}, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
