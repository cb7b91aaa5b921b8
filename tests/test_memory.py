"""``hpcgnn.memory``: with freed memory kept, a block freed and allocated again every epoch costs
no page faults once the heap holds it; with glibc's defaults (``HPCGNN_MALLOC=system``) a block
above glibc's largest mmap threshold (32 MiB) is mapped and faulted in again every time. The
kept heap does not grow without bound. Each mode in its own process (``mallopt`` is
process-wide and cannot be undone)."""
import ctypes
import os
import subprocess
import sys

import pytest

GLIBC = hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
MB = 64                                  # above glibc's DEFAULT_MMAP_THRESHOLD_MAX (32 MiB)
WARM, MEASURED = 40, 3
PROBE = f"""
import resource, sys, torch
from hpcgnn import memory
print(memory.keep_freed_memory(), file=sys.stderr)
n = {MB} * 2**20 // 4

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

start = rss_mb()
for _ in range({WARM}):                  # torch's 64-byte-aligned blocks: glibc's memalign
    x = torch.empty(n); x.fill_(1.0); del x
grown = rss_mb() - start
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({MEASURED}):              # the steady state: the same block every 'epoch'
    x = torch.empty(n); x.fill_(1.0); del x
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, grown)
"""


def _probe(mode: str) -> tuple[int, float, str]:
    env = {**os.environ, "HPCGNN_MALLOC": mode}
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          check=True)
    faults, grown = proc.stdout.split()[-2:]
    return int(faults), float(grown), proc.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults_and_the_heap_is_bounded():
    kept, grown, mode = _probe("keep")
    assert mode == "keep"
    system, _, mode = _probe("system")
    assert mode == "system"
    pages = MEASURED * MB * 2**20 // 4096
    assert kept < pages // 20, f"{kept} faults for a block freed and allocated again"
    assert system > pages // 2, f"glibc's defaults: only {system} faults of {pages} pages"
    # memalign cannot reuse a free chunk of exactly the block's size, so the heap holds a few
    # blocks before they coalesce (8 here, on glibc 2.36); an unbounded leak would be 40
    assert grown < 16 * MB, f"the kept heap grew by {grown:.0f} MiB over {WARM} blocks of {MB}"


def test_a_bad_value_ends_the_command_and_names_the_variable(tmp_path):
    env = {**os.environ, "HPCGNN_MALLOC": "jemalloc"}
    proc = subprocess.run([sys.executable, "-m", "hpcgnn", "train", "--shards", str(tmp_path)],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "HPCGNN_MALLOC='jemalloc'" in proc.stderr and "'system'" in proc.stderr
