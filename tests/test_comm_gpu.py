"""GPU side of the exchange: CUDA-awareness detection (runs everywhere) and, where CUDA is
available, the halo exchange on GPUs through real ranks (skipped cleanly without a GPU)."""
from __future__ import annotations

import sys

import pytest
import torch

from conftest import CSBM, run_mpi


def test_cuda_aware_setting_overrides_the_query(monkeypatch):
    from hpcgnn.comm import gpu
    monkeypatch.setenv(gpu.ENV_CUDA_AWARE, "1")
    assert gpu.mpi_is_cuda_aware() is True
    monkeypatch.setenv(gpu.ENV_CUDA_AWARE, "0")
    assert gpu.mpi_is_cuda_aware() is False
    monkeypatch.delenv(gpu.ENV_CUDA_AWARE)
    assert isinstance(gpu.mpi_is_cuda_aware(), bool)     # asked of the library itself


def test_cpu_device_without_cuda_request():
    from hpcgnn.comm import gpu
    assert gpu.pick_device(3, "cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert gpu.pick_device(0, "auto") == torch.device("cpu")
        with pytest.raises(RuntimeError, match="--device cpu"):
            gpu.pick_device(0, "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")
def test_no_gpu_names_its_cause_and_the_fix(monkeypatch):
    """``--device cuda`` where torch sees no GPU says why: a CPU-only torch build, GPUs hidden
    by CUDA_VISIBLE_DEVICES (a job that asked for none), or no GPU or driver for a CUDA build
    (it used to ask for a CUDA build of torch in every case)."""
    from hpcgnn.comm import gpu
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if torch.version.cuda is None:                      # this machine's torch: checked as it is
        with pytest.raises(RuntimeError, match=r"CPU-only build: install a CUDA build of torch; "
                                               r"or use --device cpu"):
            gpu.pick_device(0, "cuda")
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # a CUDA build on a node without a GPU
    with pytest.raises(RuntimeError, match=r"built for CUDA 13.0\) sees no GPU on this node: no "
                                           r"GPU, or no NVIDIA driver that supports CUDA 13.0"):
        gpu.pick_device(0, "cuda")
    for hidden in ("", "-1", "NoDevFiles"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        with pytest.raises(RuntimeError, match=rf"CUDA_VISIBLE_DEVICES={hidden!r} hides every "
                                               r"GPU from torch: ask the job for GPUs"):
            gpu.pick_device(0, "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")        # a GPU the node may not have
    with pytest.raises(RuntimeError, match=r"sees no GPU on this node with CUDA_VISIBLE_DEVICES="
                                           r"'7': it may name GPUs this node does not have "
                                           r"\(nvidia-smi -L lists them; .*\), or the node has no "
                                           r"GPU, or no NVIDIA driver that supports CUDA 13.0"):
        gpu.pick_device(0, "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")
def test_a_gpu_that_cannot_be_used_names_it_and_the_fix(monkeypatch):
    """A GPU torch sees but cannot use (busy in Exclusive_Process mode, in an error state) is
    refused where the rank picks it, naming the GPU and the fix, so that the start-up device
    agreement reports it on every rank (it used to fail later, in the trainer's build, as a
    bare CUDA error and a traceback on that rank alone). torch.cuda is faked: no GPU here."""
    from hpcgnn.comm import gpu

    def busy(index):
        raise RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable\n"
                           "CUDA kernel errors might be asynchronously reported")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", busy)
    with pytest.raises(RuntimeError, match=r"^GPU 1 \(node-local rank 3 takes GPU 3 mod 2\) "
                                           r"cannot be used: CUDA error: CUDA-capable device\(s\) "
                                           r"is/are busy or unavailable\. Fix: nvidia-smi .* or "
                                           r"use --device cpu$"):
        gpu.pick_device(3, "cuda")


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("aware,transport", [("0", {}), ("1", {}),
                                             ("0", {"HPCGNN_MAX_MESSAGE": "900"}),
                                             ("0", {"HPCGNN_EXCHANGE": "neighbor"})],
                         ids=["staged", "cuda-aware", "staged-rounds", "staged-neighbor"])
def test_exchange_on_gpus(aware, transport, shards):
    """Staged through pinned host buffers (0) and device buffers handed to MPI (1, only
    meaningful with a CUDA-aware MPI: skipped when the library says it is not), in one
    collective, in rounds, and as a neighbourhood collective."""
    from hpcgnn.comm import gpu
    if aware == "1" and not gpu.mpi_is_cuda_aware():
        pytest.skip("this MPI library is not CUDA-aware")
    proc = run_mpi(2, [__file__, str(shards(CSBM, 2, "random"))], timeout=180,
                   env={gpu.ENV_CUDA_AWARE: aware, **transport})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("gpu exchange ok") == 2


def _worker(shard_dir: str) -> None:
    from hpcgnn.comm.context import CommContext
    from hpcgnn.comm.exchange import ExchangeSettings, ExchangeStats, HaloExchanger
    from hpcgnn.comm.plan import HaloPlan
    from hpcgnn.train.inputs import load_part
    ctx = CommContext.from_world("cuda")
    _, shard = load_part(shard_dir, ctx.rank, ctx.size)
    plan = HaloPlan.from_shard(shard, ctx.device)
    for overlap in (True, False):
        exch = HaloExchanger(ctx, plan, layer=0, seed=0, stats=ExchangeStats(), overlap=overlap)
        x = torch.as_tensor(shard.global_id, dtype=torch.float32, device=ctx.device)[:, None]
        x = x.repeat(1, 3).requires_grad_(True)
        halo = exch.exchange(x, ExchangeSettings(0))
        want = torch.as_tensor(shard.halo_global_id, dtype=torch.float32, device=ctx.device)
        assert halo.device.type == "cuda" and torch.equal(halo[:, 0], want)
        halo.sum().backward()
        sent = torch.zeros(shard.n_owned, device=ctx.device)
        sent.index_add_(0, plan.send_index, torch.ones(plan.n_send, device=ctx.device))
        assert torch.equal(x.grad[:, 0], sent)          # one per peer the row was sent to
    _codecs_on_gpu_equal_cpu(ctx, shard)
    from mpi4py import MPI
    # autograd runs a CUDA backward on its device thread: MPI must allow calls from it
    assert MPI.Query_thread() >= MPI.THREAD_SERIALIZED
    print(f"rank {ctx.rank}: gpu exchange ok", flush=True)


def _codecs_on_gpu_equal_cpu(ctx, shard) -> None:
    """Every codec through the exchange on the GPU gives the CPU's halo rows and gradients
    (the CPU path is checked against an independent computation in test_exchange_exact)."""
    from dataclasses import replace

    from hpcgnn.codecs import WireCodec
    from hpcgnn.comm.exchange import ExchangeSettings, ExchangeStats, HaloExchanger
    from hpcgnn.comm.plan import HaloPlan
    cpu_ctx = replace(ctx, device=torch.device("cpu"), cuda_aware=False)
    codecs = [(WireCodec(keep=0.5), WireCodec()), (WireCodec(channels="random", k=3), WireCodec(bits=4)),
              (WireCodec(channels="truncate", k=2, bits=1), WireCodec(bits=2)),
              (WireCodec(keep=0.4, channels="random", k=5, bits=8), WireCodec(bits=1)),
              (WireCodec(bits=2), WireCodec(bits=2))]
    out = {}
    for c in (ctx, cpu_ctx):
        plan = HaloPlan.from_shard(shard, c.device)
        for i, (fwd, bwd) in enumerate(codecs):
            exch = HaloExchanger(c, plan, layer=1, seed=3, stats=ExchangeStats())
            x = torch.as_tensor(shard.global_id, dtype=torch.float32, device=c.device)[:, None]
            x = (x.repeat(1, 8) * torch.arange(1, 9, device=c.device) % 13).requires_grad_(True)
            halo = exch.exchange(x, ExchangeSettings(7, fwd, bwd))
            (halo * torch.arange(halo.numel(), device=c.device).reshape(halo.shape).sin()).sum().backward()
            out.setdefault(i, []).append((halo.detach().cpu(), x.grad.cpu()))
    for i, ((h_gpu, g_gpu), (h_cpu, g_cpu)) in out.items():
        assert torch.allclose(h_gpu, h_cpu, atol=1e-6), (i, codecs[i])
        assert torch.allclose(g_gpu, g_cpu, atol=1e-5, rtol=1e-5), (i, codecs[i])


if __name__ == "__main__":
    _worker(sys.argv[1])
