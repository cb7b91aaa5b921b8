"""The C quantisation kernels (``_native.c``) for CPU ranks, loaded with ctypes.

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
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("_native.c")
CFLAGS = ["-O3", "-march=x86-64-v2", "-ffp-contract=off", "-ffinite-math-only", "-fno-signed-zeros", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None | bool = None   # None: not tried yet; False: unavailable


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
    for path in _candidates():
        if not path.is_file():
            try:
                build(path)
            except (OSError, subprocess.CalledProcessError):
                continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            continue
        i64, u32, p = ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p
        lib.hpcgnn_quant_encode.argtypes = [p, i64, i64, ctypes.c_int, u32, p, p]
        lib.hpcgnn_quant_decode.argtypes = [p, i64, i64, ctypes.c_int, p]
        lib.hpcgnn_quant_row_bytes.restype = i64
        lib.hpcgnn_dropout_keep.argtypes = [p, p, i64, i64, ctypes.c_uint64, p]
        lib.hpcgnn_dropout_apply.argtypes = [p, p, p, i64, i64, ctypes.c_uint64, ctypes.c_float, p, p]
        lib.hpcgnn_masked_scale.argtypes = [p, p, i64, ctypes.c_float, p]
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


def dropout_keep(rows: torch.Tensor, cols: torch.Tensor, threshold: int) -> torch.Tensor:
    """bool ``(len(rows), len(cols))``: ``hash32(rows[r] ^ cols[c]) >= threshold`` (int64 CPU
    hashes in ``[0, 2^32)``; see ``hpcgnn.nn.dropout.keep_mask``)."""
    rows, cols = rows.contiguous(), cols.contiguous()
    out = torch.empty(rows.shape[0], cols.shape[0], dtype=torch.bool)
    lib().hpcgnn_dropout_keep(rows.data_ptr(), cols.data_ptr(), rows.shape[0], cols.shape[0],
                              threshold, out.data_ptr())
    return out


def dropout_apply(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, threshold: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, keep)``: the keep bits of ``dropout_keep`` and ``y = keep * x * scale`` in one pass
    (``x`` float32 ``(len(rows), len(cols))`` CPU)."""
    x, rows, cols = x.contiguous(), rows.contiguous(), cols.contiguous()
    y = torch.empty_like(x)
    keep = torch.empty(x.shape, dtype=torch.bool)
    lib().hpcgnn_dropout_apply(x.data_ptr(), rows.data_ptr(), cols.data_ptr(), x.shape[0],
                               x.shape[1], threshold, scale, y.data_ptr(), keep.data_ptr())
    return y, keep


def masked_scale(g: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """``keep * g * scale`` (float32 and bool CPU tensors of one shape), one pass."""
    g, keep = g.contiguous(), keep.contiguous()
    out = torch.empty_like(g)
    lib().hpcgnn_masked_scale(g.data_ptr(), keep.data_ptr(), g.numel(), scale, out.data_ptr())
    return out


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
