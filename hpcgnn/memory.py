"""Keep the memory a training step frees for the next step (glibc's malloc).

A training step allocates the same large temporaries every epoch (a layer's dropped input, its
sparse product, their gradients: megabytes each on the development cSBM, gigabytes on a large
shard) and frees them before the next. glibc's malloc hands blocks above its mmap threshold to
``mmap`` and gives them back with ``munmap``, and trims the top of its heap when more than its
trim threshold is free there; either way the next epoch's allocation of the same size faults
every page in again, and the kernel zeroes each page. Measured on the development machine
(``bench/results/malloc-2core-2026-11-26.md``, paired runs): on a 200k-node cSBM over 2 ranks a
step took 0.76x (full communication), 0.81x (synchronous 1-bit) and 0.77x (staleness 1) of its
time with glibc's defaults; on the 20k-node cSBM over 4 ranks at 1 Gbit/s, 0.91x and 0.97x.

``keep_freed_memory`` (called by ``hpcgnn train`` and ``hpcgnn predict`` before anything
large is allocated) sets, through ``mallopt``, ``M_MMAP_MAX = 0`` (no block is served by
``mmap``, so none is unmapped when freed; glibc still falls back to ``mmap`` where the heap
cannot grow) and ``M_TRIM_THRESHOLD = -1`` (the heap is never trimmed). The process then keeps
its peak allocation until it ends, which a batch job that reaches the same peak every epoch
does anyway; torch's aligned blocks fragment the kept heap somewhat (the trainer's peak resident
set was 0.98-1.10x glibc's in the runs above). ``HPCGNN_MALLOC=system`` leaves glibc's
defaults; other C libraries are left alone (``mode`` says which applied).
"""
from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4      # glibc's malloc.h
ENV = "HPCGNN_MALLOC"
CHOICES = ("keep", "system")

mode = "unset"      # what keep_freed_memory did: keep | system | not glibc | unset (not called)


def keep_freed_memory(environ=None) -> str:
    """Make glibc's malloc keep freed memory (module doc); returns and records in ``mode``
    what applied: ``keep``, ``system`` (``HPCGNN_MALLOC=system``) or ``not glibc``."""
    global mode
    environ = os.environ if environ is None else environ
    choice = environ.get(ENV, "keep").strip().lower() or "keep"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={environ[ENV]!r}: use 'keep' (the default: freed memory stays "
                         f"in the process) or 'system' (the C library's defaults)")
    if choice == "system":
        mode = "system"
        return mode
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        mode = "not glibc"
        return mode
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    if libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, -1) != 1:
        mode = "system"                    # refused: glibc's defaults stay
        return mode
    mode = "keep"
    return mode
