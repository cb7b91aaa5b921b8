"""RETEXO's lazy message passing (Kolluri et al., arXiv 2302.13053) as a training method:
``train.method = "retexo"``. The ``Trainer`` drives it (epochs, metrics, evaluation, checkpoints,
preemption, run records, summary); this subclass supplies the model and the step.

The model (``hpcgnn.nn.retexo.RetexoGNN``) is trained one layer at a time. An epoch is one
*round*, and ``train.epochs = model.layers * train.rounds_per_layer``. Stage ``l`` covers epochs
``[l R, (l + 1) R)``, and at its first round it does this:

1. **Exchange once.** Its input rows are exchanged once through layer ``l``'s ``HaloExchanger``,
   with the schedule's forward codec for ``(epoch l R, layer l)``, so a schedule can compress them.
   By default this is uncompressed, and then the method is exact. Stage 0's input is the raw
   features; stage ``l`` takes stage ``l - 1``'s embedding.
2. **Aggregate once.** ``A [x; x_halo]`` is computed once, on the owned and halo rows, for
   evaluation and the embedding. With dropout, each training round drops a fresh mask from
   ``x`` and the halo rows and aggregates those again (local, no exchange).
3. **Fresh optimiser.** A new Adam is made over the stage's parameters (``train.weight_decay_on``
   groups).

Each round is then a local full-batch step and ONE Allreduce of the stage's gradients and the
loss. The loss is the sum over owned training nodes divided by the global training-node count,
and no halo row moves. The stage's state with the best validation accuracy (strictly greater)
among its evaluated rounds is kept; its last round is always evaluated. After the last round,
that state is loaded back, and its embedding ``ReLU(LayerNorm(conv_l(x)))`` becomes the next
stage's input. Evaluation runs the current stage of the trained stack: stage ``l``'s head on
its embedding, or the last convolution's output. It needs no exchange, because earlier stages are
frozen and their output is the stage's input.

**Volume.** Stage ``l`` sends ``sum(send_counts) * F_l * 4`` bytes per rank, once (identity
codec; ``F_0`` = feature width, else ``hidden``), with no backward exchange. Each round
all-reduces ``(stage parameters + 1) * 4`` bytes per rank. Full training, by comparison,
exchanges every layer forward and backward every epoch. ``summary.json`` gives ``stages``:
exchange, fp32 and all-reduce bytes, best validation accuracy, test accuracy at it, and best
epoch, per stage. ``metrics.jsonl`` lines carry ``stage``.

**Checkpoint.** A checkpoint holds the model (all stages), the current stage's Adam, the stage's
best state so far (its parameters), and the per-stage records. The stage's input embeddings are
NOT stored. ``--resume`` recomputes them from the features through the finished stages: ``l``
exchanges, with the same codecs and keys, so they are identical. The checkpoint costs no extra
bytes (an input of ``(n_owned + n_halo) x F_l`` floats per rank stays off rank 0's file), and
resuming into stage ``l`` costs ``l`` extra exchanges. Those are not counted as training bytes,
so a resumed run reports the same bytes as an uninterrupted one.

**What follows aashishkolluri/retexo-distributed** (``trainers/trainer.py``, ``models/gnn.py``):
- the stage architecture: conv, then LayerNorm, ReLU and a linear head to the classes; the last
  stage is the convolution to the classes alone;
- the next stage's input is the embedding after LayerNorm and ReLU, before the head, computed
  without dropout;
- dropout on each stage's input, before the convolution;
- a fresh Adam per stage; the gradients summed with the local losses weighted by local/global
  training count;
- the best-validation state of each stage, chosen by strictly greater accuracy after each
  round's step and loaded back at the stage's end.

**Where this deviates from their code:**
- *GCN normalisation.* GCN uses ``D^-1/2 (A + I) D^-1/2`` with global degrees + 1, exactly as
  full training does, so R ranks equal 1 rank. Their config instantiates DGL's ``GraphConv``
  (``norm='both'``) on a graph without self loops, applied to the in-subgraph of the train, val
  or test nodes of the rank, so a source's degree counts only its edges into that set on that
  rank (their normalisation changes with the partition).
  ``bench/retexo_reference.py`` trains both normalisations outside this package: theirs is
  1.3-1.7 pt *lower* on Cora, so it does not explain the gap to full training.
- *SAGE.* SAGE is this package's mean SAGE, ``W_s x + W_n mean(x_j) + b``. Theirs is
  ``fc(cat[x, mean])``, which is the same function, but their ``CustomSAGEConv`` caches the
  neighbour mean of the stage's first training round, so that term keeps the first round's
  dropout mask; here it draws a fresh one every round, as the self term does in both.
- *Dropout masks.* Dropout is counter-based, keyed by ``(seed, epoch, stage, global id)``, with
  a fresh mask every round, as their GCN (``nn.Dropout`` each round; their ``CustomGraphConv``,
  which would cache the first round's aggregate, is not used by any of their configs).
- *Initialisation.* The heads and LayerNorms are initialised with the model, from the seed.
  Theirs are made at the stage's start. SAGE's ``W_s``, ``W_n`` are Glorot-uniform, zero bias;
  theirs draw ``fc``'s weight and bias uniform in ``+-1/sqrt(2 F_in)`` (GCN: Glorot, as DGL).
- *Learning rate and rounds.* One ``train.lr`` and one ``rounds_per_layer`` for all stages.
- *Nodes without in-edges.* Every training node is in the loss, every validation and test node
  in the accuracies. Theirs leaves such nodes out of both and gives them a zero embedding.
- *Weight decay.* ``weight_decay_on = "all"`` (the default) is theirs; ``first_layer`` decays
  stage 0's convolution alone.
- *Evaluation cadence.* Evaluation follows ``train.eval_every`` (1, the default, is theirs).
- *Architectures.* GAT is not supported (a config error).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hpcgnn.comm.exchange import ExchangeSettings
from hpcgnn.nn.dropout import counter_dropout
from hpcgnn.train import checkpoint as ckpt
from hpcgnn.train.optim import make_optimizer
from hpcgnn.train.trainer import RunOptions, RunParts, Trainer


@dataclass
class StageInputs:
    """One stage's fixed input on this rank (float32, the rank's device)."""

    stage: int
    x: torch.Tensor                 # (n_owned, F_l)
    halo: torch.Tensor              # (n_halo, F_l), as received (decoded)
    agg: torch.Tensor               # (n_owned, F_l) = A [x; halo], without dropout
    nonzeros: tuple | None          # (x.nonzero(), halo.nonzero()) when sparse, for dropout


def stage_record(stage: int) -> dict:
    return {"stage": stage, "exchange_bytes": 0, "exchange_bytes_full": 0, "allreduce_bytes": 0,
            "best_val_acc": -1.0, "test_acc": 0.0, "best_epoch": -1}


class RetexoTrainer(Trainer):
    """The ``Trainer`` with RETEXO's model and step; see the module docstring."""

    def __init__(self, parts: RunParts, options: RunOptions = RunOptions()):
        cfg, graph = parts.cfg, parts.model.graph
        self.rounds, self.num_stages = cfg.train.rounds_per_layer, cfg.model.layers
        self.halo_gid = graph.node_ids[graph.n_owned:]
        self.inputs: StageInputs | None = None      # None: not built yet (start, resume, predict)
        self.opt_stage = 0                          # the stage self.opt optimises
        self.best_state: dict | None = None         # the stage's best-validation parameters
        self.stages = [stage_record(s) for s in range(cfg.model.layers)]
        super().__init__(parts, options)

    # -- the pieces the Trainer asks for ------------------------------------------------------
    def make_optimizer(self) -> torch.optim.Optimizer:
        """A fresh Adam over stage ``opt_stage``'s parameters."""
        return make_optimizer(self.model, self.cfg.train, self.model.stage_prefixes(self.opt_stage))

    def stage_of(self, epoch: int) -> int:
        return epoch // self.rounds

    # -- one round ------------------------------------------------------------------------------
    def train_step(self, epoch: int) -> dict:
        """Enter the stage if needed (its one exchange), then one local step and ONE Allreduce
        of the stage's gradients + the loss."""
        stage = self.stage_of(epoch)
        self.model.stats.reset()
        t0 = time.perf_counter()
        self._enter(stage, epoch)
        self.model.train()
        self.opt.zero_grad(set_to_none=False)
        logits = self._stage_logits(epoch, training=True)
        params = [p for _, p in self.model.stage_parameters(stage)]
        return self.finish_step(logits, params, self._ratios(), t0)

    def _stage_logits(self, epoch: int, training: bool) -> torch.Tensor:
        """``(n_owned, C)`` of the current stage; dropout (training) on owned and halo rows,
        keyed by global id, so every rank drops a row the same way."""
        inp, p = self.inputs, self.cfg.model.dropout
        if not training or p == 0.0:
            return self.model.stage_forward(inp.stage, inp.x, agg=inp.agg)[0]
        nz_x, nz_h = inp.nonzeros or (None, None)
        seed = self.cfg.train.seed
        x = counter_dropout(inp.x, self.data.global_id, p, seed, epoch, inp.stage, True, nz_x)
        halo = counter_dropout(inp.halo, self.halo_gid, p, seed, epoch, inp.stage, True, nz_h)
        return self.model.stage_forward(inp.stage, x, halo=halo)[0]

    def _ratios(self) -> list[float]:
        """Per layer: the ratio of its one exchange (at its stage's first epoch)."""
        L = self.num_stages
        return [float(self.policy.ratio(s * self.rounds, s, L)) for s in range(L)]

    # -- stages -----------------------------------------------------------------------------------
    def _enter(self, stage: int, epoch: int) -> None:
        """Make ``stage``'s inputs and optimiser current (no-op inside a stage)."""
        if self.inputs is None or self.inputs.stage != stage:
            self._prepare_inputs(stage, epoch)
        if self.opt_stage != stage:
            self.opt_stage = stage
            self.opt = self.make_optimizer()
            self.best_state = None
            p = self.progress                          # best-validation tracking: this stage's
            p.best_val_acc, p.test_at_best, p.best_epoch = -1.0, 0.0, -1

    @torch.no_grad()
    def _prepare_inputs(self, stage: int, epoch: int) -> None:
        """The stage's input: the previous stage's embedding exchanged once; after a start or
        a resume, rebuilt from the features through the finished stages (their exchanges are
        repeats, not counted; only the stage's own exchange at its first round is)."""
        if self.inputs is not None and self.inputs.stage == stage - 1:
            self.inputs = self._exchange(stage, self._embedding())
            return
        self.inputs = self._exchange(0, self.data.x)
        for s in range(1, stage + 1):
            self.model.stats.reset()
            self.inputs = self._exchange(s, self._embedding())
        if epoch != stage * self.rounds:               # resumed inside the stage: counted before
            self.model.stats.reset()

    def _embedding(self) -> torch.Tensor:
        """The current stage's embedding ``ReLU(LayerNorm(conv(x)))`` ``(n_owned, hidden)``."""
        self.model.eval()
        inp = self.inputs
        return self.model.stage_forward(inp.stage, inp.x, agg=inp.agg)[1]

    def _exchange(self, stage: int, x: torch.Tensor) -> StageInputs:
        """ONE exchange of the boundary rows of ``x`` ``(n_owned, F)`` through layer
        ``stage``'s exchanger: ``sum(send_counts) * F * 4`` bytes per rank (identity codec)."""
        start, width = stage * self.rounds, int(x.shape[1])
        ex = self.model.layers[stage].prop.exchanger
        codec = self.policy.forward_codec(start, stage, self.num_stages, width)
        x = x.contiguous()
        halo = ex.exchange(x, ExchangeSettings(start, codec))
        nonzeros = None
        if x.numel() and float(torch.count_nonzero(x)) / x.numel() < 0.5:   # e.g. bag-of-words
            nonzeros = (x.nonzero(as_tuple=True), halo.nonzero(as_tuple=True))
        return StageInputs(stage, x, halo, self.model.aggregate(x, halo), nonzeros)

    def run_epoch(self, epoch: int) -> tuple[dict, bool]:
        stage = self.stage_of(epoch)
        before = self.progress.allreduce_bytes
        record, stop = super().run_epoch(epoch)
        rec = self.stages[stage]
        rec["exchange_bytes"] += record["bytes_sent"]
        rec["exchange_bytes_full"] += record["bytes_full"]
        rec["allreduce_bytes"] += self.progress.allreduce_bytes - before
        if (epoch + 1) % self.rounds == 0:
            self._finish_stage(stage)
        return {"epoch": epoch, "stage": stage, **record}, stop

    def _track_best(self, epoch: int, accs: dict) -> bool:
        improved = super()._track_best(epoch, accs)
        if improved:
            self.best_state = {n: p.detach().clone()
                               for n, p in self.model.stage_parameters(self.stage_of(epoch))}
        return improved

    @torch.no_grad()
    def _finish_stage(self, stage: int) -> None:
        """Load the stage's best-validation state back; record its accuracies."""
        for name, p in self.model.stage_parameters(stage):
            p.copy_(self.best_state[name])
        p = self.progress
        self.stages[stage].update(best_val_acc=p.best_val_acc, test_acc=p.test_at_best,
                                  best_epoch=p.best_epoch)

    def _eval_due(self, epoch: int) -> bool:
        return super()._eval_due(epoch) or (epoch + 1) % self.rounds == 0

    @torch.no_grad()
    def eval_logits(self, epoch: int) -> torch.Tensor:
        """The current stage's logits (no exchange). Before any stage is built (``hpcgnn
        predict``): the whole trained stack from the features, one exchange per layer."""
        if self.inputs is None:
            return super().eval_logits(epoch)
        self.model.eval()
        return self._stage_logits(epoch, training=False)

    # -- checkpoints and outputs ------------------------------------------------------------------
    def checkpoint_state(self, rank_files: str | None = None) -> dict:
        return {**super().checkpoint_state(rank_files),
                "retexo": {"opt_stage": self.opt_stage, "best_state": self.best_state,
                           "stages": [dict(r) for r in self.stages]}}

    def load_state(self, state: dict) -> None:
        retexo = state.get("retexo")
        if retexo is None:
            raise ckpt.CheckpointError(
                f"{self.run_dir / ckpt.CHECKPOINT_NAME}: not a checkpoint of train.method = "
                f"'retexo'; resume it with its own config, or use another --out directory")
        self.opt_stage = int(retexo["opt_stage"])
        self.opt = self.make_optimizer()               # the checkpoint's stage's Adam
        super().load_state(state)
        self.best_state, self.stages, self.inputs = retexo["best_state"], retexo["stages"], None

    def check_prediction_state(self, state: dict) -> None:
        done, epochs = int(state["progress"]["epochs_done"]), self.cfg.train.epochs
        if done < epochs:
            raise ckpt.CheckpointError(
                f"{self.run_dir / ckpt.CHECKPOINT_NAME}: this RETEXO run stopped after {done} of "
                f"{epochs} epochs (stage {self.stage_of(done - 1) + 1} of {self.num_stages}), so the "
                f"later layers are untrained; finish it with `hpcgnn train ... --resume`, then predict")

    def summary(self) -> dict:
        return {**super().summary(), "method": "retexo", "rounds_per_layer": self.rounds,
                "stages": [dict(r) for r in self.stages]}
