"""How a layer reaches its neighbours' rows: one propagation object per layer, chosen by the
builder (``hpcgnn.train.build``) from the run config. Every kind takes the step's settings per
call and holds nothing of a step between calls.

- ``HaloPropagation`` (``parallel.algorithm = "halo"``, ``train.staleness = 0``): the halo
  exchange of whatever the layer hands it (its input or its transformed rows), synchronous; the
  owned-row work runs while the rows travel.
- ``StalePropagation`` (``train.staleness = s >= 1``; PipeGCN): training steps exchange the
  layer's *input* before dropout and use the halo rows of ``s`` epochs ago
  (``hpcgnn.comm.stale``); evaluation runs the synchronous exchange.
- ``ConstantPropagation`` (the first layer of a stale run): the input is the constant feature
  matrix, so its halo rows cross the wire once (uncompressed) and are kept; training steps use
  them like a stale layer's halo input, with receiver-side dropout and no backward. A
  synchronous run's first layer is one too with ``train.keep_features``: the same model, and
  that layer never exchanges after the one fetch.
- ``SpmmPropagation`` (``parallel.algorithm = "1.5d"``, CAGNET): ``A[i, :] @ H`` through a
  distributed sparse-dense product; there are no halo rows (GAT is refused).

Evaluation (``train.eval_features``): a first layer whose propagation has ``eval_kept`` runs
``with_halo`` on the kept halo rows of the features instead of exchanging: by default where
training keeps those rows anyway (``ConstantPropagation``); ``"kept"`` asks a synchronous run
to fetch and keep them (``n_halo x F_in`` fp32 per rank) for evaluation alone.

Contract: ``aggregate(graph, src, settings, modules)`` returns ``A @ [src; src_halo]``
``(n_owned, w)``; ``halo_rows(src, settings, local, modules)`` returns ``(local(), halo rows
(n_halo, w) or None on one rank)``; ``exchanges_input`` says whether training steps call
``input_halo(h, settings)`` instead, before dropout, and then ``received_input_rows(width)``
says which of those rows were sent (a ``sample`` stage's draw of the epoch they were sent at;
GAT's softmax keeps their edges alone).

Progress points: a layer that computes on given halo rows (a stale step) marks the stages of
its work with ``point(x)`` (``x`` unchanged) and sums ``A [x; x_halo]`` with
``aggregate_halo(graph, x, x_halo)`` (with ``fine`` progress a point after each sparse product;
otherwise one C pass on CPU ranks). Where stale
exchanges are in flight and ``[comm] progress = "fine"`` a point tests them, in the forward
pass and again in the backward pass (``hpcgnn.comm.progress``); everywhere else it does nothing.

VARCO's learned codec (``modules = (encoder, decoder)``, ``hpcgnn.codecs.learned``) is applied
to the rows sent to peers only (the owned rows never pass through it), as IntelLabs/SAR applies
its ``FeatureCompressorDecompressor`` (``sar/core/compressor.py``), and, unlike SAR (fixed ``k``,
in evaluation too), only while the exchange compresses — when the step's forward codec sends
``k < F`` learned channels (in evaluation too with ``train.eval_codec = "train"``). At ratio 1
(every channel sent), in an uncompressed evaluation (the default) and in the
last layer (uncompressed by default) the halo rows are the sender's rows as they are. Applied
at ratio 1 too, ``decoder(encoder(.))`` was an ``F x F`` map on the halo rows alone that Adam
(steps of ``lr`` per parameter, whatever the gradient's size) walked away from the identity:
76.0 % against 82.0 % on Cora (``bench/learned_diagnose.py``, ``docs/compression.md``).
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from hpcgnn.comm.exchange import ExchangeSettings, HaloExchanger
from hpcgnn.comm.progress import Progress
from hpcgnn.comm.stale import StaleExchange

T = TypeVar("T")
Modules = tuple[torch.nn.Module | None, torch.nn.Module | None]


class HaloPropagation:
    """The synchronous halo exchange of one layer (one (I)Alltoallv each way).

    ``eval_kept``: evaluation runs the layer on the halo rows of its (constant) input, fetched
    once and kept (``kept_input_halo``), instead of exchanging (``train.eval_features``; the
    first layer only, whose input is the features)."""

    exchanges_input = False
    keeps_input = False          # training keeps the halo rows of its input (ConstantPropagation)

    def __init__(self, exchanger: HaloExchanger, progress: Progress | None = None,
                 eval_kept: bool = False):
        self.exchanger = exchanger
        self.progress = progress     # the stale exchanges in flight (None: nothing to progress)
        self.eval_kept = eval_kept and not self.single
        self._rows: torch.Tensor | None = None
        self._key: tuple | None = None

    @property
    def single(self) -> bool:
        return self.exchanger.ctx.size == 1

    def point(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` unchanged; a progress point of the exchanges in flight (module doc)."""
        return x if self.progress is None else self.progress.point(x)

    def aggregate_halo(self, graph, x: torch.Tensor, x_halo: torch.Tensor) -> torch.Tensor:
        """``owned @ x + halo @ x_halo`` ``(n_owned, w)`` on given halo rows (no exchange): with
        ``fine`` progress a point after each sparse product, else one pass
        (``LocalGraph.aggregate``, the same bits)."""
        if self.progress is None or self.progress.mode != "fine":
            return graph.aggregate(x, x_halo)
        return self.point(graph.owned @ x) + self.point(graph.halo @ x_halo)

    def kept_input_halo(self, h: torch.Tensor, epoch: int = 0) -> torch.Tensor:
        """The halo rows ``(n_halo, F_in)`` of the constant input ``h`` (the features): exchanged
        once, uncompressed and without a backward, then kept on the rank (collective on the
        first call, and again only if ``h`` is another tensor or was changed in place)."""
        key = (h.data_ptr(), h._version, tuple(h.shape))
        if self._key != key:
            with torch.no_grad():
                self._rows = self.exchanger.exchange(h.detach(), ExchangeSettings(epoch))
            self._key = key
        return self._rows

    def halo_rows(self, src: torch.Tensor, settings: ExchangeSettings, local: Callable[[], T],
                  modules: Modules = (None, None)) -> tuple[T, torch.Tensor | None]:
        """``(local(), halo rows (n_halo, w) of src (n_owned, w))``; ``local()`` runs while the
        rows travel. On one rank the halo is None (no collective kept in the autograd graph).
        ``modules``: the learned codec's pair, used only when the forward codec is learned."""
        encoder, decoder = modules if settings.forward.channels == "learned" else (None, None)
        handle = self.exchanger.start(src, settings, encoder)   # (I)Alltoallv posted
        out = local()                                           # no communication needed
        halo = self.exchanger.finish(handle, decoder)           # wait, decode
        return out, (None if self.single else halo)

    def received_rows(self, settings: ExchangeSettings, width: int) -> torch.Tensor | None:
        """bool ``(n_halo,)``: the halo rows ``halo_rows`` delivers under ``settings`` (rows of
        ``width`` channels; None: every row, or one rank). ``HaloExchanger.received_rows``."""
        return None if self.single else self.exchanger.received_rows(settings, width)

    def received_input_rows(self, width: int) -> torch.Tensor | None:
        """bool ``(n_halo,)``: the rows of the last ``input_halo`` that were sent (None: every
        row, as the features' kept rows are)."""
        return None

    def aggregate(self, graph, src: torch.Tensor, settings: ExchangeSettings,
                  modules: Modules = (None, None)) -> torch.Tensor:
        """``A @ [src_owned; src_halo]`` ``(n_owned, w)``; the exchange overlaps ``owned @ src``."""
        local, halo = self.halo_rows(src, settings, lambda: graph.owned @ src, modules)
        # in place: the sum's own (n_owned, w) block beside both terms was the peak of a wide
        # layer (``local`` is not saved for backward; the same bits)
        return local if halo is None else local.add_(graph.halo @ halo)

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of this propagation (None: nothing)."""
        return None

    def connect(self) -> None:
        """Collective set-up after the start-up agreement (the exchanger's is lazy)."""

    def load_state_dict(self, state: dict | None) -> None:
        pass


class StalePropagation(HaloPropagation):
    """PipeGCN's stale exchange of the layer input in training; synchronous in evaluation."""

    exchanges_input = True

    def __init__(self, exchanger: HaloExchanger, stale: StaleExchange):
        super().__init__(exchanger, stale.progress)
        self.stale = stale

    def input_halo(self, h: torch.Tensor, settings: ExchangeSettings) -> torch.Tensor:
        """The halo rows of the input ``h`` that this training step uses (posted ``s`` ago)."""
        return self.stale.exchange(h, settings)

    def received_input_rows(self, width: int) -> torch.Tensor | None:
        """The rows of the last ``input_halo`` that their epoch's ``sample`` stage sent (the
        epoch they were posted at: ``StaleExchange.received_rows``)."""
        return None if self.single else self.stale.received_rows(width)

    def state_dict(self) -> dict:
        return self.stale.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None:
            self.stale.load_state_dict(state)


class ConstantPropagation(HaloPropagation):
    """The first layer of a stale run, or of a synchronous one with ``train.keep_features``:
    its input never changes, so its halo rows are exchanged
    once (identity codec, no backward: the features need no gradient) and kept on the rank,
    ``(n_halo, F_in)`` fp32. A resume fetches them once more before its first step
    (``GNN.fetch_kept_input``). ``progress``: the later
    layers' stale exchanges, which this layer's work progresses at its points."""

    exchanges_input = True
    keeps_input = True

    def input_halo(self, h: torch.Tensor, settings: ExchangeSettings) -> torch.Tensor:
        return self.kept_input_halo(h, settings.epoch)


class SpmmPropagation:
    """CAGNET's distributed SpMM (``hpcgnn.comm.cagnet``): ``spmm(src)`` is ``A[i, :] @ H``."""

    exchanges_input = False
    eval_kept = False            # no halo rows to keep

    def __init__(self, spmm):
        self.spmm = spmm

    def connect(self) -> None:
        """The operator's process-grid communicators (collective; made once for all layers)."""
        self.spmm.connect()

    def aggregate(self, graph, src: torch.Tensor, settings: ExchangeSettings,
                  modules: Modules = (None, None)) -> torch.Tensor:
        return self.spmm(src)

    def halo_rows(self, src, settings, local, modules=(None, None)):
        raise NotImplementedError("a distributed SpMM has no halo rows (refused by "
                                  "hpcgnn.combinations.check_combination)")

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass
