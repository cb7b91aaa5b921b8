"""How the bytes of one exchange reach the peers: which MPI collective, and in how many rounds.

- **Sparse peers**: when every rank exchanges rows with at most half of the ranks (a graph
  partition usually touches few parts), the exchange runs on a distributed-graph communicator
  (``Create_dist_graph_adjacent``, made once per exchanger) with ``Neighbor_alltoallv``, whose
  count arrays list the neighbours only; otherwise a plain ``Alltoallv`` over all ranks. The
  choice is made once, collectively (every rank must call the same collective).
  ``HPCGNN_EXCHANGE=alltoallv|neighbor`` forces it.
- **Rounds**: MPI counts and displacements are C ints, so a buffer past 2^31 bytes cannot go
  in one call (``MPI_ERR_ARG``). When some block of an exchange exceeds ``limit / P`` bytes
  (``limit`` = 2^31 - 1, or ``HPCGNN_MAX_MESSAGE``), the exchange is split into rounds: round
  ``r`` carries bytes ``[r L, (r + 1) L)`` of every block, ``L = limit // P``, so every count and
  displacement stays below ``limit``. The round count is agreed once per (codec, width,
  direction) with one small ``Allreduce(MAX)``; rounds are blocking.
Counts, displacements and neighbour lists are computed once per (codec, width, direction)
and cached: an exchange does no per-peer Python work after its first use.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from hpcgnn.comm import gpu
from hpcgnn.comm.context import CommContext
from hpcgnn.comm.plan import HaloPlan, displacements

MODE_ENV, LIMIT_ENV = "HPCGNN_EXCHANGE", "HPCGNN_MAX_MESSAGE"
INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class Layout:
    """Byte counts of one exchange direction, in the form the chosen collective takes."""

    send: tuple[int, ...]         # per peer (all P), bytes
    recv: tuple[int, ...]
    s_counts: list[int]           # per neighbour (neighbor mode) or per rank
    s_displs: list[int]
    r_counts: list[int]
    r_displs: list[int]
    rounds: int

    @property
    def send_total(self) -> int:
        return sum(self.send)

    @property
    def recv_total(self) -> int:
        return sum(self.recv)


class Transport:
    """The collective that moves one exchanger's bytes (made on every rank, in the same order)."""

    def __init__(self, ctx: CommContext, plan: HaloPlan):
        self.ctx = ctx
        self.sources = [p for p, c in enumerate(plan.recv_counts) if c]     # who sends to me
        self.dests = [p for p, c in enumerate(plan.send_counts) if c]       # whom I send to
        self.limit = int(os.environ.get(LIMIT_ENV, INT_MAX))
        self.graph = None
        if ctx.size > 1 and self._use_neighbors():
            self.graph = ctx.comm.Create_dist_graph_adjacent(self.sources, self.dests, reorder=False)

    def _use_neighbors(self) -> bool:
        forced = os.environ.get(MODE_ENV)
        if forced in ("alltoallv", "neighbor"):
            return forced == "neighbor"
        if self.ctx.size < 8:
            return False
        from mpi4py import MPI
        peers = len(set(self.sources) | set(self.dests))
        widest = self.ctx.comm.allreduce(peers, op=MPI.MAX)          # once, at start-up
        return widest <= self.ctx.size // 2

    @property
    def mode(self) -> str:
        return "neighbor" if self.graph is not None else "alltoallv"

    def layout(self, send: list[int], recv: list[int]) -> Layout:
        """Counts for per-peer byte counts ``send``/``recv``. Collective (the round count is
        agreed): call it in the same order on every rank, and cache the result."""
        rounds = math.ceil(max([1, *send, *recv]) / self.chunk)
        if self.ctx.size > 1:
            from mpi4py import MPI
            rounds = self.ctx.comm.allreduce(rounds, op=MPI.MAX)
        return Layout(tuple(send), tuple(recv), *self._counts(send, recv), rounds)

    @property
    def chunk(self) -> int:
        """Bytes of one block per round: every count and displacement stays below the limit."""
        return max(1, self.limit // max(1, self.ctx.size))

    # -- moving bytes -----------------------------------------------------------------------
    def post(self, buf: torch.Tensor, lay: Layout, recv: torch.Tensor, recvbuf, pinned: dict,
             slot: str, nonblocking: bool):
        """Send ``buf`` and receive into ``recvbuf``; returns (request or None, keep-alive)."""
        if lay.rounds > 1:
            self._rounds(buf, lay, recv, pinned, slot)
            return None, ()
        from mpi4py import MPI
        sendbuf = gpu.to_mpi(buf, self.ctx.cuda_aware, pinned, "s" + slot)
        smsg = [sendbuf, (lay.s_counts, lay.s_displs), MPI.BYTE]
        rmsg = [recvbuf, (lay.r_counts, lay.r_displs), MPI.BYTE]
        comm = self.graph if self.graph is not None else self.ctx.comm
        if not nonblocking:                 # one collective: sum(send) bytes out
            (comm.Neighbor_alltoallv if self.graph is not None else comm.Alltoallv)(smsg, rmsg)
            return None, ()
        call = comm.Ineighbor_alltoallv if self.graph is not None else comm.Ialltoallv
        return call(smsg, rmsg), (buf, sendbuf, recvbuf)

    def _rounds(self, buf: torch.Tensor, lay: Layout, recv: torch.Tensor, pinned: dict, slot: str) -> None:
        """Round r moves bytes [r L, (r + 1) L) of every block (blocking)."""
        chunk = self.chunk
        s_off, r_off = displacements(list(lay.send)), displacements(list(lay.recv))
        for r in range(lay.rounds):
            lo = r * chunk
            s = [max(0, min(chunk, b - lo)) for b in lay.send]
            q = [max(0, min(chunk, b - lo)) for b in lay.recv]
            parts = [buf[o + lo:o + lo + n] for o, n in zip(s_off, s) if n]
            out = torch.cat(parts) if parts else buf.new_empty(0)
            got, gotbuf = gpu.recv_buffer(sum(q), torch.uint8, self.ctx.device, self.ctx.cuda_aware,
                                          pinned, "rr" + slot)
            self.post(out, Layout(tuple(s), tuple(q), *self._counts(s, q), 1), got, gotbuf,
                      pinned, "r" + slot, nonblocking=False)
            pos = 0
            for o, n in zip(r_off, q):
                if n:
                    recv[o + lo:o + lo + n].copy_(got[pos:pos + n])
                    pos += n

    def _counts(self, send: list[int], recv: list[int]) -> tuple:
        s_peers = self.dests if self.graph is not None else range(len(send))
        r_peers = self.sources if self.graph is not None else range(len(recv))
        s_counts, r_counts = [send[p] for p in s_peers], [recv[p] for p in r_peers]
        return s_counts, displacements(s_counts), r_counts, displacements(r_counts)
