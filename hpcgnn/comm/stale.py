"""Bounded staleness on the halo exchange, as PipeGCN runs it (GATECH-EIC/PipeGCN,
``module/model.py``, ``helper/feature_buffer.py``; Sylvie's Bounded Staleness Adaptor).

A stale layer exchanges its **input** ``h`` ``(n_owned, F_in)``: the previous layer's output
after its activation, before dropout and before the weight. With staleness ``s``, training
epoch ``t`` of a layer
  forward:  posts its boundary rows ``h[send_index]`` (``Ialltoallv``, the step's forward codec)
            and returns the halo rows *posted at t - s* ``(n_halo, F_in)``; the layer then drops
            out ``[h; h_halo]`` on the receiving side (counter-based masks keyed by global id) and
            applies its *current* weights;
  backward: returns, as the gradient of ``h``, the halo gradients its peers *posted at t - s*,
            added into the boundary rows they belong to (one ``index_add``: PipeGCN's
            ``grad[boundary] += recv``), and keeps ``dL/dh_halo`` for its rows' owners, posted
            (through the adjoint of the codec those rows were sent with) once the step's
            gradient Allreduce is done (``post_late_gradients``).
So the weight gradients are computed at epoch ``t`` from the current weights and the current
loss; the gradient flowing into the previous layers through the boundary rows is ``s`` epochs
late, so the weight gradients of the layers below a stale layer hold that late term (as in
PipeGCN). Epochs ``t < s`` exchange synchronously (exact; PipeGCN starts from zeros
instead, which makes the first steps' halo terms zero) and also post their rows for ``t + s``;
a halo gradient of an epoch below ``s`` went back synchronously, so nothing late is added then.

Smoothing ``m`` (PipeGCN's ``--feat-corr/--grad-corr``): ``avg <- m * avg + (1 - m) * recv``
for received rows and gradients, and ``avg`` is used. ``avg`` starts at the first received
value (PipeGCN starts it at zero, which scales the first stale rows by ``1 - m``).

Why the halo gradients wait for the Allreduce: a link delivers in order, so a small message
posted behind megabytes waits until they have crossed. Posted during the backward pass, the
halo gradients were still on the wire when the step's gradient Allreduce (tens of kilobytes)
followed them: on 2 ranks at 2 Gbit/s, fp32, that Allreduce took 13-21 ms of a 57-67 ms step,
while every stale exchange had arrived before it was needed. Posted after the Allreduce they
have the rest of the step and the next one's forward pass to cross, as before, and the
Allreduce finds the link clear of them. The values are the same; only the moment of posting
moves. A step whose backward ran without a ``post_late_gradients`` (none in the trainers) posts
them when the next forward pass needs the exchange, or when a checkpoint is taken.

Progress: Open MPI advances a non-blocking collective only inside MPI calls, so the stale step
tests what is in flight at every stale layer's boundary, forward and backward (``poke``);
``[comm] progress = "fine"`` tests at points inside every layer's work as well (placed by the
layers through ``hpcgnn.nn.propagation``), and ``"thread"`` uses a progress thread instead
(``hpcgnn.comm.progress``). The rows posted at epoch ``t`` have until their use at ``t + s``.

Memory per rank and layer: ``s`` received halo blocks ``(n_halo, F_in)`` and ``s`` received
gradient blocks ``(n_send, F_in)`` in fp32 (plus the wire buffers in flight), and one of each
for smoothing. ``state_dict`` completes what is in flight and returns the received tensors, so a
checkpoint resumes exactly.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hpcgnn.codecs.base import WireCodec
from hpcgnn.comm.exchange import ExchangeSettings, HaloExchanger, Pending
from hpcgnn.comm.keys import BACKWARD, FORWARD
from hpcgnn.comm.progress import Progress


@dataclass
class Entry:
    """One exchange posted at ``epoch``: in flight (``pending``) or received (``rows``)."""

    epoch: int                  # the epoch that posted it
    settings: ExchangeSettings  # the forward exchange's settings (the backward's adjoint uses them)
    pending: Pending | None = None
    rows: torch.Tensor | None = None


class StaleExchange:
    """The stale halo exchange of one layer's input: its entries in flight and its smoothing."""

    def __init__(self, exchanger: HaloExchanger, staleness: int, smoothing: float = 0.0,
                 progress: Progress | None = None):
        if staleness < 1:
            raise ValueError(f"staleness must be >= 1 for a stale exchange, got {staleness}")
        self.ex, self.s, self.m = exchanger, int(staleness), float(smoothing)
        self.progress = progress if progress is not None else Progress(exchanger.ctx)
        self.fwd: dict[int, Entry] = {}
        self.bwd: dict[int, Entry] = {}
        self.late: list[tuple] = []           # halo gradients of this step, not yet posted
        # the settings the rows ``exchange`` last returned were sent with (their epoch's sample)
        self.used: ExchangeSettings | None = None
        self.avg: dict[int, torch.Tensor | None] = {FORWARD: None, BACKWARD: None}

    # -- what a layer calls ---------------------------------------------------------------
    def exchange(self, h: torch.Tensor, settings: ExchangeSettings) -> torch.Tensor:
        """The halo input rows ``(n_halo, F_in)`` that epoch ``settings.epoch`` uses for the
        layer input ``h`` ``(n_owned, F_in)``; posts ``h``'s boundary rows for a later epoch."""
        t = settings.epoch
        self.post_late_gradients()                        # a backward without a trainer's step
        self.poke()
        if t < self.s:                                    # warm-up: synchronous and exact
            halo = self.ex.exchange(h, settings)
            self._post_rows(h.detach(), settings)
            self.used = settings
            return halo
        return _Stale.apply(h, self, settings)

    def received_rows(self, width: int) -> torch.Tensor | None:
        """bool ``(n_halo,)``: the halo rows the last ``exchange`` returned that were sent (the
        ``sample`` stage's draw of the epoch they were posted at, ``t - s``, or ``t`` in the
        warm-up; from a checkpoint's entry after a resume), the others being zeros; None: every
        row (``HaloExchanger.received_rows``)."""
        if self.used is None:
            raise RuntimeError("StaleExchange.received_rows before any exchange")
        return self.ex.received_rows(self.used, width)

    def poke(self) -> None:
        """Let MPI progress the exchanges in flight (without a progress thread)."""
        self.progress.poke()

    def post_late_gradients(self) -> None:
        """Post the halo gradients this step's backward pass kept (after the step's gradient
        Allreduce: see the module's docstring)."""
        late, self.late = self.late, []
        for grad_halo, used, now in late:
            self._post_grads(grad_halo, used, now)

    # -- the two directions ---------------------------------------------------------------
    def _post_rows(self, h: torch.Tensor, settings: ExchangeSettings) -> None:
        t = settings.epoch
        rows = h.index_select(0, self.ex.plan.send_index)
        pending = self.ex.post(rows, FORWARD, settings, nonblocking=True, slot=f"f{t % (self.s + 1)}")
        self.progress.add(pending.request)
        self.fwd[t] = Entry(t, settings, pending)

    def _post_grads(self, grad_halo: torch.Tensor, used: ExchangeSettings, now: int) -> None:
        """Post the gradients of the halo rows used at ``now`` (sent with ``used``)."""
        pending = self.ex.post(grad_halo.contiguous(), BACKWARD, used, noise_epoch=now,
                               nonblocking=True, slot=f"b{now % (self.s + 1)}")
        self.progress.add(pending.request)
        self.bwd[now] = Entry(now, used, pending)

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
        self.post_late_gradients()
        def entries(table):
            return [{"epoch": e.epoch, "of": e.settings.epoch, "codec": asdict(e.settings.forward),
                     "backward": asdict(e.settings.backward),
                     "rows": (e.rows if e.pending is None else self._complete(e.pending)).cpu()}
                    for e in table.values()]
        state = {"fwd": entries(self.fwd), "bwd": entries(self.bwd),
                 "avg": {str(k): (None if v is None else v.cpu()) for k, v in self.avg.items()}}
        self.load_state_dict(state)                       # what was in flight is now received
        return state

    def load_state_dict(self, state: dict) -> None:
        dev = self.ex.ctx.device

        def entries(items):
            return {int(i["epoch"]): Entry(int(i["epoch"]),
                                           ExchangeSettings(int(i["of"]), WireCodec(**i["codec"]),
                                                            WireCodec(**i["backward"])),
                                           None, i["rows"].to(dev)) for i in items}
        self.fwd, self.bwd = entries(state["fwd"]), entries(state["bwd"])
        self.avg = {int(k): (None if v is None else v.to(dev)) for k, v in state["avg"].items()}


class _Stale(torch.autograd.Function):
    """Forward: post this epoch's boundary rows of ``h``, return the halo rows posted at
    ``t - s``. Backward: keep the halo gradients to post after the Allreduce, return the
    boundary-row gradients the peers posted at ``t - s``, added into ``h``'s sent rows (zeros
    elsewhere)."""

    @staticmethod
    def forward(ctx, h, stale: StaleExchange, settings: ExchangeSettings):
        t = settings.epoch
        used = stale.fwd[t - stale.s].settings
        halo = stale._take(stale.fwd, t - stale.s, FORWARD)
        stale._post_rows(h.detach(), settings)
        stale.used = used
        ctx.stale, ctx.used, ctx.now, ctx.shape = stale, used, t, h.shape
        return halo

    @staticmethod
    def backward(ctx, grad_halo):
        stale = ctx.stale
        stale.poke()
        stale.late.append((grad_halo, ctx.used, ctx.now))
        got = stale._take(stale.bwd, ctx.now - stale.s, BACKWARD)
        grad = grad_halo.new_zeros(ctx.shape)
        if got is not None:                              # grad[boundary] += recv
            grad.index_add_(0, stale.ex.plan.send_index, got.to(grad.dtype))
        return grad, None, None
