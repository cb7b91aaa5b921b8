"""The C kernels (``_native.c``) of CPU ranks, loaded with ctypes: the quantisation codec,
the counter-based dropout and the sparse-dense product of the layers (``spmm``: 2-3x torch's CSR
product at 8-128 channels on the partitions of the network benchmark, 5x and more on the tall
transposed halo blocks of the backward).

``env/setup.sh`` builds ``_native-<hash>.so`` beside this file (``native.ensure_built()``);
without it (no C compiler, a read-only install) the first use builds it in
``$XDG_CACHE_HOME/hpcgnn`` (written to a temporary name and renamed, so ranks racing on one
node never load half a file), and where no compiler exists the codecs fall back to the torch
path, which gives the same bytes, only slower (``HPCGNN_NATIVE=0`` forces that path).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("_native.c")
CFLAGS = ["-O3", "-march=x86-64-v2", "-ffp-contract=off", "-ffinite-math-only", "-fno-signed-zeros", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None | bool = None   # None: not tried yet; False: unavailable
_why: list[str] = []                     # why each place failed, when _lib is False


def _tag() -> str:
    return hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]


def _candidates() -> list[Path]:
    name = f"_native-{_tag()}.so"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hpcgnn"
    return [SOURCE.with_name(name), cache / name]


def build(target: Path) -> Path:
    """Compile ``_native.c`` to ``target`` (temporary name, then rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC", "cc")
    flags = CFLAGS if _machine_is_x86() else [f for f in CFLAGS if not f.startswith("-march")]
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _machine_is_x86() -> bool:
    return os.uname().machine in ("x86_64", "AMD64")


def _load() -> ctypes.CDLL | None:
    _why.clear()
    for path in _candidates():
        if not path.is_file():
            try:
                build(path)
            except (OSError, subprocess.CalledProcessError) as exc:
                err = (getattr(exc, "stderr", "") or str(exc)).strip().splitlines()
                _why.append(f"{path}: cannot build it ({err[0] if err else exc})")
                continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            _why.append(f"{path}: cannot load it ({exc})")
            continue
        i64, u32, p = ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p
        lib.hpcgnn_quant_encode.argtypes = [p, i64, i64, ctypes.c_int, u32, p, p]
        lib.hpcgnn_quant_decode.argtypes = [p, i64, i64, ctypes.c_int, p]
        lib.hpcgnn_quant_row_bytes.restype = i64
        lib.hpcgnn_dropout_keep.argtypes = [p, p, i64, i64, ctypes.c_uint64, p]
        lib.hpcgnn_dropout_apply.argtypes = [p, p, p, i64, i64, ctypes.c_uint64, ctypes.c_float, p]
        lib.hpcgnn_spmm.argtypes = [p, p, p, i64, i64, p, i64, p]
        lib.hpcgnn_spmm_sum2.argtypes = [p, p, p, p, p, p, p, p, i64, i64, i64, p, p]
        lib.hpcgnn_dropout_matmul.argtypes = [p, p, p, i64, i64, ctypes.c_uint64, ctypes.c_float,
                                              p, i64, p]
        lib.hpcgnn_dropout_matmul_backward.argtypes = [p, p, p, i64, i64, ctypes.c_uint64,
                                                       ctypes.c_float, p, i64, p, p, p]
        lib.hpcgnn_sample_rows.argtypes = [p, p, p, i64, p, p]
        lib.hpcgnn_sample_rows.restype = i64
        lib.hpcgnn_place_rows.argtypes = [p, p, p, i64, i64, i64, p]
        lib.hpcgnn_place_rows.restype = ctypes.c_int
        lib.hpcgnn_gather_rows.argtypes = [p, i64, p, p, i64, i64, p]
        lib.hpcgnn_gather_rows.restype = ctypes.c_int
        return lib
    return None


def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None (no compiler, or ``HPCGNN_NATIVE=0``)."""
    global _lib
    if os.environ.get("HPCGNN_NATIVE", "1") == "0":
        return None
    if _lib is None:
        _lib = _load() or False
    return _lib or None


def unavailable() -> str | None:
    """Why the kernels are not loaded here (each place tried), None where they are, or where
    ``HPCGNN_NATIVE=0`` turned them off."""
    if lib() is not None or os.environ.get("HPCGNN_NATIVE", "1") == "0":
        return None
    return "; ".join(_why) or "no place to build them"


def quant_encode(x: torch.Tensor, bits: int, key: int, cols: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``(R, F)`` float32 CPU -> ``(R, row_bytes)`` uint8 (see ``_native.c``)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], row_bytes, dtype=torch.uint8)
    cols32 = cols.to(torch.int32).contiguous()        # the low 32 bits, as uint32 in C
    lib().hpcgnn_quant_encode(x.data_ptr(), x.shape[0], x.shape[1], bits, key & 0xFFFFFFFF,
                              cols32.data_ptr(), out.data_ptr())
    return out


def quant_decode(table: torch.Tensor, width: int, bits: int) -> torch.Tensor:
    """``(R, row_bytes)`` uint8 CPU -> ``(R, F)`` float32."""
    table = table.contiguous()
    out = torch.empty(table.shape[0], width, dtype=torch.float32)
    lib().hpcgnn_quant_decode(table.data_ptr(), table.shape[0], width, bits, out.data_ptr())
    return out


def sample_rows(keys: torch.Tensor, counts: torch.Tensor, kept: list[int]) -> torch.Tensor:
    """The sample stage's kept rows (``base._sample``): int64 ``(sum(kept),)``, ascending, from
    the blocks' packed int64 ``keys`` (their row halves, ``rng.row_keys``) and ``counts`` (CPU)
    and their ``kept`` counts."""
    keys, counts = keys.to(torch.int64).contiguous(), counts.to(torch.int64).contiguous()
    kept_t = torch.tensor(kept, dtype=torch.int64)
    out = torch.empty(sum(kept), dtype=torch.int64)
    work = torch.empty(int(counts.max()) if counts.numel() else 0, dtype=torch.int64)
    n = lib().hpcgnn_sample_rows(keys.data_ptr(), counts.data_ptr(), kept_t.data_ptr(),
                                 keys.numel(), out.data_ptr(), work.data_ptr())
    assert n == out.numel(), (n, out.numel())
    return out


def place_rows(y: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None,
               rows: int) -> torch.Tensor:
    """``(rows, F)`` zeros but for rows ``index`` (strictly ascending, else ValueError):
    ``y * scale[:, None]``."""
    y, index = y.contiguous(), index.to(torch.int64).contiguous()
    scale = None if scale is None else scale.to(torch.float32).contiguous()
    out = torch.empty(rows, y.shape[1], dtype=torch.float32)
    if lib().hpcgnn_place_rows(y.data_ptr(), index.data_ptr(), 0 if scale is None else scale.data_ptr(),
                               index.numel(), rows, y.shape[1], out.data_ptr()):
        raise ValueError(f"place_rows: the row index is not strictly ascending within [0, {rows})")
    return out


def gather_rows(x: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x[index] * scale[:, None]`` (``scale`` None: ``x[index]``), float32 CPU; IndexError for
    an index outside ``x``'s rows."""
    x, index = x.contiguous(), index.to(torch.int64).contiguous()
    scale = None if scale is None else scale.to(torch.float32).contiguous()
    out = torch.empty(index.numel(), x.shape[1], dtype=torch.float32)
    if lib().hpcgnn_gather_rows(x.data_ptr(), x.shape[0], index.data_ptr(),
                                0 if scale is None else scale.data_ptr(), index.numel(), x.shape[1],
                                out.data_ptr()):
        raise IndexError(f"gather_rows: a row index is outside [0, {x.shape[0]})")
    return out


def dropout_keep(rows: torch.Tensor, cols: torch.Tensor, threshold: int) -> torch.Tensor:
    """bool ``(len(rows), len(cols))``: ``hash32(rows[r] ^ cols[c]) >= threshold`` (int64 CPU
    hashes in ``[0, 2^32)``; see ``hpcgnn.nn.dropout.keep_mask``)."""
    rows, cols = rows.contiguous(), cols.contiguous()
    out = torch.empty(rows.shape[0], cols.shape[0], dtype=torch.bool)
    lib().hpcgnn_dropout_keep(rows.data_ptr(), cols.data_ptr(), rows.shape[0], cols.shape[0],
                              threshold, out.data_ptr())
    return out


def dropout_apply(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, threshold: int,
                  scale: float) -> torch.Tensor:
    """``y = keep * x * scale`` with the keep bits of ``dropout_keep``, in one pass (``x``
    float32 ``(len(rows), len(cols))`` CPU). Its own adjoint: the backward applies it to the
    gradient."""
    x, rows, cols = x.contiguous(), rows.contiguous(), cols.contiguous()
    y = torch.empty_like(x)
    lib().hpcgnn_dropout_apply(x.data_ptr(), rows.data_ptr(), cols.data_ptr(), x.shape[0],
                               x.shape[1], threshold, scale, y.data_ptr())
    return y


MATMUL_MAX_WIDTH = 32    # the widest weight dropout_matmul takes (DM_MAXW in _native.c)
MATMUL_CHUNK = 2048      # rows per partial dw sum: fixed, so dw is the same for any thread count


def _split_rows(n: int) -> list[tuple[int, int]]:
    """Row blocks, one per ``torch.get_num_threads()`` (one block on one thread or few rows)."""
    threads = torch.get_num_threads()
    if threads == 1 or n < 2 * MATMUL_CHUNK:
        return [(0, n)]
    step = -(-n // threads)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _in_pool(calls: list) -> None:
    """Run ``(fn, *args)`` calls, on the thread pool when there are several (ctypes releases
    the GIL for the call)."""
    if len(calls) == 1:
        calls[0][0](*calls[0][1:])
        return
    for job in [_threads().submit(*call) for call in calls]:
        job.result()


def _call_all(calls: list) -> None:
    for fn, *args in calls:
        fn(*args)


def dropout_matmul(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, threshold: int,
                   scale: float, w: torch.Tensor) -> torch.Tensor:
    """``(x * keep * scale) @ w`` in one pass, with the keep bits of ``dropout_keep``: ``x``
    ``(n, k)`` and ``w`` ``(k, m)`` float32 CPU, ``m <= MATMUL_MAX_WIDTH``; each output summed
    over ``k`` in order. Rows are split between ``torch.get_num_threads()`` threads (each row's
    result is the same whoever computes it)."""
    x, rows, cols, w = x.contiguous(), rows.contiguous(), cols.contiguous(), w.contiguous()
    n, k, m = x.shape[0], x.shape[1], w.shape[1]
    y = x.new_empty((n, m))
    f = lib().hpcgnn_dropout_matmul
    _in_pool([(f, x.data_ptr() + 4 * a * k, rows.data_ptr() + 8 * a, cols.data_ptr(), b - a, k,
               threshold, scale, w.data_ptr(), m, y.data_ptr() + 4 * a * m)
              for a, b in _split_rows(n)])
    return y


def dropout_matmul_backward(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                            threshold: int, scale: float, w: torch.Tensor, gy: torch.Tensor,
                            input_grad: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(dx, dw)`` of ``dropout_matmul`` for the output gradient ``gy`` ``(n, m)``:
    ``dx = (gy @ w.T) * keep * scale`` (None without ``input_grad``) and ``dw = (x * keep *
    scale).T @ gy``, hashing the bits again. ``dw`` is summed over rows in order within blocks
    of ``MATMUL_CHUNK`` rows, and the blocks' sums are added in order: the same bits for any
    thread count (the blocks run on ``torch.get_num_threads()`` threads)."""
    x, rows, cols, gy = x.contiguous(), rows.contiguous(), cols.contiguous(), gy.contiguous()
    n, k, m = x.shape[0], x.shape[1], w.shape[1]
    wt = w.t().contiguous()
    dx = torch.empty_like(x) if input_grad else None
    chunks = [(a, min(n, a + MATMUL_CHUNK)) for a in range(0, n, MATMUL_CHUNK)] or [(0, 0)]
    dwt = torch.zeros((len(chunks), m, k), dtype=torch.float32)      # each block's dw^T
    f = lib().hpcgnn_dropout_matmul_backward
    calls = [(f, x.data_ptr() + 4 * a * k, rows.data_ptr() + 8 * a, cols.data_ptr(), b - a, k,
              threshold, scale, wt.data_ptr(), m, gy.data_ptr() + 4 * a * m,
              None if dx is None else dx.data_ptr() + 4 * a * k, dwt[i].data_ptr())
             for i, (a, b) in enumerate(chunks)]
    threads = min(torch.get_num_threads(), len(calls))
    per = -(-len(calls) // threads)        # one job per thread, each a run of whole blocks
    _in_pool([(_call_all, calls[i:i + per]) for i in range(0, len(calls), per)])
    dw = dwt[0].clone()
    for part in dwt[1:]:
        dw += part                         # the blocks' sums, in order
    return dx, dw.t().contiguous()


def takes(x: torch.Tensor) -> bool:
    """Whether the C kernels take the float32 tensor ``x``: on the CPU, with the kernels built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and lib() is not None


_SPMM_SPLIT = 1 << 23             # multiply-adds below which one thread does the whole product
_pool: tuple[int, ThreadPoolExecutor] | None = None     # (threads, pool)


def _threads() -> ThreadPoolExecutor:
    """The kernels' thread pool, ``torch.get_num_threads()`` workers (remade when that changes)."""
    global _pool
    threads = torch.get_num_threads()
    if _pool is None or _pool[0] != threads:
        _pool = (threads, ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hpcgnn-kernels"))
    return _pool[1]


def spmm(mat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``mat @ x`` for a CPU CSR ``mat`` (int64 indices, float32 values) and a float32 ``x``
    ``(mat.shape[1], w)``: ``(mat.shape[0], w)`` (``spmm_csr``)."""
    return spmm_csr(mat.crow_indices(), mat.col_indices(), mat.values(), mat.shape[0], x)


def spmm_csr(indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, rows: int,
             x: torch.Tensor) -> torch.Tensor:
    """``A @ x`` for the CSR arrays of ``A`` (``rows`` rows; int32 or int64 indices, taken to
    int64; float32 values) and a float32 CPU ``x``: ``(rows, w)``, each row summed in CSR order
    (the same result for any thread count). With ``torch.get_num_threads() > 1`` the rows are
    split into blocks of about equal non-zeros, one per thread (ctypes releases the GIL during
    the call)."""
    x = x.contiguous()
    a = _csr_args(indptr, indices, values)
    out = x.new_empty((rows, x.shape[1]))
    _row_blocks(lambda r0, r1, slot: lib().hpcgnn_spmm(*_ptrs(a), r0, r1, x.data_ptr(),
                                                       x.shape[1], out.data_ptr()),
                rows, x.shape[1], values.numel(), lambda: a[0])
    return out


def spmm_sum2(mat_a: torch.Tensor, xa: torch.Tensor, mat_b: torch.Tensor,
              xb: torch.Tensor) -> torch.Tensor:
    """``spmm(mat_a, xa) + spmm(mat_b, xb)`` bit for bit, in one pass over the output: two CPU
    CSR operators with the same rows (a layer's owned and halo columns) and float32 ``xa``,
    ``xb`` of the same width."""
    xa, xb = xa.contiguous(), xb.contiguous()
    a = _csr_args(mat_a.crow_indices(), mat_a.col_indices(), mat_a.values())
    b = _csr_args(mat_b.crow_indices(), mat_b.col_indices(), mat_b.values())
    rows, w = mat_a.shape[0], xa.shape[1]
    out = xa.new_empty((rows, w))
    scratch = xa.new_empty((torch.get_num_threads(), w))   # one row of B's sums per thread

    def block(r0: int, r1: int, slot: int) -> None:
        lib().hpcgnn_spmm_sum2(*_ptrs(a), xa.data_ptr(), *_ptrs(b), xb.data_ptr(), r0, r1, w,
                               out.data_ptr(), scratch[slot].data_ptr())
    _row_blocks(block, rows, w, mat_a.values().numel() + mat_b.values().numel(),
                lambda: a[0] + b[0])
    return out


def _csr_args(indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> tuple:
    """``(indptr, indices, values)`` taken to int64, int64 and float32 where they are not. The
    caller holds the tuple while C reads them (a converted array is a new tensor)."""
    return (indptr.to(torch.int64).contiguous(), indices.to(torch.int64).contiguous(),
            values.to(torch.float32).contiguous())


def _ptrs(arrays: tuple) -> tuple[int, ...]:
    """The arrays' addresses, for C."""
    return tuple(t.data_ptr() for t in arrays)


def _row_blocks(run, rows: int, w: int, nnz: int, indptr) -> None:
    """``run(r0, r1, slot)`` over all ``rows``: at once on one thread or a small product
    (``nnz * w`` multiply-adds), else in blocks of about equal non-zeros (``indptr()``: their
    running count per row), one per thread (``slot``: the block's number, below
    ``torch.get_num_threads()``)."""
    threads = torch.get_num_threads()
    if threads == 1 or nnz * w < _SPMM_SPLIT or rows < 2 * threads:
        run(0, rows, 0)
        return
    cuts = torch.searchsorted(indptr(), torch.linspace(0, nnz, threads + 1).to(torch.int64)).tolist()
    cuts[0], cuts[-1] = 0, rows
    jobs = [_threads().submit(run, r0, r1, i)
            for i, (r0, r1) in enumerate(zip(cuts[:-1], cuts[1:])) if r1 > r0]
    for job in jobs:
        job.result()


def ensure_built() -> None:
    """Build the kernels beside this file unless they are there (``env/setup.sh`` calls it)."""
    target = _candidates()[0]
    try:
        print(f"{target} is there" if target.is_file() else f"built {build(target)}")
    except (OSError, subprocess.CalledProcessError) as exc:
        err = getattr(exc, "stderr", "") or exc
        print(f"could not build the C codec kernels ({err}); the torch path will be used", file=sys.stderr)


if __name__ == "__main__":
    ensure_built()
