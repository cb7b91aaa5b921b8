"""GPU buffers and MPI, through real ranks (all skipped without CUDA):

- stream ordering: a kernel still writing the send buffer when the host goes on must not be
  read by MPI, and a received host buffer must not be overwritten while its asynchronous copy
  to the device is still reading it. Each check runs a control first (the same steps with the
  wait left out) that must see the wrong bytes, so the test could catch a missing sync;
- the staging pool: page-locked buffers, reused across epochs of a real exchange;
- staged and CUDA-aware training give the same bytes and the same losses, bit for bit, for
  every codec family, the neighbourhood and rounds transports and staleness (needs a
  CUDA-aware MPI: ``env/cuda-aware-openmpi.sh`` or the site's; bit for bit where two staged
  runs repeat each other bit for bit, else to 1e-5).
"""
from __future__ import annotations

import sys

import pytest
import torch

from conftest import CSBM, check_ok, read_metrics, run_mpi, train

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SLEEP_CYCLES = int(5e8)          # ~0.3 s of GPU clock: the host is far ahead when it looks


@pytest.mark.gpu
@pytest.mark.mpi
@needs_cuda
@pytest.mark.parametrize("aware", ["0", "1"], ids=["staged", "cuda-aware"])
def test_mpi_never_reads_a_buffer_a_kernel_is_still_writing(aware):
    from hpcgnn.comm import gpu
    if aware == "1" and not gpu.mpi_is_cuda_aware():
        pytest.skip("this MPI library is not CUDA-aware")
    proc = run_mpi(2, [__file__, "order"], timeout=180, env={gpu.ENV_CUDA_AWARE: aware})
    check_ok(proc)
    assert proc.stdout.count("stream order ok") == 2


@pytest.mark.gpu
@pytest.mark.mpi
@needs_cuda
def test_staging_buffers_are_pinned_and_kept_across_epochs(shards):
    from hpcgnn.comm import gpu
    proc = run_mpi(2, [__file__, "pool", str(shards(CSBM, 2, "random"))], timeout=180,
                   env={gpu.ENV_CUDA_AWARE: "0"})
    check_ok(proc)
    assert proc.stdout.count("pool ok") == 2


CASES = {   # name: (schedule or None, --set overrides, environment)
    "full": (None, (), {}),
    "quant2": ("quant2-all", (), {}),
    "varco-quant2": ("varco-quant2-all", (), {}),
    "sample-quant2": ("sample-quant2-all", (), {}),
    "neighbor": ("quant4-all", (), {"HPCGNN_EXCHANGE": "neighbor"}),
    "rounds": (None, (), {"HPCGNN_MAX_MESSAGE": "900"}),
    "stale": ("quant1-all", ("train.staleness=1",), {}),
}


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.slow
@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_staged_and_cuda_aware_train_bit_for_bit(case, shards, tmp_path):
    """Same bytes, and the same losses bit for bit -- where the GPU repeats itself: two staged
    runs are compared first; if they differ (non-deterministic kernels, e.g. atomics in
    index_add_), bit for bit cannot be asked of the CUDA-aware run, and 1e-5 relative is."""
    from hpcgnn.comm import gpu
    if not gpu.mpi_is_cuda_aware():
        pytest.skip("this MPI library is not CUDA-aware")
    schedule, sets, env = CASES[case]
    extra = ("--device", "cuda") + (("--schedule", f"configs/schedules/{schedule}.toml") if schedule else ())
    runs = {}
    for name, aware in (("staged", "0"), ("staged-again", "0"), ("cuda-aware", "1")):
        # the cSBM's features are signed: no row normalisation (refused at start-up)
        proc = train(2, shards(CSBM, 2, "random"), tmp_path / name, "train.epochs=12",
                     "data.normalize_features=false", *sets,
                     config="configs/cora.toml", extra=extra, timeout=300,
                     env={gpu.ENV_CUDA_AWARE: aware, **env})
        check_ok(proc)
        runs[name] = read_metrics(tmp_path / name)
    repeats = [r["loss"] for r in runs["staged"]] == [r["loss"] for r in runs["staged-again"]]
    assert len(runs["staged"]) == len(runs["cuda-aware"]) == 12
    for staged, direct in zip(runs["staged"], runs["cuda-aware"]):
        assert staged["bytes_sent"] == direct["bytes_sent"], (case, staged["epoch"])
        if repeats:
            assert staged["loss"] == direct["loss"], (case, staged["epoch"])
        else:
            assert staged["loss"] == pytest.approx(direct["loss"], rel=1e-5), (case, staged["epoch"])


# -- the workers (run on every rank) -------------------------------------------------------------
def _late_write(buf: torch.Tensor, value: float) -> None:
    """Queue a write of ``value`` into ``buf`` behind a GPU sleep on the current stream."""
    torch.cuda._sleep(SLEEP_CYCLES)
    buf.fill_(value)


def _order_worker() -> None:
    from mpi4py import MPI

    from hpcgnn.comm import gpu
    from hpcgnn.comm.context import CommContext
    ctx = CommContext.from_world("cuda")
    me, size, n = ctx.rank, ctx.size, 1 << 20
    buf = torch.zeros(n * size, device=ctx.device)
    torch.cuda.synchronize()
    pool = gpu.PinnedPool()
    want = (torch.arange(size, device=ctx.device, dtype=torch.float32) + 100).repeat_interleave(n)
    side = torch.cuda.Stream(ctx.device)      # non-blocking: no implicit sync with other streams
    with torch.cuda.stream(side):
        _controls(pool, buf, me, ctx.device)
        # the send buffer is still being written when to_mpi is called
        _late_write(buf, 100 + me)
        send = gpu.to_mpi(buf, ctx.cuda_aware, pool, "s")
        recv, recvbuf = gpu.recv_buffer(buf.numel(), buf.dtype, ctx.device, ctx.cuda_aware, pool, "r")
        ctx.comm.Alltoall([send, MPI.FLOAT], [recvbuf, MPI.FLOAT])
        torch.cuda._sleep(SLEEP_CYCLES)           # the copy back to the device starts late
        got = gpu.from_mpi(recv, ctx.device, pool)
        if not ctx.cuda_aware:                    # the next receive into the slot must wait for
            pool.take("r", recv.numel(), recv.dtype).fill_(-1)      # that copy, then overwrite
        assert torch.equal(got, want), "received bytes differ from what the peers wrote last"
    print(f"rank {me}: stream order ok", flush=True)


def _controls(pool, buf: torch.Tensor, me: int, device) -> None:
    """The same steps with the wait left out must see the wrong bytes: else this test could not
    tell a missing sync from a present one (the GPU would not be behind the host)."""
    _late_write(buf, me + 1)
    host = pool.take("control", buf.numel(), buf.dtype)
    host.copy_(buf, non_blocking=True)                   # staged send without the wait
    assert not bool((host == me + 1).all()), "control: the late write was already visible"
    torch.cuda.current_stream(device).synchronize()
    host.fill_(7)
    torch.cuda._sleep(SLEEP_CYCLES)
    early = host.to(device, non_blocking=True)          # receive without holding the buffer
    host.fill_(-1)
    torch.cuda.current_stream(device).synchronize()
    assert not bool((early == 7).all()), "control: the async copy had already read the buffer"


def _pool_worker(shard_dir: str) -> None:
    from hpcgnn.codecs import WireCodec
    from hpcgnn.comm.context import CommContext
    from hpcgnn.comm.exchange import ExchangeSettings, ExchangeStats, HaloExchanger
    from hpcgnn.comm.plan import HaloPlan
    from hpcgnn.train.inputs import load_part
    ctx = CommContext.from_world("cuda")
    assert not ctx.cuda_aware
    _, shard = load_part(shard_dir, ctx.rank, ctx.size)
    plan = HaloPlan.from_shard(shard, ctx.device)
    exch = HaloExchanger(ctx, plan, layer=0, seed=0, stats=ExchangeStats(), overlap=True)
    want = torch.as_tensor(shard.halo_global_id, dtype=torch.float32, device=ctx.device)
    x = torch.as_tensor(shard.global_id, dtype=torch.float32, device=ctx.device)[:, None].repeat(1, 8)
    ptrs = None
    for epoch in range(6):                                   # the same exchange every epoch
        halo = exch.exchange(x.clone().requires_grad_(True), ExchangeSettings(epoch))
        halo.sum().backward()
        assert torch.equal(halo[:, 0], want)
        now = {k: b.untyped_storage().data_ptr() for k, b in exch._pinned._buffers.items()}
        assert all(b.is_pinned() for b in exch._pinned._buffers.values())
        ptrs = ptrs or now
        assert now == ptrs, f"epoch {epoch}: staging buffers were reallocated"
    grow = HaloExchanger(ctx, plan, layer=1, seed=0, stats=ExchangeStats())
    for epoch, k in enumerate(range(1, 9)):                  # a growing exchange: k of 8 channels
        settings = ExchangeSettings(epoch, WireCodec(channels="truncate", k=k))
        assert torch.equal(grow.exchange(x, settings)[:, :k], want[:, None].expand(-1, k))
    # k = 1, 2, 3, 5 outgrow the send and the receive slot (doubling): 4 allocations each
    assert grow._pinned.allocations == 8, grow._pinned.allocations
    print(f"rank {ctx.rank}: pool ok", flush=True)


if __name__ == "__main__":
    {"order": lambda: _order_worker(), "pool": lambda: _pool_worker(sys.argv[2])}[sys.argv[1]]()
