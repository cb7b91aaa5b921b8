"""One rank's layer work in a synchronous and in a stale step, without the exchange, on one
CPU thread: where a stale step's extra compute goes and what the fused dropout-matmul kernel
(``hpcgnn.nn.dropout.dropout_matmul``) saves.

    python bench/stale_layer.py SHARD.h5 [--in-dim 128] [--hidden 64] [--classes 8]
                                [--repeat 60] [--out bench/results/stale-layer]

``SHARD.h5``: one part of a shard set (``bench/network.py`` writes the cSBM 20k's under
``--work``). GCN layers with dropout 0.5, forward and backward, the halo rows given (random
numbers in place of what the exchange would bring):

- ``sync``: drop the owned rows, ``@ W``, aggregate the owned and the received halo rows of
  ``x W`` (``F_out`` wide); the backward also makes the halo rows' gradient. ``sync, fused``:
  the dropout and ``@ W`` in one C pass (what ``GCNLayer.sync_forward`` runs for ``F_out <=
  32``).
- ``stale, aggregate first``: drop ``[x; x_halo]`` on the receiver and aggregate at the input
  width, then ``@ W`` (the order of ``transform_first_with_halo`` without the fused kernel).
  ``stale, fused``: ``drop([x; x_halo]) @ W`` in one C pass, then aggregate at ``F_out``.
- ``kernel``: the fused pass alone against ``counter_dropout(x) @ W`` on the halo rows.

Variants run interleaved, ``--repeat`` rounds; the median and minimum are reported. The
layer input of the first layer needs no gradient (the features), the second layer's does.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from hpcgnn.data.shard import read_shard
from hpcgnn.nn.dropout import counter_dropout, dropout_matmul
from hpcgnn.nn.graph import LocalGraph

P = 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shard")
    ap.add_argument("--in-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = LocalGraph.from_shard(read_shard(args.shard), "gcn")
    n, nh, ids = g.n_owned, g.n_halo, g.node_ids

    def drop(t, halo, layer):
        return counter_dropout(t, ids[n:] if halo else ids[:n], P, 0, 1, layer, True)

    def dmm(t, halo, layer, w):
        return dropout_matmul(t, ids[n:] if halo else ids[:n], P, 0, 1, layer, True, w)

    variants = {}
    for layer, (f_in, f_out, needs_grad) in enumerate(
            [(args.in_dim, args.hidden, False), (args.hidden, args.classes, True)]):
        x0, xh0 = torch.relu(torch.randn(n, f_in)), torch.relu(torch.randn(nh, f_in))
        recv = torch.randn(nh, f_out)
        w = torch.randn(f_in, f_out, requires_grad=True)

        def inputs(x0=x0, xh0=xh0, needs_grad=needs_grad):
            return x0.clone().requires_grad_(needs_grad), xh0.clone().requires_grad_(needs_grad)

        def sync(fused, layer=layer, w=w, recv=recv, inputs=inputs):
            x, _ = inputs()
            xw = dmm(x, False, layer, w) if fused else drop(x, False, layer) @ w
            (g.owned @ xw + g.halo @ recv.clone().requires_grad_(True)).sum().backward()

        def stale_agg(layer=layer, w=w, inputs=inputs):
            x, xh = inputs()
            ((g.owned @ drop(x, False, layer) + g.halo @ drop(xh, True, layer)) @ w).sum().backward()

        def stale_fused(layer=layer, w=w, inputs=inputs):
            x, xh = inputs()
            (g.owned @ dmm(x, False, layer, w) + g.halo @ dmm(xh, True, layer, w)).sum().backward()

        name = f"layer {layer} ({f_in} -> {f_out})"
        variants[f"{name}: sync"] = lambda sync=sync: sync(False)
        variants[f"{name}: stale, aggregate first"] = stale_agg
        if f_out <= 32:
            variants[f"{name}: sync, fused"] = lambda sync=sync: sync(True)
            variants[f"{name}: stale, fused"] = stale_fused
            xh = xh0.clone().requires_grad_(True)
            variants[f"{name}: kernel, halo rows, fused"] = (
                lambda xh=xh, w=w, layer=layer: dmm(xh, True, layer, w).sum().backward())
            variants[f"{name}: kernel, halo rows, dropout then @ W"] = (
                lambda xh=xh, w=w, layer=layer: (drop(xh, True, layer) @ w).sum().backward())
    times = {k: [] for k in variants}
    for f in variants.values():
        f()
    for _ in range(args.repeat):
        for k, f in variants.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    rows = [{"what": k, "median_ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v)}
            for k, v in times.items()]
    head = (f"{args.shard}: {n} owned rows, {nh} halo rows, "
            f"{g.owned.mat.values().numel() + g.halo.mat.values().numel()} non-zeros; "
            f"one thread, {platform.processor() or platform.machine()}, torch {torch.__version__}")
    lines = [head, "", "| forward + backward | median (ms) | min (ms) |", "|---|---:|---:|"]
    lines += [f"| {r['what']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} |" for r in rows]
    print("\n".join(lines))
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"setup": head, "rows": rows}, indent=1))
        Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
