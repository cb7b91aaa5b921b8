"""The collectives of CAGNET's algorithms (1.5D: ``cagnet.py``; 2D and 3D: ``cagnet2d.py``,
``cagnet3d.py``): thin typed wrappers over one sub-communicator of a process grid. Each one

- is split into rounds when it would pass the MPI count limit: counts and displacements are C
  ints, so one call moves at most ``limit`` bytes (2^31 - 1, or ``HPCGNN_MAX_MESSAGE``, the
  halo transport's setting; tests lower it); every rank knows every size, so the round count
  needs no agreement;
- takes device tensors: handed to a CUDA-aware MPI directly (after a stream sync), else staged
  through host copies, as the halo exchange does;
- counts its bytes into ``ExchangeStats`` (fp32, uncompressed: what is sent is also the fp32
  volume) by the standard collective costs, and its time into ``comm_s``.

Costs, in bytes over all ranks of a group of ``m`` ranks (``b``: the payload; ``b_r``: rank
``r``'s block):

  Bcast           (m - 1) b            counted at the root
  Reduce          (m - 1) b            each non-root counts its payload
  Allreduce       2 (m - 1) b          (ring: 2 (m - 1) / m b per rank), counted at group rank 0
  Allgatherv      (m - 1) sum_r b_r    each rank counts (m - 1) b_r: its block to every other
  Reduce_scatter  (m - 1) sum_r b_r    each rank counts the blocks of the others

A sparse block (``SparseBlock``) travels as three Bcasts: its CSR row pointer, column indices
and fp32 values, ``s (rows + 1) + (s + 4) nnz`` bytes for ``s``-byte indices.
"""
from __future__ import annotations

import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from hpcgnn.codecs import native
from hpcgnn.comm import gpu
from hpcgnn.comm.context import CommContext
from hpcgnn.comm.exchange import ExchangeStats
from hpcgnn.comm.settings import INT_MAX, CommSettings


def message_limit(comm=None) -> int:
    """Bytes one call may move: ``[comm] max_message`` of ``comm`` (a ``CommConfig``, or None
    for the default), with ``HPCGNN_MAX_MESSAGE`` on top (``hpcgnn.comm.settings``)."""
    return CommSettings.resolve(comm).max_message


def _pieces(sizes: list[int], per: int, r: int) -> list[int]:
    """Elements of each block in round ``r`` (round ``r`` moves ``[r per, (r + 1) per)``)."""
    return [max(0, min(per, s - r * per)) for s in sizes]


def _offsets(sizes: list[int]) -> list[int]:
    return [0, *np.cumsum(sizes, dtype=np.int64).tolist()[:-1]] if sizes else []


@dataclass
class Wire:
    """The collectives of one CAGNET operator: its context, the message limit, the counters."""

    ctx: CommContext
    limit: int
    stats: ExchangeStats | None = None

    # -- staging ----------------------------------------------------------------------------
    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """A flat contiguous tensor MPI may read: ``t``'s memory where possible."""
        t = t.detach()
        if t.device.type == "cpu" or self.ctx.cuda_aware:
            return t.reshape(-1).contiguous()
        return t.reshape(-1).cpu()

    def _mpi(self, flat: torch.Tensor):
        return gpu.to_mpi(flat, self.ctx.cuda_aware)           # syncs the stream on a GPU

    def _empty(self, n: int, like: torch.Tensor) -> torch.Tensor:
        dev = like.device if (like.device.type == "cpu" or self.ctx.cuda_aware) else "cpu"
        return torch.empty(n, dtype=like.dtype, device=dev)

    @staticmethod
    def _back(flat: torch.Tensor, like: torch.Tensor, shape) -> torch.Tensor:
        return flat.reshape(shape).to(like.device)

    def _per(self, itemsize: int, m: int = 1) -> int:
        """Elements of one block in one round: ``m`` blocks of a round fit the limit."""
        return max(1, self.limit // (itemsize * m))

    def _count(self, nbytes: int) -> None:
        self.stats.bytes_sent += nbytes
        self.stats.bytes_full += nbytes

    @contextmanager
    def _timed(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stats.comm_s += time.perf_counter() - t0

    # -- the collectives ---------------------------------------------------------------------
    def bcast(self, comm, t: torch.Tensor, root: int) -> torch.Tensor:
        """``t`` of the root on every rank (others pass a buffer of the same shape and dtype).
        ``(m - 1) x t`` bytes, counted at the root."""
        m = comm.Get_size()
        if m == 1 or t.numel() == 0:
            return t
        with self._timed():
            flat = self._host(t)
            buf, per = self._mpi(flat), self._per(flat.element_size())
            for lo in range(0, flat.numel(), per):
                comm.Bcast(buf[lo:lo + per], root=root)
            if comm.Get_rank() == root:
                self._count((m - 1) * t.numel() * t.element_size())
            return self._back(flat, t, t.shape)

    def reduce(self, comm, t: torch.Tensor, root: int) -> torch.Tensor:
        """The sum of every rank's ``t`` at the root (elsewhere: unspecified values). Each
        non-root counts ``t``'s bytes."""
        from mpi4py import MPI
        if comm.Get_size() == 1 or t.numel() == 0:
            return t
        with self._timed():
            flat = self._host(t)
            out = self._empty(flat.numel(), flat)
            sbuf, rbuf, per = self._mpi(flat), self._mpi(out), self._per(flat.element_size())
            for lo in range(0, flat.numel(), per):
                comm.Reduce(sbuf[lo:lo + per], rbuf[lo:lo + per], op=MPI.SUM, root=root)
            if comm.Get_rank() != root:
                self._count(t.numel() * t.element_size())
            return self._back(out, t, t.shape)

    def allreduce(self, comm, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``t`` on every rank (a new tensor). ``2 (m - 1) x t`` bytes,
        counted at group rank 0."""
        from mpi4py import MPI
        m = comm.Get_size()
        if m == 1 or t.numel() == 0:
            return t
        with self._timed():
            flat = self._host(t)
            flat = flat.clone() if flat.data_ptr() == t.data_ptr() else flat
            buf, per = self._mpi(flat), self._per(flat.element_size())
            for lo in range(0, flat.numel(), per):
                comm.Allreduce(MPI.IN_PLACE, buf[lo:lo + per], op=MPI.SUM)
            if comm.Get_rank() == 0:
                self._count(2 * (m - 1) * t.numel() * t.element_size())
            return self._back(flat, t, t.shape)

    def allgather(self, comm, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's ``t`` (``sizes[r]`` elements on rank ``r``), concatenated flat in rank
        order, on every rank. Each rank counts ``(m - 1) x t`` bytes."""
        m = comm.Get_size()
        if m == 1:
            return t.reshape(-1)
        with self._timed():
            flat = self._host(t)
            out = self._empty(sum(sizes), flat)
            self._rounds_v(comm, flat, out, sizes, gather=True)
            self._count((m - 1) * t.numel() * t.element_size())
            return out.to(t.device)

    def reduce_scatter(self, comm, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Block ``r`` (``sizes[r]`` elements of flat ``t``, in rank order) summed over the
        ranks, on rank ``r``. Each rank counts the bytes of the other ranks' blocks."""
        me, m = comm.Get_rank(), comm.Get_size()
        if m == 1:
            return t.reshape(-1)
        with self._timed():
            flat = self._host(t)
            out = self._empty(sizes[me], flat)
            self._rounds_v(comm, flat, out, sizes, gather=False)
            self._count((sum(sizes) - sizes[me]) * t.element_size())
            return out.to(t.device)

    def _rounds_v(self, comm, flat: torch.Tensor, out: torch.Tensor, sizes: list[int],
                  gather: bool) -> None:
        """Allgatherv (``gather``) or Reduce_scatter of blocks ``sizes``; past the limit in
        rounds: round ``r`` moves elements ``[r per, (r + 1) per)`` of every block, so no count
        or displacement passes it."""
        me, per = comm.Get_rank(), self._per(flat.element_size(), comm.Get_size())
        rounds = math.ceil(max(sizes) / per)
        if rounds == 1:                                   # one call, straight into ``out``
            move = self._allgatherv if gather else self._reduce_scatter
            return move(comm, flat, out, sizes)
        offsets = _offsets(sizes)
        for r in range(rounds):
            counts, lo = _pieces(sizes, per, r), r * per
            if gather:
                got = self._empty(sum(counts), flat)
                self._allgatherv(comm, flat[lo:lo + counts[me]], got, counts)
                _scatter_pieces(got, out, counts, [o + lo for o in offsets])
            else:
                send = torch.cat([flat[o + lo:o + lo + n] for o, n in zip(offsets, counts)])
                self._reduce_scatter(comm, send, out[lo:lo + counts[me]], counts)

    def _allgatherv(self, comm, send: torch.Tensor, recv: torch.Tensor, counts: list[int]) -> None:
        comm.Allgatherv(self._mpi(send.contiguous()), [self._mpi(recv), (counts, _offsets(counts))])

    def _reduce_scatter(self, comm, send: torch.Tensor, recv: torch.Tensor,
                        counts: list[int]) -> None:
        from mpi4py import MPI
        comm.Reduce_scatter(self._mpi(send.contiguous()), self._mpi(recv), recvcounts=counts,
                            op=MPI.SUM)


def _scatter_pieces(got: torch.Tensor, out: torch.Tensor, counts: list[int],
                    starts: list[int]) -> None:
    """Copy the consecutive pieces of ``got`` (``counts``) to ``out[starts[r]:...]``."""
    pos = 0
    for start, n in zip(starts, counts):
        if n:
            out[start:start + n].copy_(got[pos:pos + n])
            pos += n


# -- sparse blocks ----------------------------------------------------------------------------
@dataclass
class SparseBlock:
    """A CSR block of the adjacency on the rank's device: row pointer, column indices (int32
    or int64), fp32 values, and its torch CSR tensor for ``block @ dense``."""

    crow: torch.Tensor
    col: torch.Tensor
    val: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_scipy(cls, m: sp.csr_matrix, index_dtype: torch.dtype, device) -> "SparseBlock":
        m = m.astype(np.float32).tocsr()
        m.sum_duplicates()
        m.sort_indices()
        t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(device, dt)  # noqa: E731
        return cls(t(m.indptr, index_dtype), t(m.indices, index_dtype), t(m.data, torch.float32),
                   m.shape)

    @classmethod
    def empty(cls, shape: tuple[int, int], nnz: int, index_dtype: torch.dtype,
              device) -> "SparseBlock":
        """A receive buffer for a block of ``shape`` with ``nnz`` non-zeros."""
        return cls(torch.empty(shape[0] + 1, dtype=index_dtype, device=device),
                   torch.empty(nnz, dtype=index_dtype, device=device),
                   torch.empty(nnz, dtype=torch.float32, device=device), shape)

    @property
    def nnz(self) -> int:
        return int(self.val.numel())

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        """``(rows, cols) @ (cols, f)`` -> ``(rows, f)``, no autograd (the operators own it)."""
        if self.nnz == 0 or x.shape[1] == 0:
            return x.new_zeros(self.shape[0], x.shape[1])
        if native.takes(x):
            return native.spmm_csr(self.crow, self.col, self.val, self.shape[0], x)   # as the halo layers
        with warnings.catch_warnings():        # "sparse CSR support is in beta": we rely on it
            warnings.simplefilter("ignore", UserWarning)
            a = torch.sparse_csr_tensor(self.crow, self.col, self.val, size=self.shape,
                                        device=x.device, check_invariants=False)
        return a @ x

    def bcast(self, wire: Wire, comm, root: int) -> "SparseBlock":
        """This block (the root's; an ``empty`` of the right shape and nnz elsewhere) on every
        rank of ``comm``: three Bcasts, ``(m - 1) (s (rows + 1) + (s + 4) nnz)`` bytes."""
        return SparseBlock(wire.bcast(comm, self.crow, root), wire.bcast(comm, self.col, root),
                           wire.bcast(comm, self.val, root), self.shape)


def index_dtype(num_nodes: int, num_edges: int) -> torch.dtype:
    """int32 indices when every row pointer and column index of any block fits (a block holds
    at most ``num_edges + num_nodes`` entries, self-loops included), else int64. Every rank
    reads the same ``meta.json``, so every rank picks the same."""
    return torch.int32 if num_nodes + num_edges < INT_MAX else torch.int64
