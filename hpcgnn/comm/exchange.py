"""The halo exchange: one ``Alltoallv`` (or ``Ialltoallv``) per layer and direction.

Forward: pack the boundary rows for every peer into one contiguous buffer (``send_index``
order, grouped by peer), encode it with the forward ``WireCodec``, ship the bytes with one
``Alltoallv``, decode the halo rows ``(n_halo, width)``.
Backward: the halo-row gradients go back to their owners through one reverse ``Alltoallv``
(backward codec) and are scatter-added into the owned rows they came from.

Overlap: the exchange is split into ``start`` (post the ``Ialltoallv``) and ``finish`` (wait,
decode), two autograd functions, so a layer aggregates its owned rows while the halo rows are
on the wire; in backward, ``finish``'s backward posts the reverse exchange and ``start``'s
backward waits for it, with the owned-row aggregation's backward in between.

Codecs: every call takes the step's ``ExchangeSettings`` (the epoch of its keys, the forward and
backward codecs) as data; nothing about a step is set on the long-lived exchanger. The
forward uses the settings' forward codec; the backward sends the *adjoint* of the
forward's selection (``codecs.base.backward_codec``: the gradients of exactly the rows and
channels the forward sent) with the backward codec's value stage. Both ends derive the block
keys of an exchange from pair keys made once per exchanger and the epoch (``codecs.rng``), in
one device op; byte counts and displacements are cached per (codec, width, direction), so an
exchange does no per-peer Python work after its first use.

Volume per exchange: ``sum(codec.byte_counts(send_counts, width))`` bytes sent by this rank
(identity codec: ``sum(send_counts) * width * 4``).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from hpcgnn.codecs.base import IDENTITY, WireCodec, backward_codec
from hpcgnn.codecs.rng import Blocks, epoch_keys, pair_keys
from hpcgnn.comm import gpu
from hpcgnn.comm.context import CommContext
from hpcgnn.comm.keys import BACKWARD, FORWARD, mix
from hpcgnn.comm.plan import HaloPlan
from hpcgnn.comm.settings import CommSettings
from hpcgnn.comm.transport import Layout, Transport


NO_EXCHANGE_ENV = "HPCGNN_BENCH_NO_EXCHANGE"
"""Benchmarks only (``bench/network.py``'s no-communication floor): when set to 1, exchanges
send nothing and the halo rows are zeros — the same compute without the wire. Wrong results."""


def busy_seconds(wall0: float, cpu0: float, device: torch.device) -> float:
    """Seconds of work since ``time.perf_counter() == wall0`` and ``time.process_time() ==
    cpu0``: on a GPU the wall-clock (the caller synchronised the device); on the CPU the lesser
    of the wall-clock and the process's CPU time, so that a rank descheduled in the middle (ranks
    sharing cores) does not pass its wait for work, nor do idle spinning threads count where
    several threads share the work. A codec's cost, timed for ``kind = "auto"``."""
    wall = time.perf_counter() - wall0
    if device.type != "cpu":
        return wall
    return min(wall, time.process_time() - cpu0)


@dataclass(frozen=True)
class ExchangeSettings:
    """What one layer's exchange does in one step, passed per call: the epoch its block keys
    and rounding noise are drawn for, and the forward and backward codecs (the backward
    exchange sends ``backward_codec(forward, backward)``, the adjoint of the forward's
    selection). ``ExchangeSettings(epoch)`` is the identity both ways.

    ``probe`` / ``probe_backward``: candidate codecs the sender measures on the rows it sends in
    that direction (``kind = "auto"``, ``hpcgnn.autotune``): each candidate's encode + decode of
    those rows, with the real send's noise key, recorded in ``ExchangeStats.probes`` (squared
    error, ``||x||^2``, seconds, bytes) along with the exchange's wire seconds and bytes
    (``ExchangeStats.wire``). Nothing extra crosses the wire. ``probe_rows``: measure on at
    most about this many of the rows (0: all): rows ``0, k, 2k, ...`` of the packed send
    buffer, ``k = ceil(R / probe_rows)``, encoded as one buffer; error, ``||x||^2`` and
    seconds are then scaled by ``R / sampled`` (bytes are always the whole send's)."""

    epoch: int = 0
    forward: WireCodec = IDENTITY
    backward: WireCodec = IDENTITY
    probe: tuple[WireCodec, ...] = ()
    probe_backward: tuple[WireCodec, ...] = ()
    probe_rows: int = 0


class CodecError(RuntimeError):
    """A codec produced a buffer whose size differs from its own byte counts."""


@dataclass
class ProbeFigures:
    """What one rank measured on the rows one layer's exchange sent in one direction (summed
    over the exchange's calls in the epoch): ``norm2 = sum ||x||^2`` of the rows, and per
    candidate codec ``error2 = sum ||x - decode(encode(x))||^2``, the encode + decode
    ``seconds`` and the ``bytes`` it would have sent (``IDENTITY``: fp32's)."""

    norm2: float = 0.0
    error2: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)

    def add(self, codec: WireCodec, error2: float, seconds: float, nbytes: int) -> None:
        self.error2[codec] = self.error2.get(codec, 0.0) + error2
        self.seconds[codec] = self.seconds.get(codec, 0.0) + seconds
        self.bytes[codec] = self.bytes.get(codec, 0) + nbytes


@dataclass
class WireSample:
    """One probed exchange: this rank's bytes sent, its seconds in MPI calls (post, then the
    wait, added when the exchange completes), and ``compute_s``, the layer's own work between
    the post and the wait (the owned-row aggregation a non-blocking exchange overlaps)."""

    layer: int
    direction: int
    bytes: int
    seconds: float
    nonblocking: bool = False
    compute_s: float = 0.0
    posted_at: float = 0.0


@dataclass
class ExchangeStats:
    """Counters of one rank's training exchanges; the trainer resets them every epoch."""

    bytes_sent: int = 0      # bytes this rank handed to MPI, forward and backward
    bytes_full: int = 0      # what fp32 rows would have taken for the same exchanges
    bytes_received: int = 0  # bytes MPI handed this rank (the halo exchange; CAGNET counts none)
    comm_s: float = 0.0      # time in MPI calls (post + wait)
    codec_s: float = 0.0     # time in encode/decode (the probes' excluded)
    exchanges: int = 0
    probes: dict = field(default_factory=dict)   # (layer, direction) -> ProbeFigures
    wire: list = field(default_factory=list)     # WireSample of every probed exchange, in order

    def reset(self) -> None:
        self.bytes_sent = self.bytes_full = self.bytes_received = self.exchanges = 0
        self.comm_s = self.codec_s = 0.0
        self.probes, self.wire = {}, []


@dataclass
class Pending:
    """One exchange in flight: the MPI request, the receive buffer and what decoding needs."""

    request: object | None
    recv: torch.Tensor
    keep: tuple
    blocks: Blocks
    width: int
    codec: WireCodec
    keys: torch.Tensor
    sample: WireSample | None = None         # a probed exchange's wire figures (wait added)


@dataclass
class InFlight:
    """The exchanges of one layer call in flight (forward, then backward). The autograd
    functions hold this, never the token tensor: a token held by its own node's context would
    be a reference cycle through autograd that leaks the whole graph every step."""

    fwd: Pending | None = None
    bwd: Pending | None = None
    settings: ExchangeSettings | None = None


@dataclass
class Handle:
    """What ``start`` hands to ``finish``: the autograd token and the in-flight exchanges."""

    token: torch.Tensor
    flight: InFlight


@dataclass
class HaloExchanger:
    """The exchange of one layer: its plan, pair keys and transport, made once, and the shared
    stats; the codecs and epoch of each exchange come with the call (``ExchangeSettings``)."""

    ctx: CommContext
    plan: HaloPlan
    layer: int
    seed: int
    stats: ExchangeStats
    overlap: bool = False                      # train.overlap; off by default (bench/epoch.py)
    comm: CommSettings | None = None           # [comm]: transport, message limit (None: defaults)
    _pinned: gpu.PinnedPool = field(default_factory=gpu.PinnedPool)   # staging, kept across epochs
    _counts: dict = field(default_factory=dict)

    def __post_init__(self):
        dev, me, parts = self.ctx.device, self.ctx.rank, self.plan.num_parts
        # layouts of the packed buffers and the pair keys (forward direction), made once
        self._send_blocks = Blocks.of(self.plan.send_counts, dev)
        self._recv_blocks = Blocks.of(self.plan.recv_counts, dev)
        self._pairs_out = pair_keys(self.seed, self.layer, me, None, parts, dev)   # me -> p
        self._pairs_in = pair_keys(self.seed, self.layer, None, me, parts, dev)    # p -> me
        self._skip_wire = os.environ.get(NO_EXCHANGE_ENV) == "1"
        self._transport = Transport(self.ctx, self.plan, self.comm)   # local; its first layout is collective

    @property
    def transport_mode(self) -> str:
        """'alltoallv' or 'neighbor' once the first exchange chose it, else 'unconnected'."""
        return self._transport.mode

    def start(self, x_owned: torch.Tensor, settings: ExchangeSettings,
              encoder: torch.nn.Module | None = None) -> Handle:
        """Post the exchange of the boundary rows of ``x_owned`` ``(n_owned, width)``."""
        flight = InFlight()
        if encoder is None:
            token = _Start.apply(x_owned, self, self.plan.send_index, flight, settings)
        else:
            rows = encoder(x_owned.index_select(0, self.plan.send_index))
            token = _Start.apply(rows, self, None, flight, settings)
        return Handle(token, flight)

    def finish(self, handle: Handle, decoder: torch.nn.Module | None = None) -> torch.Tensor:
        """Wait for the exchange; the halo rows ``(n_halo, width)`` in halo-slot order."""
        halo = _Finish.apply(handle.token, self, handle.flight)
        return halo if decoder is None else decoder(halo)

    def exchange(self, x_owned: torch.Tensor, settings: ExchangeSettings) -> torch.Tensor:
        """Blocking convenience: ``finish(start(x_owned, settings))``."""
        return self.finish(self.start(x_owned, settings))

    def received_rows(self, settings: ExchangeSettings, width: int) -> torch.Tensor | None:
        """bool ``(n_halo,)``: the halo rows the forward exchange of ``settings`` (rows of
        ``width`` channels) delivers, the rest being zeros; None where it delivers every row
        (no ``sample`` stage, or no halo). The receiver's own draw of the rows each peer's
        block sent (the block keys both ends share): nothing crosses the wire for it."""
        codec = settings.forward
        if codec.keep >= 1.0 or self.plan.n_halo == 0:
            return None
        keys = epoch_keys(self._pairs_in, settings.epoch)
        index = codec.select(self._recv_blocks, keys, width).index   # the decode's selection
        mask = torch.zeros(self.plan.n_halo, dtype=torch.bool, device=index.device)
        return mask.index_fill_(0, index, True)

    # -- the two directions -------------------------------------------------------------
    def post(self, rows: torch.Tensor, direction: int, settings: ExchangeSettings,
             noise_epoch: int | None = None, nonblocking: bool | None = None,
             slot: str = "") -> Pending:
        """Encode ``rows`` (packed, grouped by peer) and post the Alltoallv of ``direction``.

        ``settings``: the forward exchange this one belongs to — its epoch gives the block keys
        and, for the backward, its forward codec the selection. ``noise_epoch``: the epoch of
        the sender's rounding noise (default: ``settings.epoch``; a stale backward sends at a
        later epoch than its forward). ``nonblocking``: post an ``Ialltoallv`` (default:
        ``overlap``); ``slot`` names its staging buffers."""
        fwd = direction == FORWARD
        sblocks, rblocks = ((self._send_blocks, self._recv_blocks) if fwd
                            else (self._recv_blocks, self._send_blocks))
        epoch = settings.epoch
        codec = settings.forward if fwd else backward_codec(settings.forward, settings.backward)
        width = int(rows.shape[1])
        # block keys: the forward pair's in both directions (the backward is the forward's adjoint)
        skeys = epoch_keys(self._pairs_out if fwd else self._pairs_in, epoch)
        rkeys = epoch_keys(self._pairs_in if fwd else self._pairs_out, epoch)
        noise = mix(self.seed, epoch if noise_epoch is None else noise_epoch, self.layer,
                    direction, self.ctx.rank)
        t0 = time.perf_counter()
        lay, full = self._layout(codec, width, fwd)
        buf = codec.encode(rows.detach(), sblocks, skeys, noise).reshape(-1)
        if buf.numel() != lay.send_total:
            raise CodecError(f"codec {codec.name!r} encoded {buf.numel()} bytes, its byte_counts "
                             f"say {lay.send_total} (layer {self.layer}); fix the codec")
        t1 = time.perf_counter()
        probe = settings.probe if fwd else settings.probe_backward
        if probe and self.ctx.size > 1 and not self._skip_wire:
            # a probed exchange starts aligned, so its wire seconds are the transfer's and not
            # the ranks' skew to here (their compute); the barrier's wait is MPI time
            self.ctx.comm.Barrier()
            self.stats.comm_s += time.perf_counter() - t1
            t1 = time.perf_counter()
        nb = self.overlap if nonblocking is None else nonblocking
        request, recv, keep = self._alltoallv(buf, lay, f"{direction}{slot}", nb)
        t2 = time.perf_counter()
        self.stats.codec_s += t1 - t0
        self.stats.comm_s += t2 - t1
        self.stats.bytes_sent += lay.send_total
        self.stats.bytes_full += full
        self.stats.bytes_received += lay.recv_total
        self.stats.exchanges += 1
        sample = None
        if probe:                                 # measured after the post: off the books
            self._probe(rows.detach(), probe, direction, sblocks, skeys, noise, fwd,
                        settings.probe_rows)
            sample = WireSample(self.layer, direction, lay.send_total, t2 - t1, nb,
                                posted_at=time.perf_counter())
            self.stats.wire.append(sample)
        return Pending(request, recv, keep, rblocks, width, codec, rkeys, sample)

    def _probe(self, rows: torch.Tensor, candidates: tuple[WireCodec, ...], direction: int,
               blocks: Blocks, keys: torch.Tensor, noise: int, fwd: bool, cap: int = 0) -> None:
        """Encode + decode ``rows`` ``(R, width)`` — or, with ``cap``, every ``k``-th of them
        (``k = ceil(R / cap)``) as one buffer — with every candidate (the real send's keys and
        noise) and record each one's squared error, seconds and bytes, and ``||rows||^2``
        (``ExchangeStats.probes[(layer, direction)]``), a sample's figures scaled by
        ``R / sampled``. Local work only."""
        counts = self.plan.send_counts if fwd else self.plan.recv_counts
        width, total = int(rows.shape[1]), int(rows.shape[0])
        fig = self.stats.probes.setdefault((self.layer, direction), ProbeFigures())
        fig.add(IDENTITY, 0.0, 0.0, sum(IDENTITY.byte_counts(counts, width)))
        stride = -(-total // cap) if cap > 0 and total > cap else 1
        if stride > 1:
            rows = rows[::stride].contiguous()
            blocks = Blocks.of((int(rows.shape[0]),), rows.device)
            keys = keys[:1]
        x = rows.to(torch.float32)
        scale = total / max(int(x.shape[0]), 1)
        fig.norm2 += scale * float(x.double().pow(2).sum())
        for codec in candidates:
            t0, c0 = time.perf_counter(), time.process_time()
            y = codec.decode(codec.encode(x, blocks, keys, noise), blocks, width, keys)
            if y.is_cuda:
                torch.cuda.synchronize(y.device)
            seconds = busy_seconds(t0, c0, y.device)      # the codec's, not the error's sum
            err = float((y.reshape(x.shape) - x).double().pow(2).sum())
            fig.add(codec, scale * err, scale * seconds, sum(codec.byte_counts(counts, width)))

    def _layout(self, codec: WireCodec, width: int, fwd: bool) -> tuple[Layout, int]:
        """(byte layout of the exchange, fp32 bytes of the same rows), cached per (codec, width,
        direction); the first use of a key is collective (``Transport.layout``)."""
        key = (codec, width, fwd)
        if key not in self._counts:
            scounts = self.plan.send_counts if fwd else self.plan.recv_counts
            rcounts = self.plan.recv_counts if fwd else self.plan.send_counts
            lay = self._transport.layout(codec.byte_counts(scounts, width),
                                         codec.byte_counts(rcounts, width), forward=fwd)
            self._counts[key] = (lay, sum(scounts) * width * 4)
        return self._counts[key]

    def complete(self, pending: Pending) -> torch.Tensor:
        """Wait for ``pending`` and decode: ``(sum(counts), width)`` float32 on the device."""
        t0 = time.perf_counter()
        if pending.request is not None:
            pending.request.Wait()
        recv = gpu.from_mpi(pending.recv, self.ctx.device, self._pinned)
        t1 = time.perf_counter()
        rows = pending.codec.decode(recv, pending.blocks, pending.width, pending.keys)
        self.stats.comm_s += t1 - t0
        if pending.sample is not None:
            pending.sample.seconds += t1 - t0
            pending.sample.compute_s += t0 - pending.sample.posted_at
        self.stats.codec_s += time.perf_counter() - t1
        return rows.reshape(-1, pending.width)

    def _alltoallv(self, buf: torch.Tensor, lay: Layout, slot: str, nonblocking: bool):
        """One (I)Alltoallv (or neighbourhood collective, or rounds: ``Transport``) of uint8
        blocks. Returns (request or None, recv tensor, keep-alive)."""
        aware, dev = self.ctx.cuda_aware, self.ctx.device
        recv, recvbuf = gpu.recv_buffer(lay.recv_total, torch.uint8, dev, aware, self._pinned, "r" + slot)
        if self.ctx.size == 1:
            return None, recv, ()
        if self._skip_wire:                          # the no-communication floor (benchmarks)
            recv.zero_()
            return None, recv, ()
        request, keep = self._transport.post(buf, lay, recv, recvbuf, self._pinned, slot, nonblocking)
        return request, recv, keep


class _Start(torch.autograd.Function):
    """Forward: pack (``index_select``) and post. Backward: wait for the returning halo
    gradients and scatter-add them into the owned rows they came from."""

    @staticmethod
    def forward(ctx, x, exchanger: HaloExchanger, index, flight: InFlight,
                settings: ExchangeSettings):
        rows = x if index is None else x.index_select(0, index)
        flight.fwd = exchanger.post(rows, FORWARD, settings)
        flight.settings = settings               # the backward sends the same step's adjoint
        ctx.exchanger, ctx.index, ctx.flight, ctx.shape = exchanger, index, flight, x.shape
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, grad_token):
        grad_rows = ctx.exchanger.complete(ctx.flight.bwd).to(grad_token.dtype)
        ctx.flight.bwd = None
        if ctx.index is None:
            return grad_rows, None, None, None, None
        if ctx.index.numel() == 0:                   # nothing was sent: no gradient comes back
            return None, None, None, None, None
        grad = grad_rows.new_zeros(ctx.shape)
        grad.index_add_(0, ctx.index, grad_rows)     # scatter-add into the owned rows
        return grad, None, None, None, None


class _Finish(torch.autograd.Function):
    """Forward: wait and decode the halo rows. Backward: post the reverse exchange of the
    halo gradients (completed by ``_Start.backward``)."""

    @staticmethod
    def forward(ctx, token, exchanger: HaloExchanger, flight: InFlight):
        halo = exchanger.complete(flight.fwd)
        flight.fwd = None
        ctx.exchanger, ctx.flight = exchanger, flight
        return halo

    @staticmethod
    def backward(ctx, grad_halo):
        ctx.flight.bwd = ctx.exchanger.post(grad_halo.contiguous(), BACKWARD, ctx.flight.settings)
        return grad_halo.new_empty(0), None, None
