"""Why ``kind = "auto"`` offers bit widths and no channel ratio: the relative squared error
``||x - x^||^2 / ||x||^2`` of each codec on the rows a trained Cora GCN's first layer exchanges
(``X W``, every node's row), against the share of fp32 bytes it sends.

    python bench/channel_vs_quant.py RUN_DIR [RUN_DIR ...]     # runs of configs/cora.toml-like GCNs on Cora

Reads ``RUN_DIR/checkpoint.pt`` (``layers.0.weight``) and the shipped Cora features
(row-normalised, as the study trains them). One process, no MPI.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from hpcgnn.codecs import WireCodec
from hpcgnn.codecs.rng import Blocks

REPO = Path(__file__).resolve().parents[1]


def cora_features() -> torch.Tensor:
    d = np.load(REPO / "hpcgnn" / "datasets" / "cora.npz")
    if "features" in d:
        x = torch.tensor(d["features"], dtype=torch.float32)
    else:
        from scipy.sparse import csr_matrix
        x = torch.tensor(csr_matrix((d["feat_data"], d["feat_indices"], d["feat_indptr"]),
                                    shape=tuple(d["feat_shape"])).toarray(), dtype=torch.float32)
    return x / x.sum(1, keepdim=True).clamp(min=1)


def error(codec: WireCodec, h: torch.Tensor) -> tuple[float, float]:
    """(relative squared error, share of fp32 bytes) of ``codec`` on the rows ``h``."""
    n, f = h.shape
    blocks, keys = Blocks.of((n,), "cpu"), torch.tensor([7], dtype=torch.int64)
    y = codec.decode(codec.encode(h, blocks, keys, 3), blocks, f, keys)
    return float(((y - h) ** 2).sum() / (h ** 2).sum()), codec.block_bytes(n, f) / (n * f * 4)


def main() -> None:
    x = cora_features()
    for run in sys.argv[1:]:
        h = x @ torch.load(Path(run) / "checkpoint.pt", weights_only=True)["model"]["layers.0.weight"]
        f = h.shape[1]
        print(f"{run}: rows of width {f}")
        codecs = [WireCodec(bits=b) for b in (1, 2, 4, 8)] + [
            WireCodec(channels=ch, k=k) for k in sorted({max(1, f // 8), f // 4, f // 2, 3 * f // 4})
            for ch in ("truncate", "random")]
        for c in codecs:
            e, share = error(c, h)
            print(f"  {c.name:>18}: relative squared error {e:.3g} at {100 * share:.1f} % of fp32 bytes")


if __name__ == "__main__":
    main()
