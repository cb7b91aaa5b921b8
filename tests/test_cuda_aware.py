"""CUDA-awareness: how it is decided and what ``hpcgnn info`` says, against the real MPI
libraries of this machine, and the staging pool's reuse rules (CPU; the stream ordering of the
staged path is checked on GPUs in test_staging_gpu.py).

Other MPI builds are checked when their venv's interpreter is named:
``HPCGNN_TEST_MPICH_PYTHON`` (MPICH from pip, e.g. a venv made with ``HPCGNN_MPI=mpich``) and
``HPCGNN_TEST_CUDA_OMPI_PYTHON`` (the venv of ``env/cuda-aware-openmpi.sh build``).
"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
MPICH_PY = os.environ.get("HPCGNN_TEST_MPICH_PYTHON")
CUDA_OMPI_PY = os.environ.get("HPCGNN_TEST_CUDA_OMPI_PYTHON")


def info(python: str = sys.executable, env: dict | None = None) -> tuple[int, dict[str, str], str]:
    """(rc, ``key: value`` lines, stderr) of ``python -m hpcgnn info`` run from the repository."""
    run_env = {k: v for k, v in os.environ.items() if k != "HPCGNN_CUDA_AWARE"}
    run_env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **(env or {})})
    proc = subprocess.run([python, "-m", "hpcgnn", "info"], capture_output=True, text=True,
                          timeout=180, cwd=REPO, env=run_env, stdin=subprocess.DEVNULL)
    lines = dict(re.findall(r"^\s*([\w -]+?): (.*)$", proc.stdout, re.M))
    return proc.returncode, lines, proc.stderr


def ompi_info_built(tool: Path) -> str:
    """What ``ompi_info --parsable --all`` says about CUDA, read here, apart from hpcgnn's parser."""
    out = subprocess.run([str(tool), "--parsable", "--all"], capture_output=True, text=True,
                         timeout=120).stdout
    values = {line.rsplit(":", 1)[1] for line in out.splitlines()
              if "built_with_cuda_support:value:" in line}
    assert len(values) == 1, values
    return values.pop()


def test_setting_decides_and_says_so(monkeypatch):
    from hpcgnn.comm import gpu
    for value, want in (("1", True), ("0", False), (" 1 ", True)):
        monkeypatch.setenv(gpu.ENV_CUDA_AWARE, value)
        got = gpu.cuda_awareness()
        assert got.aware is want and gpu.mpi_is_cuda_aware() is want
        assert f"{gpu.ENV_CUDA_AWARE}={value.strip()}" in got.how and got.built is None


def test_bad_setting_is_refused_naming_the_variable_and_the_fix(monkeypatch):
    from hpcgnn.comm import gpu
    monkeypatch.setenv(gpu.ENV_CUDA_AWARE, "yes")
    with pytest.raises(RuntimeError, match=r"HPCGNN_CUDA_AWARE='yes': use 1 .* or 0"):
        gpu.cuda_awareness()
    rc, lines, err = info(env={gpu.ENV_CUDA_AWARE: "true"})
    assert rc == 2 and "HPCGNN_CUDA_AWARE='true'" in err and "Traceback" not in err and not lines


def test_pip_open_mpi_says_no_at_run_time():
    """The PyPI Open MPI 5 is built without CUDA: its run-time query answers 0 and its
    compile-time flag is false; ompi_info (read by the test itself) agrees."""
    from mpi4py import MPI

    from hpcgnn.comm import gpu
    name = MPI.Get_library_version()
    if not name.startswith("Open MPI v5"):
        pytest.skip(f"this venv's MPI is not Open MPI 5: {name.splitlines()[0]}")
    got = gpu.cuda_awareness()
    assert (got.aware, got.built, got.runtime) == (False, False, False)
    assert got.how.startswith("MPIX_Query_cuda_support() = 0: Open MPI 5's run-time answer")
    assert ompi_info_built(Path(sys.executable).parent / "ompi_info") == "false"


def test_info_names_the_library_its_file_and_the_rule():
    from mpi4py import MPI
    rc, lines, err = info()
    assert rc == 0, err
    assert lines["mpi library"] == MPI.Get_library_version().splitlines()[0].split(", package")[0].strip()
    assert "libmpi" in lines["loaded from"]
    assert lines["cuda-aware mpi"] in ("yes", "no")
    if lines["mpi library"].startswith("Open MPI v5"):
        assert lines["cuda-aware mpi"] == "no" and lines["built with cuda"] == "no"
        assert "run-time answer" in lines["decided by"]
        assert lines["ompi_info"].startswith("built_with_cuda_support = false (")
    rc, lines, _ = info(env={"HPCGNN_CUDA_AWARE": "1"})
    assert rc == 0 and lines["cuda-aware mpi"] == "yes"
    assert lines["decided by"] == "set by HPCGNN_CUDA_AWARE=1 (the library was not asked)"
    if lines["mpi library"].startswith("Open MPI v5"):
        # the override decides, but what the library was built with is still read and shown:
        # it is what a user checks the override against
        assert lines["built with cuda"] == "no"


@pytest.mark.skipif(not MPICH_PY, reason="set HPCGNN_TEST_MPICH_PYTHON to an MPICH venv's python")
def test_mpich_asks_its_gpu_query():
    rc, lines, err = info(MPICH_PY)
    assert rc == 0, err
    assert lines["mpi library"].startswith("MPICH")
    assert lines["decided by"].startswith("MPIX_GPU_query_support(CUDA) = ")
    assert "ompi_info" not in lines
    flag = int(lines["decided by"].split("= ")[1].split(":")[0])
    assert lines["cuda-aware mpi"] == ("yes" if flag else "no")


def libcuda_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(not CUDA_OMPI_PY, reason="set HPCGNN_TEST_CUDA_OMPI_PYTHON to the venv of "
                                             "env/cuda-aware-openmpi.sh build")
def test_cuda_built_open_mpi_4_answers_at_compile_time_and_obeys_its_switch():
    """Open MPI 4 built --with-cuda: MPIX_Query_cuda_support() is its compile-time answer (1),
    ompi_info says built with CUDA; it is CUDA-aware only while its run-time switch
    opal_cuda_support is on, which MPI_Init turns off where libcuda.so.1 cannot be loaded (a
    machine without a CUDA driver) and --mca opal_cuda_support 0 turns off anywhere."""
    rc, lines, err = info(CUDA_OMPI_PY)
    assert rc == 0, err
    assert lines["mpi library"].startswith("Open MPI v4.")
    assert lines["decided by"].startswith("MPIX_Query_cuda_support() = 1: Open MPI 4's compile-time answer")
    assert lines["built with cuda"] == "yes"
    assert ompi_info_built(Path(CUDA_OMPI_PY).parent / "ompi_info") == "true"
    assert lines["ompi_info"].startswith("built_with_cuda_support = true (")
    driver = libcuda_loads()
    assert lines["cuda-aware mpi"] == ("yes" if driver else "no")
    assert ("opal_cuda_support = on" if driver else "opal_cuda_support = off") in lines["decided by"]
    rc, lines, err = info(CUDA_OMPI_PY, env={"OMPI_MCA_opal_cuda_support": "0"})
    assert rc == 0, err
    assert lines["cuda-aware mpi"] == "no" and "opal_cuda_support = off" in lines["decided by"]


def _open_mpi_globals(tmp_path: Path, built: int, switch: int) -> ctypes.CDLL:
    """A real shared library exporting what an Open MPI built without its ``cuda`` extension
    exports about CUDA: the globals ``opal_built_with_cuda_support`` and ``opal_cuda_support``
    (C ``bool``), and no ``MPIX_Query_cuda_support``."""
    import shutil
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler")
    src, lib = tmp_path / f"opal{built}{switch}.c", tmp_path / f"libopal{built}{switch}.so"
    src.write_text("#include <stdbool.h>\n"
                   f"bool opal_built_with_cuda_support = {built};\nbool opal_cuda_support = {switch};\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    return ctypes.CDLL(str(lib))


def test_open_mpi_without_its_query_obeys_the_switch_and_open_mpi_5_is_not_assumed(tmp_path):
    """Without ``MPIX_Query_cuda_support`` (an Open MPI built without its cuda extension), the
    compile-time flag alone is not enough: Open MPI 4 is CUDA-aware only while its run-time
    switch ``opal_cuda_support`` is on (off: ``--mca opal_cuda_support 0``, or no libcuda.so.1),
    and Open MPI 5, which decides at run time, cannot be asked: staged, with the override named.
    Device buffers handed to a library whose CUDA support is off are read as host memory."""
    from hpcgnn.comm import gpu
    off = gpu._open_mpi("Open MPI v4.1.4", [_open_mpi_globals(tmp_path, 1, 0)])
    assert (off.aware, off.built, off.runtime) == (False, True, False)
    assert "opal_cuda_support = off" in off.how and "no MPIX_Query_cuda_support" in off.how
    on = gpu._open_mpi("Open MPI v4.1.4", [_open_mpi_globals(tmp_path, 1, 1)])
    assert (on.aware, on.built, on.runtime) == (True, True, True)
    assert "opal_cuda_support = on" in on.how
    five = gpu._open_mpi("Open MPI v5.0.11", [_open_mpi_globals(tmp_path, 1, 0)])
    assert five.aware is False and five.built is True
    assert "Open MPI 5" in five.how and f"{gpu.ENV_CUDA_AWARE}=1" in five.how
    none = gpu._open_mpi("Open MPI v4.1.4", [_open_mpi_globals(tmp_path, 0, 0)])
    assert none.aware is False and none.built is False


# -- the staging pool ---------------------------------------------------------------------------
def test_pool_reuses_a_slot_and_grows_it_once():
    """Same slot, same or smaller size: the same memory, no allocation. A larger request
    reallocates once, to twice the old size, which then serves the sizes that follow."""
    from hpcgnn.comm.gpu import PinnedPool
    pool = PinnedPool(pinned=torch.cuda.is_available())
    ptr = lambda t: t.untyped_storage().data_ptr()        # noqa: E731
    a = pool.take("r0", 100, torch.uint8)
    assert a.numel() == 100 and pool.allocations == 1
    for n in (100, 60, 100):                               # epochs of the same exchange
        assert ptr(pool.take("r0", n, torch.uint8)) == ptr(a) and pool.allocations == 1
    b = pool.take("r0", 150, torch.uint8)                  # the exchange grew
    assert b.numel() == 150 and pool.allocations == 2 and pool.buffer("r0").numel() == 200
    for n in (180, 200, 120, 151):                         # growth within the doubled buffer
        got = pool.take("r0", n, torch.uint8)
        assert got.numel() == n and ptr(got) == ptr(b)
    assert pool.allocations == 2
    pool.take("s0", 10, torch.uint8)                       # another slot: its own buffer
    assert pool.allocations == 3 and ptr(pool.take("r0", 5, torch.uint8)) == ptr(b)
    pool.take("s0", 4, torch.float32)                      # another dtype: reallocated to size
    assert pool.allocations == 4 and pool.buffer("s0").numel() == 4


def test_pool_grows_a_few_times_over_a_varco_schedule():
    """Channel counts k = F / r(t) of a linear VARCO schedule with slope 1 (F = 64, ratio 128 -> 1
    over 100 epochs): the byte count takes a dozen sizes and grows 64 times; the slot is
    reallocated at most log2(64) + 1 times."""
    from hpcgnn.comm.gpu import PinnedPool
    pool, rows, width = PinnedPool(pinned=torch.cuda.is_available()), 1000, 64
    sizes = []
    for t in range(100):
        ratio = max(1.0, 128 - t * 127 / 98)
        k = max(1, int(width // ratio))
        sizes.append(rows * k)
        pool.take("r1", rows * k, torch.uint8)
    assert len(set(sizes)) > 10 and max(sizes) == 64 * min(sizes)
    assert pool.allocations <= 7 and pool.buffer("r1").numel() >= max(sizes)


class _Copy:
    """Stands for the CUDA event of an asynchronous copy (no GPU here): ``done`` is whether the
    copy finished; ``synchronize`` waits for it (records the wait and finishes it)."""

    def __init__(self, log: list, name: str):
        self.log, self.name, self.done = log, name, False

    def synchronize(self) -> None:
        self.log.append(self.name)
        self.done = True


def test_pool_hands_out_a_held_slot_only_after_its_copy():
    """The staged receive's rule (``from_mpi`` holds the slot its asynchronous copy to the device
    reads): ``take`` of that slot waits for the copy first, also when the slot then grows; other
    slots do not wait; a view of the slot (the received bytes are ``buf[:n]``) holds the slot;
    a tensor of no slot waits at once. On GPUs, with real copies: test_staging_gpu.py."""
    from hpcgnn.comm.gpu import PinnedPool
    pool, log = PinnedPool(pinned=torch.cuda.is_available()), []
    recv = pool.take("r0", 100, torch.uint8)[:60]          # the bytes of one exchange
    pool.take("s0", 100, torch.uint8)
    copy = _Copy(log, "r0 copy")
    pool.hold(recv, copy)
    assert log == [] and not copy.done                      # the copy runs on
    pool.take("s0", 100, torch.uint8)
    assert log == []                                        # another slot: no wait
    again = pool.take("r0", 100, torch.uint8)
    assert log == ["r0 copy"] and copy.done                 # waited, then handed out
    pool.take("r0", 100, torch.uint8)
    assert log == ["r0 copy"]                               # waited once, not again
    late = _Copy(log, "r0 copy 2")
    pool.hold(again, late)
    pool.take("r0", 1000, torch.uint8)                      # grows: still waits first
    assert log[-1] == "r0 copy 2" and late.done and pool.allocations == 3
    stray = _Copy(log, "no slot")
    pool.hold(torch.zeros(4, dtype=torch.uint8), stray)
    assert log[-1] == "no slot"                             # not the pool's: waited at once
