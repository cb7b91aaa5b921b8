"""A thin ctypes binding to PT-Scotch's native distributed partitioner, ``SCOTCH_dgraphPart``.

Why the native call and not PT-Scotch's ParMETIS-compatible ``ParMETIS_V3_PartKway``: the
native API says its own integer width (``SCOTCH_numSizeof``), takes the seed
(``SCOTCH_randomSeed``) and a strategy with the imbalance ratio, and needs no extra library;
the ParMETIS shim is a wrapper over the same call (it would add only "a site's ParMETIS can
stand in", at the price of ParMETIS's licence for those who use it).

The library is ``$HPCGNN_PTSCOTCH_LIB`` when set, else ``libptscotch.so`` found the usual way
(``ctypes.util.find_library``, then the Debian names). PT-Scotch is an MPI library: it must use
the *same* MPI as mpi4py. Before loading it, its ELF ``NEEDED`` entries are read; a libmpi
soname that the MPI mpi4py loaded does not carry (e.g. PT-Scotch built with MPICH's
``libmpi.so.12``, mpi4py on Open MPI's ``libmpi.so.40``) is a :class:`PtScotchError` naming both
libraries and the fix, instead of a crash inside MPI.

Graph contract: the distributed graph is symmetric, without self-loops, and rank ``r`` holds
the consecutive global vertices ``vtxdist[r] .. vtxdist[r+1]-1`` (PT-Scotch numbers vertices
in rank order).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import struct
from pathlib import Path

import numpy as np

from preprocess.errors import PreprocessError

log = logging.getLogger("hpcgnn.preprocess")
ENV_LIB = "HPCGNN_PTSCOTCH_LIB"
DEBIAN_NAMES = ("libptscotch.so", "libptscotch-7.0.so", "libptscotch-6.1.so")
STRAT_BYTES = 256        # SCOTCH_Strat is an opaque struct of a few doubles: room to spare
# SCOTCH_STRAT* flags (scotch.h), chosen with HPCGNN_PTSCOTCH_STRATEGY=speed,balance,...
STRATEGY_ENV = "HPCGNN_PTSCOTCH_STRATEGY"
STRAT_FLAGS = {"default": 0x0, "quality": 0x1, "speed": 0x2, "balance": 0x4, "safety": 0x8,
               "scalability": 0x10, "recursive": 0x100, "levelmax": 0x1000, "levelmin": 0x2000,
               "leafsimple": 0x4000, "sepasimple": 0x8000, "disconnected": 0x10000}
IMBALANCE = 0.05         # allowed load imbalance of a part
INSTALL_HINT = ("install PT-Scotch (Debian/Ubuntu: apt-get install libptscotch-dev; a cluster: "
                f"module load scotch) or point {ENV_LIB} at libptscotch.so; see env/README.md")


class PtScotchError(PreprocessError):
    """PT-Scotch missing, built for another MPI, too narrow, or failing; names the fix."""


def elf_needed(path: str | os.PathLike) -> list[str]:
    """The ``DT_NEEDED`` sonames of a 64-bit little-endian ELF shared library (empty if the
    file is not one: then nothing can be checked before loading it)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    out = []
    for _, kind, _, _, off, size, link, _, _, entsize in sections:
        if kind != 6:                                      # SHT_DYNAMIC
            continue
        stroff = sections[link][4]
        for pos in range(off, off + size, entsize or 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == 0:
                break
            if tag == 1:                                   # DT_NEEDED
                end = data.index(b"\0", stroff + val)
                out.append(data[stroff + val:end].decode())
    return out


def loaded_mpi_libraries() -> list[str]:
    """Paths of the libmpi* files mapped into this process (the MPI mpi4py loaded)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    return sorted(p for p in paths if Path(p).name.startswith(("libmpi.", "libmpich.",
                                                               "libmpi_")))


def _resolve(name: str) -> str | None:
    """A file path for ``name`` (absolute, or the first match on the usual directories)."""
    if os.sep in name:
        return name
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") + [
            "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
            "/usr/local/lib"]:
        if d and (Path(d) / name).is_file():
            return str(Path(d) / name)
    return None


def _find_library() -> str:
    env = os.environ.get(ENV_LIB)
    if env:
        if not Path(env).is_file():
            raise PtScotchError(f"{ENV_LIB}={env}: no such file; point it at libptscotch.so "
                                f"(e.g. /usr/lib/x86_64-linux-gnu/libptscotch.so)")
        return env
    found = ctypes.util.find_library("ptscotch")
    for name in ([found] if found else []) + list(DEBIAN_NAMES):
        path = _resolve(name)
        if path:
            return path
    raise PtScotchError(f"PT-Scotch (libptscotch.so) not found; {INSTALL_HINT}")


def check_same_mpi(lib_path: str, mpi_version: str) -> None:
    """Refuse a PT-Scotch whose libmpi soname is not the one of the MPI already loaded."""
    path = _resolve(lib_path)
    needed = [n for n in (elf_needed(path) if path else []) if n.startswith(("libmpi", "libmpich"))]
    loaded = loaded_mpi_libraries()
    if not needed or not loaded:
        return
    # MPICH ships libmpich.so.12 with libmpi.so.12 as a link to it: one library, two names
    names = [Path(p).name.replace("libmpich.", "libmpi.") for p in loaded]
    if any(n.startswith(s.replace("libmpich.", "libmpi.")) for s in needed for n in names):
        return
    raise PtScotchError(
        f"{path} is linked against {', '.join(needed)}, but mpi4py runs on {', '.join(loaded)} "
        f"({mpi_version.splitlines()[0].strip()}): two MPIs in one process would crash. Use a "
        f"PT-Scotch built with mpi4py's MPI ({ENV_LIB}=.../libptscotch.so; a cluster: the scotch "
        f"module of the same MPI module), or build mpi4py against PT-Scotch's MPI (env/site-mpi.sh);"
        f" compare `ldd {path} | grep mpi` with `ldd $(python -c 'import mpi4py.MPI as m; "
        f"print(m.__file__)') | grep mpi`")


def strategy_flags() -> int:
    """The ``SCOTCH_STRAT*`` flags named in ``$HPCGNN_PTSCOTCH_STRATEGY`` (default: none)."""
    names = [x.strip() for x in os.environ.get(STRATEGY_ENV, "default").split(",") if x.strip()]
    bad = [x for x in names if x not in STRAT_FLAGS]
    if bad:
        raise PtScotchError(f"{STRATEGY_ENV}={os.environ[STRATEGY_ENV]}: unknown {bad}; use a "
                            f"comma-separated subset of {sorted(STRAT_FLAGS)}")
    flags = 0
    for x in names:
        flags |= STRAT_FLAGS[x]
    return flags


class PtScotch:
    """The loaded library: its integer type and the calls used here."""

    def __init__(self, comm) -> None:
        from mpi4py import MPI
        self.path = _find_library()
        check_same_mpi(self.path, MPI.Get_library_version())
        try:
            self.lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise PtScotchError(f"{self.path}: cannot load ({exc}); {INSTALL_HINT}") from exc
        for sym in ("SCOTCH_dgraphInit", "SCOTCH_dgraphBuild", "SCOTCH_dgraphPart",
                    "SCOTCH_numSizeof", "SCOTCH_dgraphSizeof"):
            if not hasattr(self.lib, sym):
                raise PtScotchError(f"{self.path}: no symbol {sym}: not a PT-Scotch library; "
                                    f"{INSTALL_HINT}")
        self.num = {4: np.int32, 8: np.int64}[self.lib.SCOTCH_numSizeof()]
        self.c_num = ctypes.c_int32 if self.num == np.int32 else ctypes.c_int64
        # MPI_Comm is a pointer in Open MPI, an int in MPICH and its derivatives
        self.c_comm = ctypes.c_void_p if MPI._sizeof(MPI.Comm) == 8 else ctypes.c_int
        self.comm = comm
        self.flags = strategy_flags()

    def check_width(self, num_vertices: int, num_arcs: int) -> None:
        """Global vertex and arc counts must fit ``SCOTCH_Num``."""
        top = np.iinfo(self.num).max
        if max(num_vertices, num_arcs) >= top:
            raise PtScotchError(
                f"{self.path}: SCOTCH_Num is {np.dtype(self.num).itemsize * 8}-bit, too narrow "
                f"for {num_vertices:,} vertices / {num_arcs:,} arcs; use a 64-bit build "
                f"({ENV_LIB}=/usr/lib/x86_64-linux-gnu/scotch-int64/libptscotch.so on Debian)")

    def _call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise PtScotchError(f"{self.path}: {name} failed (status {status}; PT-Scotch printed "
                                f"the reason above)")

    def part(self, indptr: np.ndarray, indices: np.ndarray, nparts: int,
             seed: int) -> np.ndarray:
        """Parts (int64 [n_local]) of this rank's rows: ``indptr`` (int [n_local + 1], local
        CSR) and ``indices`` (global column ids) of a symmetric loop-free graph. Collective;
        PT-Scotch moves O(local edges) per rank during the multilevel partitioning."""
        from mpi4py import MPI
        n_local = len(indptr) - 1
        self.check_width(self.comm.allreduce(n_local), self.comm.allreduce(len(indices)))
        vert = np.ascontiguousarray(indptr, dtype=self.num)
        edge = np.ascontiguousarray(indices, dtype=self.num)
        part = np.zeros(max(n_local, 1), dtype=self.num)
        graph = (ctypes.c_double * (self.lib.SCOTCH_dgraphSizeof() // 8 + 1))()
        strat = (ctypes.c_double * (STRAT_BYTES // 8))()
        num, ptr = self.c_num, (lambda a: a.ctypes.data_as(ctypes.c_void_p))
        if hasattr(self.lib, "SCOTCH_randomSeed"):
            self.lib.SCOTCH_randomSeed(num(seed))
            self.lib.SCOTCH_randomReset()
        self._call("SCOTCH_dgraphInit", graph, self.c_comm(MPI._handleof(self.comm)))
        try:
            self._call("SCOTCH_dgraphBuild", graph, num(0), num(n_local), num(n_local),
                       ptr(vert), None, None, None, num(len(edge)), num(len(edge)), ptr(edge),
                       None, None)
            self.lib.SCOTCH_stratInit(strat)
            try:
                self._call("SCOTCH_stratDgraphMapBuild", strat, num(self.flags),
                           num(self.comm.size), num(nparts), ctypes.c_double(IMBALANCE))
                self._call("SCOTCH_dgraphPart", graph, num(nparts), strat, ptr(part))
            finally:
                self.lib.SCOTCH_stratExit(strat)
        finally:
            self.lib.SCOTCH_dgraphExit(graph)
        return part[:n_local].astype(np.int64)
