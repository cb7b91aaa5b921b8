"""How the bytes of one exchange reach the peers: which MPI collective, and in how many rounds.

- **Directions**: the forward sends rank ``q``'s boundary rows to every ``p`` with
  ``send_counts[p] > 0`` and receives from every ``p`` with ``recv_counts[p] > 0``; the
  backward runs on the *reversed* topology (the halo gradients go back to the rows' owners:
  it sends to the forward's sources and receives from the forward's destinations). On a
  directed graph the two differ: a part can receive from a peer it sends nothing to.
- **Sparse peers**: when every rank exchanges rows with at most half of the ranks (a graph
  partition usually touches few parts), the exchange runs on distributed-graph communicators
  (``Create_dist_graph_adjacent``, one per direction and exchanger) with
  ``Neighbor_alltoallv``, whose count arrays list the neighbours only; otherwise a plain
  ``Alltoallv`` over all ranks. The choice is made once, collectively (every rank must call the
  same collective). ``[comm] transport = "alltoallv" | "neighbor"`` (or ``HPCGNN_EXCHANGE``)
  forces it (``hpcgnn.comm.settings``).
- **Lazy set-up**: nothing collective happens when a ``Transport`` is made (inside the
  trainer's start-up, where a rank may fail and wait in the failure agreement while the others
  go on). The choice of collective (one small ``Allreduce(MAX)`` in auto mode) is made at the
  first ``layout``, and a direction's dist-graph communicator at that direction's first
  ``layout``: both run after the ranks agreed that nobody failed, at the same point of the
  same exchange on every rank.
- **Rounds**: MPI counts and displacements are C ints, so a buffer past 2^31 bytes cannot go
  in one call (``MPI_ERR_ARG``). A call is within the limit (``limit`` = ``[comm]
  max_message``, 2^31 - 1 by default, or ``HPCGNN_MAX_MESSAGE``) when the bytes a rank sends
  and the bytes it receives each total at most ``limit`` (the last displacement plus its count
  is the total): then the exchange is one call, however large one block is. When some rank's
  total exceeds it, the exchange is split into rounds on every rank: round ``r`` carries bytes
  ``[r L, (r + 1) L)`` of every block, ``L = limit // k``, where ``k`` is the most peers any
  rank sends to or receives from in this direction (the blocks of a call that are not empty:
  a partition's ``k`` is usually far below ``P``), so a call moves at most ``k L <= limit``
  bytes each way. ``k`` and the round count are agreed once per (codec, width, direction) in
  one small ``Allreduce(MAX)``, so a sender and its receiver cut a block alike; rounds are
  blocking and run on the direction's own topology. A limit below ``k`` cannot be kept (a
  round carries at least one byte of each block): start-up refuses one below ``P - 1``
  (``hpcgnn.comm.settings.check_message_limit``).
Counts, displacements and neighbour lists are computed once per (codec, width, direction)
and cached: an exchange does no per-peer Python work after its first use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from hpcgnn.comm import gpu
from hpcgnn.comm.context import CommContext
from hpcgnn.comm.plan import HaloPlan, displacements
from hpcgnn.comm.settings import INT_MAX, CommSettings


@dataclass(frozen=True)
class Layout:
    """Byte counts of one exchange direction, in the form the chosen collective takes."""

    send: tuple[int, ...]         # per peer (all P), bytes
    recv: tuple[int, ...]
    s_counts: list[int]           # per neighbour of this direction (neighbor mode) or per rank
    s_displs: list[int]
    r_counts: list[int]
    r_displs: list[int]
    rounds: int
    forward: bool = True          # False: the backward, on the reversed topology
    chunk: int = 0                # bytes of a block per round (rounds > 1): limit // agreed peers

    @property
    def send_total(self) -> int:
        return sum(self.send)

    @property
    def recv_total(self) -> int:
        return sum(self.recv)


class Transport:
    """The collective that moves one exchanger's bytes. Making it is local; its first
    ``layout`` (per direction) is collective: call it in the same order on every rank."""

    def __init__(self, ctx: CommContext, plan: HaloPlan, settings: CommSettings | None = None):
        """``settings``: the run's ``[comm]`` (default: the defaults with the environment's
        overrides)."""
        settings = settings if settings is not None else CommSettings.resolve()
        self.ctx = ctx
        self.sources = [p for p, c in enumerate(plan.recv_counts) if c]     # forward: who sends to me
        self.dests = [p for p, c in enumerate(plan.send_counts) if c]       # forward: whom I send to
        self.limit = min(int(settings.max_message), INT_MAX)
        self.forced = None if settings.transport == "auto" else settings.transport
        self._neighbors: bool | None = None       # decided at the first layout (collective)
        self._graphs: dict[bool, object] = {}     # direction (True = forward) -> dist-graph comm

    def _connect(self) -> None:
        """Choose the collective, once (collective in auto mode at >= 8 ranks)."""
        if self._neighbors is None:
            self._neighbors = self.ctx.size > 1 and self._use_neighbors()

    def _use_neighbors(self) -> bool:
        if self.forced in ("alltoallv", "neighbor"):
            return self.forced == "neighbor"
        if self.ctx.size < 8:
            return False
        from mpi4py import MPI
        peers = len(set(self.sources) | set(self.dests))
        widest = self.ctx.comm.allreduce(peers, op=MPI.MAX)          # once, at the first exchange
        return widest <= self.ctx.size // 2

    def peers(self, forward: bool) -> tuple[list[int], list[int]]:
        """(ranks this direction sends to, ranks it receives from): the backward is the
        forward reversed."""
        return (self.dests, self.sources) if forward else (self.sources, self.dests)

    def _graph(self, forward: bool):
        """The direction's dist-graph communicator, made at its first layout (collective)."""
        if forward not in self._graphs:
            to, frm = self.peers(forward)
            self._graphs[forward] = self.ctx.comm.Create_dist_graph_adjacent(frm, to, reorder=False)
        return self._graphs[forward]

    @property
    def mode(self) -> str:
        """'neighbor' or 'alltoallv' once chosen (at the first layout), else 'unconnected'."""
        if self._neighbors is None:
            return "unconnected"
        return "neighbor" if self._neighbors else "alltoallv"

    def layout(self, send: list[int], recv: list[int], forward: bool = True) -> Layout:
        """Counts for per-peer byte counts ``send``/``recv`` of one direction. Collective (the
        collective's choice, the direction's communicator and the round count are agreed):
        call it in the same order on every rank, and cache the result."""
        self._connect()
        if self._neighbors:
            self._graph(forward)
        # [any rank's total past the limit, its largest block, the most non-empty blocks it
        # sends or receives]: the same on every rank after the MAX
        need = np.array([sum(send) > self.limit or sum(recv) > self.limit, max([1, *send, *recv]),
                         max(1, sum(map(bool, send)), sum(map(bool, recv)))], dtype=np.int64)
        if self.ctx.size > 1:
            from mpi4py import MPI
            self.ctx.comm.Allreduce(MPI.IN_PLACE, need, op=MPI.MAX)
        if need[0] and self.limit < need[2]:    # the same on every rank: all raise alike
            raise ValueError(f"[comm] max_message = {self.limit}: a round of this exchange carries a "
                             f"byte to each of up to {int(need[2])} peers; use {int(need[2])} or "
                             f"more (start-up refuses less than P - 1)")
        chunk = self.chunk(int(need[2]))
        rounds = math.ceil(int(need[1]) / chunk) if need[0] else 1
        return Layout(tuple(send), tuple(recv), *self._counts(send, recv, forward), rounds, forward,
                      chunk)

    def chunk(self, peers: int) -> int:
        """Bytes of one block per round when no rank has more than ``peers`` non-empty blocks
        in a call: a round's call moves at most ``limit`` bytes each way."""
        return max(1, self.limit // max(1, peers))

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
        graph = self._graphs[lay.forward] if self._neighbors else None
        comm = graph if graph is not None else self.ctx.comm
        if not nonblocking:                 # one collective: sum(send) bytes out
            (comm.Neighbor_alltoallv if graph is not None else comm.Alltoallv)(smsg, rmsg)
            return None, ()
        call = comm.Ineighbor_alltoallv if graph is not None else comm.Ialltoallv
        return call(smsg, rmsg), (buf, sendbuf, recvbuf)

    def _rounds(self, buf: torch.Tensor, lay: Layout, recv: torch.Tensor, pinned: dict, slot: str) -> None:
        """Round r moves bytes [r L, (r + 1) L) of every block (blocking), on the direction's
        topology."""
        chunk = lay.chunk
        s_off, r_off = displacements(list(lay.send)), displacements(list(lay.recv))
        for r in range(lay.rounds):
            lo = r * chunk
            s = [max(0, min(chunk, b - lo)) for b in lay.send]
            q = [max(0, min(chunk, b - lo)) for b in lay.recv]
            parts = [buf[o + lo:o + lo + n] for o, n in zip(s_off, s) if n]
            out = torch.cat(parts) if parts else buf.new_empty(0)
            got, gotbuf = gpu.recv_buffer(sum(q), torch.uint8, self.ctx.device, self.ctx.cuda_aware,
                                          pinned, "rr" + slot)
            one = Layout(tuple(s), tuple(q), *self._counts(s, q, lay.forward), 1, lay.forward)
            self.post(out, one, got, gotbuf, pinned, "r" + slot, nonblocking=False)
            pos = 0
            for o, n in zip(r_off, q):
                if n:
                    recv[o + lo:o + lo + n].copy_(got[pos:pos + n])
                    pos += n

    def _counts(self, send: list[int], recv: list[int], forward: bool) -> tuple:
        """(send counts, displs, recv counts, displs): per neighbour of the direction in
        neighbor mode (its communicator's order), per rank otherwise."""
        if self._neighbors:
            s_peers, r_peers = self.peers(forward)
        else:
            s_peers, r_peers = range(len(send)), range(len(recv))
        s_counts, r_counts = [send[p] for p in s_peers], [recv[p] for p in r_peers]
        return s_counts, displacements(s_counts), r_counts, displacements(r_counts)
