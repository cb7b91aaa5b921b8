"""Measuring helpers shared by the GPU benchmarks (``bench/codecs.py``, ``bench/dropout.py``,
``bench/epoch.py``): best-of-N wall time of a call, kernel launches of a call (torch profiler),
and the device's own copy bandwidth, measured in the same run as the figures it is compared to.
On CPU the launch count is None and the copy bandwidth is a host ``copy_``'s.
"""
from __future__ import annotations

import time
from typing import Callable

import torch


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device, repeat: int, warmup: int = 2) -> float:
    """Best wall seconds of ``fn()`` over ``repeat`` calls, each synchronised, after ``warmup``
    (CUDA: the first calls compile and load kernels)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def streamed_time(fn: Callable[[], object], device, calls: int = 50, rounds: int = 5) -> float:
    """Wall seconds per call of ``calls`` calls of ``fn()`` issued back to back with one
    synchronisation at the end, best of ``rounds``: what a call costs in a stream of work, where
    its host side (Python, launches) overlaps the GPU's running of the calls before it. A
    ``best_time`` also counts one synchronisation and an idle GPU per call."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _device_events(fn: Callable[[], object], device) -> list:
    """The torch profiler's events of what one ``fn()`` puts on the GPU (CUPTI sees Triton's
    driver-API launches too); ``fn`` runs once before, so nothing compiles while profiled."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def launches(fn: Callable[[], object], device) -> dict | None:
    """``{"kernels", "memcpy", "memset"}``: what one ``fn()`` puts on the GPU, counted by the
    torch profiler; None on CPU."""
    if torch.device(device).type != "cuda":
        return None
    fn()                                            # compiled and cached before counting
    sync(device)
    counts = {"kernels": 0, "memcpy": 0, "memset": 0}
    for e in _device_events(fn, device):
        kind = "memcpy" if "Memcpy" in e.name else "memset" if "Memset" in e.name else "kernels"
        counts[kind] += 1
    return counts


def device_seconds(fn: Callable[[], object], device, repeat: int = 5) -> float | None:
    """GPU time of one ``fn()``: the summed durations of the kernels, copies and sets it puts on
    the device (torch profiler), least over ``repeat`` profiled calls; None on CPU. Unlike a
    wall-clock time it leaves out the host side of the call (Python, launch overheads), which
    overlaps other GPU work in a training step."""
    if torch.device(device).type != "cuda":
        return None
    fn()
    sync(device)
    return min(sum(e.time_range.elapsed_us() for e in _device_events(fn, device)) / 1e6
               for _ in range(repeat))


def copy_bandwidth(device, nbytes: int = 1 << 28, repeat: int = 10) -> float:
    """Bytes per second moved by ``dst.copy_(src)`` on ``device`` (read + write: 2 x nbytes)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_time(lambda: dst.copy_(src), device, repeat)


def device_name(device) -> str:
    if torch.device(device).type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu, one thread"
