"""Bounded staleness on the halo exchange (PipeGCN; Sylvie's Bounded Staleness Adaptor).

With staleness ``s``, training epoch ``t`` of a layer
  forward:  posts its boundary rows (``Ialltoallv``) and uses the halo rows *posted at t - s*,
            so the wire overlaps s epochs of computation;
  backward: posts the gradients of the halo rows it used (to their owners, through the adjoint
            of the codec those rows were sent with) and adds into its boundary rows the halo
            gradients its peers *posted at t - s*.
Weight gradients are never stale (the trainer's Allreduce is synchronous). Epochs ``t < s``
exchange synchronously (exact; PipeGCN starts from zeros instead, which makes the first
steps' halo terms zero) and also post their rows for ``t + s``; a stale gradient posted at an
epoch below ``s`` does not exist (the synchronous backward delivered it), so nothing is added.

Dropout: a row posted at epoch ``e`` was dropped with epoch ``e``'s mask, and its halo gradient
reaches the owner at ``e + 2s``. The owner sends that gradient back through the mask of ``e``
(the counter-based masks are made again: ``GNN._stale_dropout``), not through its own mask of
``e + 2s``: PipeGCN drops rows on the receiving side, where a row and its gradient share one
mask. Through the wrong mask the halo path misses dropout's correlation term: on the cSBM 20k
with 4 random parts (75 % of the edges cut; GCN 64 hidden, dropout 0.5, lr 0.003, 300 epochs)
the stale training loss rose from 0.72 at epoch 100 to 0.95 at 275 while the synchronous one
stayed at 0.73-0.81; through the right mask it stays at 0.70-0.78. The late gradient is
summed per sent row (a row goes to several peers), and the cost is then over the distinct
sent rows: their dropout (the model keeps a dense input's keep bits of those rows for the 2s
epochs, 1 byte per element) and, for a layer that sends ``x @ W``, the backward products
``late^T g`` and ``g W^T`` (where the old path folded ``g`` into the layer's own backward).

Smoothing ``m`` (PipeGCN's ``--feat-corr/--grad-corr``): ``avg <- m * avg + (1 - m) * recv``
for received rows and gradients, and ``avg`` is used. ``avg`` starts at the first received
value (PipeGCN starts it at zero, which scales the first stale rows by ``1 - m``).

Progress: Open MPI advances a non-blocking collective only inside MPI calls, so every layer's
stale step tests what is in flight; ``HPCGNN_PROGRESS=thread`` uses a progress thread instead
(``hpcgnn.comm.progress``, with the measurement that chose the default).

Memory per rank and layer: ``s`` received halo blocks ``(n_halo, w)`` and ``s`` received
gradient blocks ``(n_send, w)`` in fp32 (plus the wire buffers in flight), and one of each for
smoothing. ``state_dict`` completes what is in flight and stores the received tensors, so a
checkpoint resumes exactly.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch

from hpcgnn.codecs.base import WireCodec
from hpcgnn.comm.exchange import HaloExchanger, Pending
from hpcgnn.comm.keys import BACKWARD, FORWARD
from hpcgnn.comm.progress import Progress


@dataclass
class Entry:
    """One exchange of one epoch: in flight (``pending``) or received (``rows``)."""

    epoch: int                  # the epoch that posted it
    codec: WireCodec            # the forward codec of the rows (the backward's adjoint uses it)
    pending: Pending | None = None
    rows: torch.Tensor | None = None


class StaleExchange:
    """The stale halo exchange of one layer: its entries in flight and its smoothing state."""

    def __init__(self, exchanger: HaloExchanger, staleness: int, smoothing: float = 0.0,
                 progress: Progress | None = None):
        if staleness < 1:
            raise ValueError(f"staleness must be >= 1 for a stale exchange, got {staleness}")
        self.ex, self.s, self.m = exchanger, int(staleness), float(smoothing)
        self.progress = progress if progress is not None else Progress(exchanger.ctx)
        self.fwd: dict[int, Entry] = {}
        self.bwd: dict[int, Entry] = {}
        self.avg: dict[int, torch.Tensor | None] = {FORWARD: None, BACKWARD: None}
        # epoch -> the layer's sent input rows under that epoch's dropout mask; set by the
        # model every training forward (None without dropout)
        self.remask: Callable[[int], torch.Tensor] | None = None
        self.sent_masks: dict[int, torch.Tensor] = {}    # the model's cache for remask
        self._sent: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def sent(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, where)``: the owned rows that are sent, each once (``remask`` makes these),
        and for every sent row (``plan.send_index`` order, a row once per peer) its place
        among them: a late gradient is summed per row before it goes through the layer."""
        if self._sent is None:
            self._sent = torch.unique(self.ex.plan.send_index, return_inverse=True)
        return self._sent

    # -- what a layer calls ---------------------------------------------------------------
    def exchange(self, src: torch.Tensor,
                 weight: torch.Tensor | None = None) -> torch.Tensor:
        """The halo rows ``(n_halo, w)`` this epoch uses for ``src`` ``(n_owned, w)``.
        ``weight``: ``src`` is the layer's input ``@ weight`` (None: the input itself), for the
        late gradients' path."""
        t = self.ex.epoch
        self.poke()
        if t < self.s:                                    # warm-up: synchronous and exact
            halo = self.ex.exchange(src)
            self._post_rows(src.detach(), t)
            return halo
        late = None
        if self.remask is not None and (t - self.s) in self.bwd:
            # this epoch's backward adds the gradients of rows posted at t - 2s: they go back
            # through that epoch's dropout mask, the one those rows were made with
            late = self.remask(t - 2 * self.s)
        return _Stale.apply(src, late, weight if late is not None else None, self)

    def poke(self) -> None:
        """Let MPI progress the exchanges in flight (without a progress thread)."""
        self.progress.poke()

    # -- the two directions ---------------------------------------------------------------
    def _post_rows(self, src: torch.Tensor, t: int) -> None:
        rows = src.index_select(0, self.ex.plan.send_index)
        codec = self.ex.forward_codec
        pending = self.ex.post(rows, FORWARD, of=(t, codec), nonblocking=True, slot=f"f{t % (self.s + 1)}")
        self.progress.add(pending.request)
        self.fwd[t] = Entry(t, codec, pending)

    def _post_grads(self, grad_halo: torch.Tensor, used: Entry) -> None:
        t = self.ex.epoch
        pending = self.ex.post(grad_halo.contiguous(), BACKWARD, of=(used.epoch, used.codec),
                               nonblocking=True, slot=f"b{t % (self.s + 1)}")
        self.progress.add(pending.request)
        self.bwd[t] = Entry(t, used.codec, pending)

    def _take(self, table: dict[int, Entry], epoch: int, direction: int) -> torch.Tensor | None:
        entry = table.pop(epoch, None)
        if entry is None:
            return None
        rows = entry.rows if entry.pending is None else self._complete(entry.pending)
        if self.m == 0.0:
            return rows
        avg = self.avg[direction]
        self.avg[direction] = rows.clone() if avg is None else avg.mul_(self.m).add_(rows, alpha=1 - self.m)
        return self.avg[direction]

    def _complete(self, pending: Pending) -> torch.Tensor:
        self.progress.release(pending.request)
        return self.ex.complete(pending)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything in flight, received, plus the smoothing state (tensors on the CPU)."""
        def entries(table):
            return [{"epoch": e.epoch, "codec": asdict(e.codec),
                     "rows": (e.rows if e.pending is None else self._complete(e.pending)).cpu()}
                    for e in table.values()]
        state = {"fwd": entries(self.fwd), "bwd": entries(self.bwd),
                 "avg": {str(k): (None if v is None else v.cpu()) for k, v in self.avg.items()}}
        self.load_state_dict(state)                       # what was in flight is now received
        return state

    def load_state_dict(self, state: dict) -> None:
        dev = self.ex.ctx.device

        def entries(items):
            return {int(i["epoch"]): Entry(int(i["epoch"]), WireCodec(**i["codec"]), None,
                                           i["rows"].to(dev)) for i in items}
        self.fwd, self.bwd = entries(state["fwd"]), entries(state["bwd"])
        self.avg = {int(k): (None if v is None else v.to(dev)) for k, v in state["avg"].items()}


class _Stale(torch.autograd.Function):
    """Forward: post this epoch's rows, return those posted at t - s. Backward: post the
    halo gradients, return the owned-row gradients posted by the peers at t - s: into the
    sent rows of ``src``, or, when given, through ``late`` ``(n_sent_rows, F_in)`` (the
    layer's input rows of ``sent``, each once, made again with the dropout mask of the epoch
    they were posted at) and ``weight`` (``src = input @ weight``): ``d late = g weight^T``,
    ``d weight = late^T g``; the product ``late @ weight`` itself is never needed."""

    @staticmethod
    def forward(ctx, src, late, weight, stale: StaleExchange):
        t = stale.ex.epoch
        used = stale.fwd[t - stale.s]
        halo = stale._take(stale.fwd, t - stale.s, FORWARD)
        stale._post_rows(src.detach(), t)
        ctx.stale, ctx.used, ctx.shape = stale, Entry(used.epoch, used.codec), src.shape
        ctx.late = late is not None
        if ctx.late:
            ctx.save_for_backward(late, weight)
        return halo

    @staticmethod
    def backward(ctx, grad_halo):
        stale = ctx.stale
        stale.poke()
        stale._post_grads(grad_halo, ctx.used)
        got = stale._take(stale.bwd, stale.ex.epoch - stale.s, BACKWARD)
        if ctx.late:
            late, weight = ctx.saved_tensors
            where = stale.sent[1]
            g = grad_halo.new_zeros(late.shape[0], got.shape[1])
            g.index_add_(0, where, got.to(grad_halo.dtype))     # summed per sent row
            if weight is None:
                return None, g, None, None
            grad_late = g @ weight.T if ctx.needs_input_grad[1] else None
            grad_weight = late.T @ g if ctx.needs_input_grad[2] else None
            return None, grad_late, grad_weight, None
        grad = grad_halo.new_zeros(ctx.shape)
        if got is not None:
            grad.index_add_(0, stale.ex.plan.send_index, got.to(grad.dtype))
        return grad, None, None, None
