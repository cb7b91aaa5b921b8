"""What a receiving layer sees of the halo rows' rounding noise, against the per-row error that
``kind = "auto"`` measures.

``auto`` measures, on the rows a sender sends, ``sum ||x - x^b||^2 / sum ||x||^2`` (per row).
The receiving GCN layer does not use a row alone: it forms ``z_v = sum_u a_vu x_u`` over its
owned and halo neighbours, so independent rounding noise is averaged over the neighbours and
diluted by the owned rows. This script measures both on one whole-graph model (no MPI: the
parts are only index sets), with the codec of the wire (``hpcgnn.codecs.quant``, one noise key
per receiving part):

- forward, layer ``l``: the rows ``h = x W`` (transform-first, as on the wire) of the halo nodes
  of every part; ``row`` = the per-row figure; ``aggregate`` = ``sum_v ||sum_halo a_vu e_u||^2 /
  sum_v ||z_v||^2`` over the receivers' owned nodes ``v``; ``halo only`` = the same over the
  halo part of ``z_v`` alone (the averaging without the owned rows' dilution);
- backward, layer ``l``: the partial gradients ``g_u^p = sum_{v in p} a_vu dL/dz_v`` a part ``p``
  sends for its halo node ``u``; ``row`` per row; ``aggregate`` = the summed noise against the
  owner's whole gradient row ``sum_v a_vu dL/dz_v``.

Weights: a 2-layer GCN on the trainer's operator, trained in this process (Adam 0.01, weight
decay 5e-4, dropout 0.5) and read at several epochs; the figures are taken without dropout.

    python bench/aggregate_error.py --dataset cora --parts 4 --epochs 5 20 40 80
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hpcgnn.codecs.quant import decode_values, encode_values  # noqa: E402
from hpcgnn.data.datasets import load_dataset  # noqa: E402
from hpcgnn.train.inputs import row_normalize  # noqa: E402
from preprocess.partition import random_parts  # noqa: E402

CSBM = "csbm:nodes=20000,classes=8,degree=10,homophily=0.7,features=128,signal=0.8,seed=11"


def gcn_matrix(graph) -> sp.csr_matrix:
    """The trainer's GCN operator on the whole graph: ``1 / sqrt((d_i + 1)(d_j + 1))`` on every
    in-edge ``j -> i`` and ``1 / (d_i + 1)`` on the self-loop, ``d`` the in-degree
    (``hpcgnn.nn.graph.gcn_values``)."""
    n, deg = graph.num_nodes, graph.in_degree().astype(np.float64) + 1.0
    rows = np.repeat(np.arange(n), np.diff(graph.indptr))
    vals = 1.0 / np.sqrt(deg[rows] * deg[graph.indices])
    a = sp.csr_matrix((vals, graph.indices, graph.indptr), shape=(n, n))
    return sp.csr_matrix(a + sp.diags(1.0 / deg))


def roundtrip(x: torch.Tensor, bits: int, key: int) -> torch.Tensor:
    return decode_values(encode_values(x, bits, key), x.shape[1], bits)


def figures(a: sp.csr_matrix, parts: np.ndarray, h: np.ndarray, g: np.ndarray, bits: int
            ) -> dict:
    """Per-row and aggregate relative squared errors of ``bits`` for the forward rows ``h`` and
    the backward partial gradients of the upstream gradient ``g`` (both ``[N, F]``)."""
    num_parts = int(parts.max()) + 1
    f = {"row": [0.0, 0.0], "aggregate": [0.0, 0.0], "halo only": [0.0, 0.0],
         "b row": [0.0, 0.0], "b aggregate": [0.0, 0.0]}
    grad_noise = np.zeros_like(g)
    for p in range(num_parts):
        own = np.flatnonzero(parts == p)
        block = a[own]                                       # receivers' rows, all columns
        cols = np.unique(block.indices)
        halo = cols[parts[cols] != p]
        if len(halo) == 0:
            continue
        x = torch.from_numpy(h[halo].astype(np.float32))
        err = roundtrip(x, bits, 1000 + p).numpy().astype(np.float64) - h[halo]
        f["row"][0] += float((err ** 2).sum())
        f["row"][1] += float((h[halo] ** 2).sum())
        ah = block[:, halo]
        noise = ah @ err
        f["aggregate"][0] += float((noise ** 2).sum())
        f["aggregate"][1] += float(((block @ h) ** 2).sum())
        f["halo only"][0] += float((noise ** 2).sum())
        f["halo only"][1] += float(((ah @ h[halo]) ** 2).sum())
        partial = ah.T @ g[own]                              # what p sends back for its halo
        y = torch.from_numpy(partial.astype(np.float32))
        e = roundtrip(y, bits, 2000 + p).numpy().astype(np.float64) - partial
        f["b row"][0] += float((e ** 2).sum())
        f["b row"][1] += float((partial ** 2).sum())
        grad_noise[halo] += e
    total = a.T @ g                                          # the owners' whole gradient rows
    touched = np.abs(grad_noise).sum(axis=1) > 0
    f["b aggregate"] = [float((grad_noise[touched] ** 2).sum()), float((total[touched] ** 2).sum())]
    return {k: v[0] / v[1] for k, v in f.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default=CSBM)
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, nargs="+", default=[5, 20, 40, 80])
    ap.add_argument("--bits", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    graph = load_dataset("cora" if args.dataset == "cora" else args.dataset)
    x = graph.dense_features().astype(np.float32)
    if args.dataset in ("cora", "citeseer"):                 # row-normalised, as the study runs
        x = row_normalize(x)
    x = torch.from_numpy(x)
    a = gcn_matrix(graph)
    warnings.filterwarnings("ignore", message="Sparse")      # torch's beta notice for CSR
    at = torch.sparse_csr_tensor(torch.from_numpy(a.indptr), torch.from_numpy(a.indices),
                                 torch.from_numpy(a.data.astype(np.float32)), a.shape)
    y = torch.from_numpy(graph.labels)
    train = torch.from_numpy(graph.train_idx)
    parts = random_parts(graph.num_nodes, args.parts, args.seed)
    torch.manual_seed(args.seed)
    w0 = torch.nn.Parameter(torch.empty(x.shape[1], args.hidden))
    w1 = torch.nn.Parameter(torch.empty(args.hidden, graph.num_classes))
    torch.nn.init.xavier_uniform_(w0)
    torch.nn.init.xavier_uniform_(w1)
    opt = torch.optim.Adam([w0, w1], lr=0.01, weight_decay=5e-4)
    print(f"{graph.name}: {graph.num_nodes} nodes, {args.parts} random parts; relative squared "
          "error of b-bit rows: per row (what auto measures) / at the receiving aggregation / "
          "halo part of it; backward: per row / at the owner's gradient row")
    print("| epoch | layer | bits | forward: row | aggregate | halo only | backward: row | aggregate |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for epoch in range(max(args.epochs) + 1):
        if epoch in args.epochs:                             # figures without dropout
            h0 = (x @ w0).detach().requires_grad_(True)
            z0 = torch.sparse.mm(at, h0)
            h1 = (F.relu(z0) @ w1)
            z1 = torch.sparse.mm(at, h1)
            z0.retain_grad()
            z1.retain_grad()
            F.cross_entropy(z1[train], y[train]).backward()
            for layer, (h, z) in enumerate(((h0, z0), (h1, z1))):
                for bits in args.bits:
                    fig = figures(a, parts, h.detach().double().numpy(),
                                  z.grad.double().numpy(), bits)
                    print(f"| {epoch} | {layer} | {bits} | {fig['row']:.3g} | "
                          f"{fig['aggregate']:.3g} | {fig['halo only']:.3g} | "
                          f"{fig['b row']:.3g} | {fig['b aggregate']:.3g} |", flush=True)
        opt.zero_grad()
        h = F.relu(torch.sparse.mm(at, F.dropout(x, 0.5) @ w0))
        logits = torch.sparse.mm(at, F.dropout(h, 0.5) @ w1)
        F.cross_entropy(logits[train], y[train]).backward()
        opt.step()


if __name__ == "__main__":
    main()
