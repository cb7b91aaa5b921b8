"""What ``kind = "auto"`` measures, on real ranks: one layer's exchange with a probe in each
direction, against an independent numpy computation from the shard files alone.

Every rank sends deterministic rows ``x[v, c] = f(v, c)`` (fp32 forward) and back-propagates
``loss = sum(halo * w(q, v, c))``, so the halo gradients it sends back are ``w``. For every
candidate ``b`` the probe must record exactly ``sum ||x - x^b||^2`` of the documented
quantiser (``tests/test_codecs.py``'s reference, keyed as the real send is), ``sum ||x||^2``,
and the bytes ``b`` bits would have sent — and the probe must change nothing that is sent, and
its wire seconds must not include a late rank's skew.
With ``probe_rows = cap`` below the rows sent, the documented sample instead: rows
``0, k, 2k, ...`` (``k = ceil(R / cap)``) quantised as one buffer with the same key, the sums
scaled by ``R / sampled``; bytes stay the whole send's. This file is also the MPI worker.
"""
from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import CSBM, run_mpi
from test_codecs import ref_quant
from test_exchange_exact import f, mix, w

WIDTH, SEED, LAYER, EPOCH = 6, 5, 1, 3
SKEW_S = 0.4      # the last rank's late arrival at the probed exchange
BITS = (1, 2, 4, 8)


def row_bytes(bits: int) -> int:
    """The documented wire size of one row: fp32, or lo (4) + step (2) + packed codes."""
    return 4 * WIDTH if bits == 32 else 6 + -(-WIDTH * bits // 8)


def expected(shard_dir: Path, rank: int, direction: int, cap: int = 0) -> dict:
    """norm2, error2 and bytes per candidate of the rows ``rank`` sends in ``direction``
    (``cap``: of the documented sample of them, scaled up)."""
    from hpcgnn.data.shard import read_shard
    s = read_shard(shard_dir / f"part-{rank:05d}.h5")
    cols = np.arange(WIDTH)
    rows = (f(s.global_id[s.send_index], cols) if direction == 0      # packed boundary rows
            else w(rank, s.halo_global_id, cols)).astype(np.float32)  # halo gradients back
    key = mix(SEED, EPOCH, LAYER, direction, rank)
    total = rows.shape[0]
    sample = rows[::-(-total // cap)] if 0 < cap < total else rows
    scale = total / sample.shape[0]
    x = sample.astype(np.float64)
    err = {b: scale * float(((ref_quant(sample, b, key).astype(np.float64) - x) ** 2).sum())
           for b in BITS}
    return {"norm2": scale * float((x ** 2).sum()), "error2": err, "rows": total,
            "bytes": {b: total * row_bytes(b) for b in (*BITS, 32)}}


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,cap", [(2, 0), (3, 0), (3, 50)])
def test_probe_measures_the_documented_error_of_the_sent_rows(ranks, cap, shards, tmp_path):
    shard_dir = shards(CSBM, ranks, "random")
    proc = run_mpi(ranks, [__file__, str(shard_dir), str(tmp_path), str(cap)], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(ranks):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        assert got["same_as_unprobed"], f"rank {r}: probing changed what was sent"
        for d in (0, 1):
            want, fig = expected(shard_dir, r, d, cap), got["probes"][str(d)]
            if cap:
                assert want["rows"] > 2 * cap, "the sampled case must sample"
            assert fig["norm2"] == pytest.approx(want["norm2"], rel=1e-9)
            for b in BITS:
                assert fig["error2"][str(b)] == pytest.approx(want["error2"][b], rel=1e-5), (r, d, b)
                assert 0 < fig["error2"][str(b)] / fig["norm2"] < 4.0
            assert {int(b): v for b, v in fig["bytes"].items()} == want["bytes"]
            errs = [fig["error2"][str(b)] for b in BITS]
            assert errs == sorted(errs, reverse=True)          # more bits, less error
        # one wire sample per direction: this rank's fp32 bytes, a positive time
        assert [s[:3] for s in got["wire"]] == [[LAYER, 0, got["bytes_fwd"]],
                                                [LAYER, 1, got["bytes_bwd"]]]
        assert all(s[3] > 0 and s[4] >= 0 for s in got["wire"])
        # the last rank arrived SKEW_S late at the probed exchange: a probed exchange starts
        # aligned, so no rank's wire seconds carry that wait (it would pass for a cost per byte)
        assert all(s[3] < SKEW_S / 2 for s in got["wire"]), (r, got["wire"])
    # what every rank decides from (autotuning.reduce_figures): the errors and norms summed
    # over the ranks, the bytes the largest rank's
    for d, name in enumerate(("forward", "backward")):
        want = [expected(shard_dir, r, d, cap) for r in range(ranks)]
        for r in range(ranks):
            fig = json.loads((tmp_path / f"{r}.json").read_text())["reduced"][name]
            assert fig["norm2"] == pytest.approx(sum(x["norm2"] for x in want), rel=1e-9)
            for b in BITS:
                assert fig["error2"][str(b)] == pytest.approx(
                    sum(x["error2"][b] for x in want), rel=1e-5), (r, name, b)
            assert fig["bytes"] == {str(b): max(x["bytes"][b] for x in want) for b in (*BITS, 32)}


def _exchange(ctx, shard, exch, settings):
    import torch

    exch.stats.reset()
    cols = np.arange(WIDTH)
    x = torch.tensor(f(shard.global_id, cols), dtype=torch.float32, requires_grad=True)
    halo = exch.exchange(x, settings)
    weight = torch.tensor(w(ctx.rank, shard.halo_global_id, cols), dtype=torch.float32)
    (halo * weight).sum().backward()
    return copy.deepcopy(exch.stats), halo.detach(), x.grad


def _worker(shard_dir: str, out: str, cap: int) -> None:
    import torch

    from hpcgnn.codecs import IDENTITY, WireCodec
    from hpcgnn.comm.context import CommContext
    from hpcgnn.comm.exchange import ExchangeSettings, ExchangeStats, HaloExchanger
    from hpcgnn.comm.plan import HaloPlan
    from hpcgnn.train.inputs import load_part
    ctx = CommContext.from_world("cpu")
    _, shard = load_part(shard_dir, ctx.rank, ctx.size)
    plan = HaloPlan.from_shard(shard)
    cands = tuple(WireCodec(bits=b) for b in BITS)
    # one exchanger for both calls: its first exchange sets up the layouts (collective), the
    # probed one is then an exchange like any in training
    exch = HaloExchanger(ctx, plan, layer=LAYER, seed=SEED, stats=ExchangeStats())
    plain = _exchange(ctx, shard, exch, ExchangeSettings(EPOCH, IDENTITY, IDENTITY))
    if ctx.rank == ctx.size - 1:         # one rank's compute ran long (skew, not the wire)
        time.sleep(SKEW_S)
    stats, halo, grad = _exchange(ctx, shard, exch, ExchangeSettings(
        EPOCH, IDENTITY, IDENTITY, probe=cands, probe_backward=cands, probe_rows=cap))
    probes = {str(d): {"norm2": fig.norm2,
                       "error2": {str(c.bits): v for c, v in fig.error2.items() if c.bits != 32},
                       "bytes": {str(c.bits): v for c, v in fig.bytes.items()}}
              for (layer, d), fig in stats.probes.items() if layer == LAYER}
    from hpcgnn.train.autotuning import reduce_figures
    figures = reduce_figures(ctx, stats, [(LAYER, d, cands) for d in (0, 1)])
    reduced = {name: {"norm2": fig.norm2, "error2": {str(b): v for b, v in fig.error2.items()},
                      "bytes": {str(b): v for b, v in fig.bytes.items()}}
               for (layer, name), fig in figures.exchanges.items()}
    Path(out, f"{ctx.rank}.json").write_text(json.dumps({
        "probes": probes, "reduced": reduced, "wire": [[s.layer, s.direction, s.bytes, s.seconds, s.compute_s] for s in stats.wire],
        "bytes_fwd": sum(plan.send_counts) * WIDTH * 4,
        "bytes_bwd": sum(plan.recv_counts) * WIDTH * 4,
        "same_as_unprobed": bool(torch.equal(halo, plain[1]) and torch.equal(grad, plain[2])
                                 and stats.bytes_sent == plain[0].bytes_sent)}))
    print(f"rank {ctx.rank}: done", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
