"""How a rank's process allocates the memory a training step frees and asks for again.

A training step allocates the same large temporaries every epoch (a layer's dropped input, its
sparse product, their gradients: megabytes each on the development cSBM, hundreds of megabytes
on a 1M-node shard) and frees them before the next. With glibc's and torch's defaults the next
epoch's blocks are new pages that the kernel faults in and zeroes one 4 KiB page at a time:
glibc serves a block above its mmap threshold (which rises with freed blocks, to at most
32 MiB) with ``mmap`` and unmaps it when freed, and trims the top of its heap when more than
twice that threshold is free there.

``configure`` (called by ``hpcgnn train`` and ``hpcgnn predict`` before torch is imported)
applies ``HPCGNN_MALLOC``:

- ``tuned`` (the default): glibc's mmap threshold fixed at its largest, 32 MiB
  (``M_MMAP_THRESHOLD``), and the heap never trimmed (``M_TRIM_THRESHOLD = -1``), so blocks below
  32 MiB are reused from the heap epoch after epoch; and torch's transparent-huge-page
  allocation (``THP_MEM_ALLOC_ENABLE=1``, unless the environment sets it): blocks of 2 MiB and
  more are 2 MiB-aligned and ``madvise(MADV_HUGEPAGE)``, so the larger ones, still mapped and
  unmapped every epoch, fault in one 2 MiB page at a time. Where the kernel's THP mode is
  ``never`` that part does nothing.
- ``heap``: every block from the heap (``M_MMAP_MAX = 0``) and the heap never trimmed, with
  torch's THP allocation as above: no block is ever given back, so none faults again, but
  torch's aligned blocks (``posix_memalign``, which cannot reuse a free chunk of exactly a
  block's size) fragment the heap: on a 1M-node shard the peak resident set was 2.0x
  ``tuned``'s.
- ``system``: glibc's and torch's defaults.

Measured on the development machine (``bench/results/malloc-modes-2core-2026-11-26.md``): one
rank of a 1M-node GraphSAGE epoch took 18.0 s with ``system``, 15.6 s with ``tuned`` (5.0 GiB
peak resident set either way) and 12.5 s with ``heap`` (10.2 GiB); on a 200k-node graph
``tuned`` and ``heap`` stepped 0.68-0.82x ``system``'s time.

Other C libraries are left alone (``state()`` says what applied; ``summary.json`` records it).
"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4     # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20      # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the largest it takes
ENV = "HPCGNN_MALLOC"
THP_ENV = "THP_MEM_ALLOC_ENABLE"   # read by torch (c10) at its first allocation
CHOICES = ("tuned", "heap", "system")

_state = {"malloc": "unset", "thp": False}   # what configure did (unset: not called)


def state() -> dict:
    """``{"malloc": tuned | heap | system | not glibc | unset, "thp": bool}``: what
    ``configure`` applied (``thp``: torch's huge-page allocation is on)."""
    return dict(_state)


def configure(environ=None) -> dict:
    """Apply ``HPCGNN_MALLOC`` (module doc) to this process; returns ``state()``. Call it before
    torch is imported: torch reads ``THP_MEM_ALLOC_ENABLE`` once, at its first allocation."""
    environ = os.environ if environ is None else environ
    choice = environ.get(ENV, "tuned").strip().lower() or "tuned"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={environ[ENV]!r}: use 'tuned' (the default: blocks under 32 MiB "
                         f"reused, larger ones in huge pages), 'heap' (every block kept: fastest, "
                         f"more memory) or 'system' (the C library's and torch's defaults)")
    _state["malloc"], _state["thp"] = choice, False
    if choice == "system":
        return state()
    if "torch" not in sys.modules:          # too late once torch has allocated
        environ.setdefault(THP_ENV, "1")
    _state["thp"] = environ.get(THP_ENV) == "1" and "torch" not in sys.modules
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        _state["malloc"] = "not glibc"
        return state()
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD) if choice == "tuned" else (M_MMAP_MAX, 0),
                (M_TRIM_THRESHOLD, -1))
    if not all(libc.mallopt(param, value) == 1 for param, value in settings):
        _state["malloc"] = "system"        # refused: glibc's defaults stay
    return state()
