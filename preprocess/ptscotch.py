"""A thin ctypes binding to PT-Scotch's native distributed partitioner, ``SCOTCH_dgraphPart``.

Why the native call and not PT-Scotch's ParMETIS-compatible ``ParMETIS_V3_PartKway``: the
native API says its own integer width (``SCOTCH_numSizeof``), takes the seed
(``SCOTCH_randomSeed``; on Scotch 7 a deterministic context seeded with it) and a strategy with the imbalance ratio, and needs no extra library;
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
CONTEXT_DOUBLES = 16     # SCOTCH_Context: 3 doubles in Scotch 7.0 (scotch.h); room to spare
OPTION_DETERMINISTIC, OPTION_FIXED_SEED = 0, 1   # SCOTCH_OPTIONNUM* in scotch.h (Scotch 7)
# HPCGNN_PTSCOTCH_STRATEGY: "fast" (the default: fast_strategy() below), or SCOTCH_STRAT* flags
# (scotch.h) for PT-Scotch's own strategy, SCOTCH_stratDgraphMapBuild: "default" (no flag), or
# e.g. "speed,balance"
STRATEGY_ENV = "HPCGNN_PTSCOTCH_STRATEGY"
STRAT_FLAGS = {"default": 0x0, "quality": 0x1, "speed": 0x2, "balance": 0x4, "safety": 0x8,
               "scalability": 0x10, "recursive": 0x100, "levelmax": 0x1000, "levelmin": 0x2000,
               "leafsimple": 0x4000, "sepasimple": 0x8000, "disconnected": 0x10000}
FAST = "fast"
# A whole Scotch parallel mapping strategy string (SCOTCH_stratDgraphMap), overriding the above
STRING_ENV = "HPCGNN_PTSCOTCH_STRATEGY_STRING"
# "fast": FM refinement runs only on multilevel graphs of fewer vertices than this, on graphs
# whose degrees are skewed (max degree > SKEWED_DEGREE x the mean of the non-isolated vertices:
# R-MAT has 250-400x); on others, and with the value 0, it runs on every level
REFINE_VERT_ENV = "HPCGNN_PTSCOTCH_REFINE_VERT"
REFINE_VERT = 20000
SKEWED_DEGREE = 50
# "fill" (default): isolated vertices weigh 0 in PT-Scotch and fill the lightest parts afterwards;
# "keep": they are ordinary vertices
ISOLATED_ENV = "HPCGNN_PTSCOTCH_ISOLATED"
IMBALANCE = 0.05         # allowed load imbalance of a part
FAST_MARGIN = 0.02       # "fast": room kept for PT-Scotch's overshoot of its imbalance bound
FILL_MAX_IMBALANCE = 0.2  # "fill": the most imbalance allowed among the non-isolated vertices
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


def strategy_flags() -> int | None:
    """The ``SCOTCH_STRAT*`` flags named in ``$HPCGNN_PTSCOTCH_STRATEGY``, or None for "fast"
    (the default)."""
    names = [x.strip() for x in os.environ.get(STRATEGY_ENV, FAST).split(",") if x.strip()]
    if names == [FAST]:
        return None
    bad = [x for x in names if x not in STRAT_FLAGS]
    if bad:
        raise PtScotchError(f"{STRATEGY_ENV}={os.environ[STRATEGY_ENV]}: unknown {bad}; use "
                            f"{FAST!r} (the default) or a comma-separated subset of "
                            f"{sorted(STRAT_FLAGS)}")
    flags = 0
    for x in names:
        flags |= STRAT_FLAGS[x]
    return flags


def _env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    val = os.environ.get(name, default).strip() or default
    if val not in choices:
        raise PtScotchError(f"{name}={val}: use one of {', '.join(choices)}")
    return val


def refine_vert() -> int | None:
    """``$HPCGNN_PTSCOTCH_REFINE_VERT``, or None when unset ("auto": ``REFINE_VERT`` on graphs
    with skewed degrees, else 0)."""
    val = os.environ.get(REFINE_VERT_ENV, "").strip()
    if not val or val == "auto":
        return None
    try:
        out = int(val)
    except ValueError:
        out = -1
    if out < 0:
        raise PtScotchError(f"{REFINE_VERT_ENV}={val}: need a vertex count >= 0")
    return out


def fast_strategy(procs: int, imbalance: float, refine: int) -> str:
    """PT-Scotch's default parallel mapping strategy for ``procs`` ranks (as
    ``SCOTCH_stratDgraphMapBuild`` writes it with the ``speed`` flag, Scotch 7.0), except that
    the multilevel refinement (diffusion + Fiduccia-Mattheyses on a band graph, sequential and
    parallel) runs only while the current graph has fewer than ``refine`` vertices (every
    level when ``refine`` is 0).

    Why: on power-law graphs nearly every vertex is on the cut, so the band graph around the
    cut is the whole graph, and the sequential FM (also run on the gathered band graph of the
    parallel levels, ``q{strat=f}``) spends most of its time in ``bgraphBipartFmTablGet``,
    which walks the gain table past every better-gain vertex whose move would break the
    balance, once per move: the finest levels cost super-linear time (PT-Scotch's default
    strategy: 13 s at R-MAT scale 16, 65-80 s at 17, one rank). Skipping their refinement
    costs little cut on these graphs (still at or below METIS's). The coarser levels are
    refined as before; projecting a partition to a finer level keeps the part loads, but the
    result may exceed the bound by about 1 %, hence ``FAST_MARGIN``."""
    bal = f"{imbalance:f}"
    fm = f"f{{bal={bal},move=80}}"
    cond = (lambda st: f"/(vert<{refine})?{st};") if refine > 0 else (lambda st: st)
    seq = (f"m{{vert=80,low=h{{pass=10}}{fm},asc="
           + cond(f"b{{bnd=(d{{pass=40}}|){fm},org={fm}}}") + "}")
    par = cond(f"b{{bnd=(d{{pass=40}}|)q{{strat=f}}x{{bal={bal}}},org=q{{strat=f}}x{{bal={bal}}}}}")
    coarse = min(max(2000 * procs, 10000), 100000)   # PT-Scotch's folding threshold
    return (f"r{{bal={bal},sep=m{{vert={coarse},asc={par},low=q{{strat={seq}}},"
            f"seq=q{{strat={seq}}}}},seq=r{{bal={bal},poli=S,sep={seq}}}}}")


def fill_isolated(comm, parts: np.ndarray, isolated: np.ndarray, nparts: int) -> np.ndarray:
    """``parts`` with this rank's isolated vertices (``isolated``, bool) placed so that the
    part sizes over all ranks are as even as possible: the global deficits below a common level
    are filled in part order, rank ``r`` taking its slice of that sequence. Collective."""
    sizes = comm.allreduce(np.bincount(parts[~isolated], minlength=nparts).astype(np.int64))
    counts = comm.allgather(int(isolated.sum()))
    total = sum(counts)
    lo, hi = 0, int(sizes.max()) + total + 1      # the least level L with sum(L - size)+ >= total
    while lo < hi:
        mid = (lo + hi) // 2
        if int(np.maximum(0, mid - sizes).sum()) >= total:
            hi = mid
        else:
            lo = mid + 1
    take = np.maximum(0, lo - 1 - sizes)          # up to L - 1 everywhere, then 1 more in order
    take[np.flatnonzero(sizes <= lo - 1)[:total - int(take.sum())]] += 1
    start = sum(counts[:comm.rank])
    out = parts.copy()
    out[isolated] = np.searchsorted(np.cumsum(take), start + np.arange(counts[comm.rank]),
                                    side="right")
    return out


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
        self.string = os.environ.get(STRING_ENV, "").strip() or None
        self.refine = refine_vert()
        self.isolated = _env_choice(ISOLATED_ENV, "fill", ("fill", "keep"))

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

    def strategy(self, imbalance: float, skewed: bool) -> tuple[str, str | None]:
        """(name for the log, strategy string or None for ``SCOTCH_stratDgraphMapBuild``)."""
        if self.string:
            return f"{STRING_ENV}", self.string
        if self.flags is None:
            refine = self.refine if self.refine is not None else (REFINE_VERT if skewed else 0)
            return (f"fast, refine {f'below {refine:,} vertices' if refine else 'every level'}",
                    fast_strategy(self.comm.size, imbalance, refine))
        return f"flags {os.environ.get(STRATEGY_ENV)}", None

    def part(self, indptr: np.ndarray, indices: np.ndarray, nparts: int,
             seed: int) -> np.ndarray:
        """Parts (int64 [n_local]) of this rank's rows: ``indptr`` (int [n_local + 1], local
        CSR) and ``indices`` (global column ids) of a symmetric loop-free graph. Collective;
        PT-Scotch moves O(local edges) per rank during the multilevel partitioning.

        With ``fill`` (the default), isolated vertices weigh 0 in PT-Scotch, which balances the
        others with the imbalance the isolated ones can absorb (at most ``FILL_MAX_IMBALANCE``),
        and they are then put in the lightest parts (``fill_isolated``)."""
        n_local = len(indptr) - 1
        n = self.comm.allreduce(n_local)
        self.check_width(n, self.comm.allreduce(len(indices)))
        degree = np.diff(indptr)
        isolated = degree == 0
        n_core = n - self.comm.allreduce(int(isolated.sum()))
        from mpi4py import MPI
        skewed = (self.comm.allreduce(int(degree.max(initial=0)), op=MPI.MAX) * max(n_core, 1)
                  > SKEWED_DEGREE * self.comm.allreduce(len(indices)))
        # "fast" leaves the finest levels unrefined: PT-Scotch then overshoots its bound by up
        # to ~1 %, so it gets a tighter one
        margin = FAST_MARGIN if self.flags is None and not self.string else 0.0
        imbalance, weights = (1 + IMBALANCE) / (1 + margin) - 1, None
        if self.isolated == "fill" and n_core < n:
            if n_core == 0:
                return fill_isolated(self.comm, np.zeros(n_local, dtype=np.int64), isolated,
                                     nparts)
            # parts of (1 + b) n_core / k non-isolated vertices, filled up to (1 + IMBALANCE) n / k
            imbalance = min((1 + imbalance) * n / n_core - 1, FILL_MAX_IMBALANCE)
            weights = (~isolated).astype(self.num)
        name, string = self.strategy(imbalance, skewed)
        log.debug("PT-Scotch strategy: %s; imbalance %.3f%s", name, imbalance,
                  "" if weights is None else f" over {n_core:,} non-isolated vertices")
        part = self._part(indptr, indices, nparts, seed, string, imbalance, weights)
        return part if weights is None else fill_isolated(self.comm, part, isolated, nparts)

    def _part(self, indptr, indices, nparts, seed, string, imbalance, weights) -> np.ndarray:
        from mpi4py import MPI
        n_local = len(indptr) - 1
        vert = np.ascontiguousarray(indptr, dtype=self.num)
        edge = np.ascontiguousarray(indices, dtype=self.num)
        velo = None if weights is None else np.ascontiguousarray(weights, dtype=self.num)
        part = np.zeros(max(n_local, 1), dtype=self.num)
        graph = (ctypes.c_double * (self.lib.SCOTCH_dgraphSizeof() // 8 + 1))()
        strat = (ctypes.c_double * (STRAT_BYTES // 8))()
        num, ptr = self.c_num, (lambda a: a.ctypes.data_as(ctypes.c_void_p))
        if hasattr(self.lib, "SCOTCH_randomSeed"):
            self.lib.SCOTCH_randomSeed(num(seed))
            self.lib.SCOTCH_randomReset()
        context, bound = self._context(seed), None
        self._call("SCOTCH_dgraphInit", graph, self.c_comm(MPI._handleof(self.comm)))
        try:
            self._call("SCOTCH_dgraphBuild", graph, num(0), num(n_local), num(n_local),
                       ptr(vert), None, None if velo is None else ptr(velo), None,
                       num(len(edge)), num(len(edge)), ptr(edge), None, None)
            if context is not None:        # the graph as the seeded context sees it
                bound = (ctypes.c_double * (self.lib.SCOTCH_dgraphSizeof() // 8 + 1))()
                self._call("SCOTCH_contextBindDgraph", context, graph, bound)
            self.lib.SCOTCH_stratInit(strat)
            try:
                if string is not None:
                    self._call("SCOTCH_stratDgraphMap", strat, ctypes.c_char_p(string.encode()))
                else:
                    self._call("SCOTCH_stratDgraphMapBuild", strat, num(self.flags),
                               num(self.comm.size), num(nparts), ctypes.c_double(imbalance))
                self._call("SCOTCH_dgraphPart", graph if bound is None else bound, num(nparts),
                           strat, ptr(part))
            finally:
                self.lib.SCOTCH_stratExit(strat)
        finally:
            if bound is not None:
                self.lib.SCOTCH_dgraphExit(bound)
            self.lib.SCOTCH_dgraphExit(graph)
            if context is not None:
                self.lib.SCOTCH_contextExit(context)
        return part[:n_local].astype(np.int64)

    def _context(self, seed: int):
        """A Scotch 7 context that is deterministic and seeded with ``seed`` (the plain API's
        default context draws a time-dependent seed unless Scotch was built with a fixed one,
        so SCOTCH_randomSeed alone did not make a run repeatable); None before Scotch 7."""
        if not hasattr(self.lib, "SCOTCH_contextInit"):
            return None
        context = (ctypes.c_double * CONTEXT_DOUBLES)()
        self._call("SCOTCH_contextInit", context)
        self._call("SCOTCH_contextOptionSetNum", context, ctypes.c_int(OPTION_DETERMINISTIC),
                   self.c_num(1))
        self._call("SCOTCH_contextOptionSetNum", context, ctypes.c_int(OPTION_FIXED_SEED),
                   self.c_num(1))
        self.lib.SCOTCH_contextRandomSeed(context, self.c_num(seed))
        return context
