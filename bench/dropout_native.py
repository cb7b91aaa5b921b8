"""The C dropout kernels of CPU ranks on one thread, one layer's halo rows in size: the fused
dropout-and-product (forward, backward) and the plain dropout (``hpcgnn.codecs.native``).

    python bench/dropout_native.py [--rows 13737 --width 64 --out-width 8 --repeat 30]

Prints the median and minimum ms of each. Random row and channel hashes; p = 0.5.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hpcgnn.codecs import native


def _ms(fn, repeat: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), 1e3 * min(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=13737)      # rank 0's halo rows, 4 random parts of the cSBM 20k
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--out-width", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n, k, m = args.rows, args.width, args.out_width
    x, w, gy = torch.randn(n, k), torch.randn(k, m), torch.randn(n, m)
    rows = torch.randint(0, 2**32, (n,), dtype=torch.int64)
    cols = torch.randint(0, 2**32, (k,), dtype=torch.int64)
    thr, scale = 2**31, 2.0
    print(f"{native.lib()._name}: {n} x {k} -> {m}, one thread")
    for name, fn in (("dropout_matmul (forward)", lambda: native.dropout_matmul(x, rows, cols, thr, scale, w)),
                     ("dropout_matmul_backward", lambda: native.dropout_matmul_backward(x, rows, cols, thr, scale, w, gy)),
                     ("dropout_apply", lambda: native.dropout_apply(x, rows, cols, thr, scale))):
        med, low = _ms(fn, args.repeat)
        print(f"{name:26s} median {med:6.2f} ms   min {low:6.2f} ms")


if __name__ == "__main__":
    main()
