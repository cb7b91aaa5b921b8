"""Compressed exchanges on real ranks against an independent single-process computation.

Every rank sends deterministic rows ``x[v, c] = f(v, c)`` through one layer's exchange with a
codec, takes ``loss = sum(halo * w(q, v, c))`` and back-propagates. The test then recomputes,
in numpy from the shard files alone, what every halo row must hold (the rows and channels the
documented keys select, scaled, or the documented quantisation of the sender's buffer) and what
every owned row's gradient must be (the gradient of exactly that forward: the weights of the
sent entries, scaled the same way, nothing for dropped rows or channels) — with the backward
codec's fp32 value stage, so both are exact. This file is also the MPI worker.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import CSBM, run_mpi
from test_codecs import np_hash32, ref_channels, ref_kept_rows, ref_quant

WIDTH, SEED, LAYER, EPOCH = 6, 5, 1, 3
M64 = (1 << 64) - 1
CODECS = {  # name -> (keep, channels, k, bits) of the forward; the backward is fp32
    "sample": (0.5, "all", 0, 32),
    "random": (1.0, "random", 2, 32),
    "truncate": (1.0, "truncate", 4, 32),
    "sample+random": (0.4, "random", 3, 32),
    "quant2": (1.0, "all", 0, 2),
}


def f(gid, c):
    return np.sin(0.37 * gid[:, None] + 1.3 * c[None, :]) + (gid[:, None] % 7) + 0.5


def w(rank, gid, c):
    return np.cos(0.11 * gid[:, None] - 0.7 * c[None, :] + rank)


def mix(*values):  # SplitMix64 chain, as documented in hpcgnn/comm/keys.py
    h = 0
    for v in values:
        x = (h ^ (int(v) & M64))
        x = (x + 0x9E3779B97F4A7C15) & M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
        h = x ^ (x >> 31)
    return h >> 1


def block_keys(src, dst, layer=LAYER, epoch=EPOCH):
    """(row key, channel key) of the block src -> dst, as hpcgnn/codecs/rng.py documents them:
    ``hash32(pair ^ hash32(epoch))`` with the row pair ``mix(seed, src, dst)`` (no layer: one
    boundary sample an epoch, as BNS-GCN) and the channel pair ``mix(seed, layer, src, dst)``."""
    rows = mix(SEED, src, dst) & 0xFFFFFFFF
    chans = mix(SEED, layer, src, dst) & 0xFFFFFFFF
    return (int(np_hash32(np.uint64(rows) ^ np_hash32(epoch))),
            int(np_hash32(np.uint64(chans) ^ np_hash32(epoch))))


def expected(shard_dir: Path, parts: int, codec: str, layer: int = LAYER, epoch: int = EPOCH):
    """(halo values per rank, owned-row gradients per rank), from the shard files alone."""
    from hpcgnn.data.shard import read_shard
    keep, channels, k, bits = CODECS[codec]
    shards = [read_shard(shard_dir / f"part-{p:05d}.h5") for p in range(parts)]
    cols = np.arange(WIDTH)
    halos, grads = [], [np.zeros((s.n_owned, WIDTH)) for s in shards]
    for q, sq in enumerate(shards):
        halo, start = np.zeros((sq.n_halo, WIDTH)), 0
        for p, rows in enumerate(sq.recv_counts.tolist()):
            gid = sq.halo_global_id[start:start + rows]
            vals, mask = f(gid, cols), np.zeros((rows, WIDTH))
            row_key, chan_key = block_keys(p, q, layer, epoch)
            kept = ref_kept_rows(row_key, rows, keep) if keep < 1 else list(range(rows))
            chans = {"all": list(range(WIDTH)), "truncate": list(range(k)),
                     "random": ref_channels(chan_key, WIDTH, k) if channels == "random" else []
                     }[channels]
            mask[np.ix_(kept, chans)] = rows / len(kept) if kept else 0
            if bits != 32:                       # the sender's whole packed buffer, quantised
                sp = shards[p]
                buf = f(sp.global_id[sp.send_index], cols).astype(np.float32)
                deq = ref_quant(buf, bits, mix(SEED, epoch, layer, 0, p))
                off = int(sp.send_counts[:q].sum())
                vals = deq[off:off + rows]
            halo[start:start + rows] = vals * mask
            owner_rows = np.searchsorted(shards[p].global_id, gid)
            np.add.at(grads[p], owner_rows, w(q, gid, cols) * mask)
            start += rows
        halos.append(halo)
    return halos, grads


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_compressed_exchange_equals_single_process(ranks, shards, tmp_path):
    shard_dir = shards(CSBM, ranks, "random")
    proc = run_mpi(ranks, [__file__, str(shard_dir), str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for codec in CODECS:
        halos, grads = expected(shard_dir, ranks, codec)
        for r in range(ranks):
            got = json.loads((tmp_path / f"{codec}-{r}.json").read_text())
            np.testing.assert_allclose(np.array(got["halo"]).reshape(-1, WIDTH), halos[r],
                                       rtol=1e-6, atol=1e-6, err_msg=f"{codec} halo, rank {r}")
            np.testing.assert_allclose(np.array(got["grad"]).reshape(-1, WIDTH), grads[r],
                                       rtol=1e-5, atol=1e-5, err_msg=f"{codec} grad, rank {r}")
            if codec != "quant2":                # selections send fewer bytes than fp32
                assert got["bytes_sent"] < got["bytes_full"]


DRAWS = [(0, EPOCH), (1, EPOCH), (2, EPOCH), (1, EPOCH + 1)]   # (layer, epoch) of sample+random


def _kept_rows(values):
    return np.flatnonzero(np.abs(values).sum(1) > 0).tolist()


@pytest.mark.mpi
def test_every_layer_of_an_epoch_keeps_the_same_rows(shards, tmp_path):
    """BNS-GCN draws one boundary sample an epoch, used by every layer forward and backward
    (GATECH-EIC/BNS-GCN train.py: ``select_node`` once per epoch): the exchanges of layers 0, 1
    and 2 at one epoch deliver the same rows of every block (and take gradients back for the
    same owned rows), the next epoch others; ``random``'s channels stay a draw per layer. Each
    exchange also equals the numpy computation from the documented keys."""
    ranks = 2
    shard_dir = shards(CSBM, ranks, "random")
    proc = run_mpi(ranks, [__file__, str(shard_dir), str(tmp_path), "layers"], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = {(layer, epoch, r): tuple(np.array(d[n]).reshape(-1, WIDTH) for n in ("halo", "grad"))
           for layer, epoch in DRAWS for r in range(ranks)
           for d in [json.loads((tmp_path / f"draw-{layer}-{epoch}-{r}.json").read_text())]}
    for r in range(ranks):
        halo0, grad0 = got[0, EPOCH, r]
        assert 0 < len(_kept_rows(halo0)) < len(halo0)
        for layer in (1, 2):
            halo, grad = got[layer, EPOCH, r]
            assert _kept_rows(halo) == _kept_rows(halo0), f"layer {layer}, rank {r}: other rows"
            assert _kept_rows(grad) == _kept_rows(grad0), f"layer {layer}, rank {r}: other grads"
    assert any(_kept_rows(got[1, EPOCH + 1, r][0]) != _kept_rows(got[1, EPOCH, r][0])
               for r in range(ranks)), "the next epoch kept the same rows"
    assert any(not np.array_equal(got[0, EPOCH, r][0] != 0, got[1, EPOCH, r][0] != 0)
               for r in range(ranks)), "random drew the same channels in two layers"
    for layer, epoch in DRAWS:
        halos, grads = expected(shard_dir, ranks, "sample+random", layer, epoch)
        for r in range(ranks):
            halo, grad = got[layer, epoch, r]
            np.testing.assert_allclose(halo, halos[r], rtol=1e-6, atol=1e-6,
                                       err_msg=f"layer {layer} epoch {epoch} halo, rank {r}")
            np.testing.assert_allclose(grad, grads[r], rtol=1e-5, atol=1e-5,
                                       err_msg=f"layer {layer} epoch {epoch} grad, rank {r}")


def _run(ctx, shard, exch, epoch: int, codec: str, path: Path) -> None:
    """One forward and backward through ``exch`` with ``CODECS[codec]`` at ``epoch``: the halo,
    the owned rows' gradient and the bytes, written to ``path``."""
    import torch

    from hpcgnn.codecs import IDENTITY, WireCodec
    from hpcgnn.comm.exchange import ExchangeSettings
    keep, channels, k, bits = CODECS[codec]
    cols = np.arange(WIDTH)
    settings = ExchangeSettings(epoch, WireCodec(keep=keep, channels=channels, k=k, bits=bits),
                                IDENTITY)
    x = torch.tensor(f(shard.global_id, cols), dtype=torch.float32, requires_grad=True)
    halo = exch.exchange(x, settings)
    weight = torch.tensor(w(ctx.rank, shard.halo_global_id, cols), dtype=torch.float32)
    (halo * weight).sum().backward()
    path.write_text(json.dumps(
        {"halo": halo.detach().reshape(-1).tolist(), "grad": x.grad.reshape(-1).tolist(),
         "bytes_sent": exch.stats.bytes_sent, "bytes_full": exch.stats.bytes_full}))


def _worker(shard_dir: str, out: str, mode: str = "codecs") -> None:
    """``codecs``: every codec of ``CODECS`` at (``LAYER``, ``EPOCH``), a fresh exchanger each;
    ``layers``: ``sample+random`` at each of ``DRAWS``, one exchanger a layer."""
    from hpcgnn.comm.context import CommContext
    from hpcgnn.comm.exchange import ExchangeStats, HaloExchanger
    from hpcgnn.comm.plan import HaloPlan
    from hpcgnn.train.inputs import load_part
    ctx = CommContext.from_world("cpu")
    _, shard = load_part(shard_dir, ctx.rank, ctx.size)
    plan = HaloPlan.from_shard(shard)
    if mode == "layers":
        exchangers = {}
        for layer, epoch in DRAWS:
            exch = exchangers.setdefault(layer, HaloExchanger(ctx, plan, layer=layer, seed=SEED,
                                                              stats=ExchangeStats()))
            _run(ctx, shard, exch, epoch, "sample+random",
                 Path(out, f"draw-{layer}-{epoch}-{ctx.rank}.json"))
    else:
        for name in CODECS:
            exch = HaloExchanger(ctx, plan, layer=LAYER, seed=SEED, stats=ExchangeStats())
            _run(ctx, shard, exch, EPOCH, name, Path(out, f"{name}-{ctx.rank}.json"))
    print(f"rank {ctx.rank}: done", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _worker(*sys.argv[1:4])
