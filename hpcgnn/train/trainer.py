"""The trainer: full-batch training of one GNN by all ranks together.

Per epoch (every rank, same order of collectives):
  forward   one (I)Alltoallv per layer (the halo rows; codec from the policy)
  backward  one reverse (I)Alltoallv per layer whose exchanged rows need a gradient
  step      one flat Allreduce (SUM) of all gradients + the loss; Adam on every rank
  eval      every train.eval_every epochs: a synchronous forward (uncompressed, or through the
            training codecs with train.eval_codec = "train"; the first layer on the features'
            halo rows kept on the rank where training keeps them, train.eval_features), one
            small Allreduce of counts;
            metrics.jsonl records its time apart (eval_s) and the epoch's wall clock (wall_s)
  tune      kind = "auto" only, at its decision epochs: two small Allreduces of what the
            exchanges measured and one small Bcast of rank 0's decision (hpcgnn.train.autotuning)
  end       one small Allreduce: preemption flag, byte counts, times, a digest of the weights
            (where the ranks' copies differ: one small Gather and a Bcast of rank 0's;
            hpcgnn.train.replicas)
  record    at evaluated epochs and before a checkpoint: one small Gather to rank 0 of each
            rank's own bytes and times since the last one (``per_rank``; hpcgnn.train.perrank)
  summary   one small Allreduce (MAX): the ranks' peak resident and device memory
The loss is the sum over the owned training nodes divided by the GLOBAL number of training
nodes, so the summed gradient is exactly the single-process gradient.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from hpcgnn.autotune import signature, steps_note
from hpcgnn.codecs.base import CompressionPolicy
from hpcgnn.comm.collectives import (allreduce_sum_, bcast_bytes, broadcast_params_, max_float64,
                                     sum_float64)
from hpcgnn.comm.context import CommContext, mpi_library
from hpcgnn.comm.exchange import ExchangeSettings
from hpcgnn.config import Config
from hpcgnn.log import get_logger
from hpcgnn.nn.step import Step
from hpcgnn.train import checkpoint as ckpt
from hpcgnn.train.autotuning import start_run, tune, with_probes
from hpcgnn.train.inputs import PartInputs
from hpcgnn.train.eta import EpochReporter, format_eta
from hpcgnn.train.metrics import SUMMARY_NAME, MetricsSink
from hpcgnn.train.optim import decays, make_optimizer
from hpcgnn.train.perrank import RankWindow
from hpcgnn.train.perrank import summary as rank_summary
from hpcgnn.train.preempt import clear_marker, process_flag, write_marker
from hpcgnn.train.records import RunRecord, check_resume
from hpcgnn.train.replicas import ReplicaCheck
from hpcgnn.train.writes import fatal_if_unwritable

log = get_logger()


@dataclass
class Progress:
    """Everything that accumulates over epochs (and survives a checkpoint)."""

    epochs_done: int = 0
    bytes_sent: int = 0
    bytes_full: int = 0
    allreduce_bytes: int = 0
    eval_bytes: int = 0          # evaluation's (uncompressed) exchanges, apart from training's
    epoch_times: list = field(default_factory=list)   # the training step of every epoch (s)
    eval_times: list = field(default_factory=list)    # evaluation's time, 0 when not evaluated
    best_val_acc: float | None = -1.0     # None: no labelled validation node
    test_at_best: float | None = 0.0
    best_epoch: int = -1
    final_test_acc: float | None = 0.0    # None: no labelled test node
    # rank 0's per-rank figures (hpcgnn.train.perrank): totals since epoch rank_from, those
    # gathered at a checkpoint not yet in a metrics line, and where that line's window starts
    rank_totals: list | None = None
    rank_from: int = 0
    rank_pending: list | None = None
    rank_window_from: int = 0


@dataclass
class RunParts:
    """What the builder (``hpcgnn.train.build``) made for one rank: the run's context, config,
    directory, the shard set's ``meta.json``, this rank's tensors, the model and the bound
    compression policy; ``row_copies``: on how many ranks each node's row lives (CAGNET's
    replicas; 1 for the halo algorithm)."""

    ctx: CommContext
    cfg: Config
    run_dir: Path
    meta: dict
    data: PartInputs
    model: torch.nn.Module
    policy: CompressionPolicy
    row_copies: int = 1


@dataclass
class RunOptions:
    """How this start of the run goes: ``resume`` (with rank 0's ``resume_bytes`` of the
    checkpoint), the run ``record`` (written to RUN_DIR, checked on ``--resume`` unless
    ``force``), ``stop_after`` (checkpoint and stop once this many epochs are done)."""

    resume: bool = False
    resume_bytes: bytes | None = None
    record: RunRecord | None = None
    force: bool = False
    stop_after: int | None = None


class Trainer:
    """Holds one rank's state: context, config, data, model, optimiser, progress."""

    def __init__(self, parts: RunParts, options: RunOptions = RunOptions()):
        """Local set-up only (no collectives), so every rank can fail here cleanly."""
        self.ctx, self.cfg, self.run_dir, self.meta = parts.ctx, parts.cfg, Path(parts.run_dir), parts.meta
        self.data, self.model, self.policy = parts.data, parts.model, parts.policy
        self.row_copies = parts.row_copies
        self.record, self.force, self.stop_after = options.record, options.force, options.stop_after
        self.params = list(self.model.parameters())
        self.opt = self.make_optimizer()
        self.progress = Progress()
        self.resume, self.resume_bytes = options.resume, options.resume_bytes
        self.resume_state = self.resume_stale = None
        if self.resume_bytes is not None:            # checked here, before any comm
            self._read_resume(ckpt.decode_checkpoint(self.resume_bytes, self.run_dir))
        self.sink = MetricsSink(self.run_dir, enabled=self.ctx.is_root)
        self.preempt = process_flag()      # installed by `hpcgnn train` before torch
        self._auto_start: dict | None = None          # kind = "auto": epoch 0's codecs, for its record
        self._saved_epochs = 0                  # epochs done at the last checkpoint saved or resumed
        self.rank_window = RankWindow()         # this rank's bytes and times since the last record
        self.replicas = ReplicaCheck(self.ctx, self.params)   # the weights' copies, checked each epoch

    def make_optimizer(self) -> torch.optim.Optimizer:
        return make_optimizer(self.model, self.cfg.train)        # groups: train.weight_decay_on

    # -- start-up (collectives) ---------------------------------------------------------
    def start(self) -> None:
        """Agree on the global training-node count and the initial (or resumed) state."""
        if hasattr(self.model, "connect"):          # e.g. CAGNET's process grid: after the agreement
            self.model.connect()
        labelled = self.data.y >= 0
        counts = sum_float64(self.ctx, [float(self.data.train.sum()),
                                        float((self.data.val & labelled).sum())])
        self.n_train = max(int(counts[0]), 1)      # each replica's copy counted: the loss's scale
        if counts[1] == 0 and self.ctx.is_root:
            log.warning("the shard set has no labelled validation node: val_acc and val_loss are "
                        "null, and summary.json's test_acc is the last evaluation's, not one at a "
                        "best validation (give the input a val_idx of labelled nodes to select on)")
        broadcast_params_(self.ctx, [p.data for p in self.params])
        if self.resume:
            self._load_resume_state()
            self._fetch_kept_rows()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.ctx.is_root:                       # no rank saves before epoch 0's Allreduce
            ckpt.remove_temporaries(self.run_dir)
        with fatal_if_unwritable(self.ctx, self.run_dir, self._kept()):
            if self.ctx.is_root and self.record is not None:
                self.record.write(self.run_dir, resumed=self.resume, ranks=self.ctx.size)
            self.sink.start(self.progress.epochs_done)
        self.preempt.install()
        s, epochs = self.cfg.train.staleness, self.cfg.train.epochs
        if s >= epochs and self.ctx.is_root:
            log.warning("train.staleness = %d >= train.epochs = %d: every epoch is one of the "
                        "synchronous warm-up's (it also posts rows for epoch t + s, which no epoch "
                        "reads), so nothing trains stale; lower train.staleness, or use 0", s, epochs)
        log.info("%d rank%s on %s; %s, %d layers, hidden %d; %d training nodes in all",
                 self.ctx.size, "s" * (self.ctx.size != 1), self.ctx.device, self.cfg.model.arch,
                 self.cfg.model.layers, self.cfg.model.hidden, int(counts[0]) // self.row_copies)

    def _read_resume(self, state: dict) -> None:
        """The decoded checkpoint, checked (config, schedule, shards), and a stale run's own
        rank file (checked against it): local reads only, so a refusal is clean."""
        self._check_state(state)
        self.resume_state = state
        if self.cfg.train.staleness:
            self._check_staleness(state)
            self.resume_stale = ckpt.load_rank_state(self.run_dir, self.ctx.rank, self.ctx.size,
                                                     state)

    def _load_resume_state(self) -> None:
        state = self.resume_state
        if not self.cfg.train.staleness and self.ctx.size > 1:    # rank 0's bytes, broadcast
            data = bcast_bytes(self.ctx, self.resume_bytes)
            state = None if data is None else ckpt.decode_checkpoint(data, self.run_dir)
        if state is None:
            log.warning("--resume: no %s in %s; starting from epoch 0", ckpt.CHECKPOINT_NAME,
                        self.run_dir)
            return
        self.load_state(state)
        self._saved_epochs = self.progress.epochs_done
        self.rank_window.restart(self.progress, self.progress.epochs_done, self.ctx.size)
        if self.resume_stale is not None:                 # this rank's own buffers only
            self.model.load_stale_state(self.resume_stale)
            self.resume_stale = None
        self.resume_state = None
        if self.ctx.is_root:
            clear_marker(self.run_dir)
            if self.progress.epochs_done < self.cfg.train.epochs:   # a finished run given more
                self.sink.drop_summary()        # epochs (--force): its summary is not the run's
        log.info("resumed from %s after epoch %d", self.run_dir / ckpt.CHECKPOINT_NAME,
                 self.progress.epochs_done - 1)

    def _fetch_kept_rows(self) -> None:
        """A resumed run's first layer fetches the features' halo rows it keeps (any stale run,
        ``train.keep_features``, ``train.eval_features = "kept"``) here, before its first epoch,
        uncounted: the uninterrupted run counted that fetch once, at its first step
        (``bytes_sent``) or evaluation (``eval_bytes``), and the resumed run's totals are its
        totals. Collective (every rank resumes the same model)."""
        fetch = getattr(self.model, "fetch_kept_input", None)       # not RETEXO's model
        if not self.progress.epochs_done or fetch is None:
            return
        if fetch(self.data.x, self.progress.epochs_done) and self.ctx.is_root:
            log.info("--resume: fetched the features' halo rows the first layer keeps again "
                     "(%d B from rank 0; not counted in bytes_sent or eval_bytes, as the "
                     "uninterrupted run counted them once)", self.model.stats.bytes_sent)
        self.model.stats.reset()

    def load_state(self, state: dict) -> None:
        """A decoded checkpoint (``checkpoint_state``'s dict) into this rank's trainer."""
        self.model.load_state_dict(state["model"])
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        self.opt.load_state_dict(state["optimizer"])
        for group, h in zip(self.opt.param_groups, hyper):   # torch keeps the checkpoint's lr,
            group.update(h)                  # betas and decay: this config's (--force changes them)
        torch.set_rng_state(state["torch_rng"])
        self.progress = Progress(**state["progress"])
        if self.policy.adaptive:                         # kind = "auto": the controller's state
            self.policy.load_state_dict(state.get("autotune"))

    def check_prediction_state(self, state: dict) -> None:
        """``hpcgnn predict``, rank 0: raise when the checkpoint cannot give predictions (any
        checkpoint of the whole GNN can)."""

    def _check_state(self, state: dict) -> None:
        """Rank 0 (every rank of a stale run), before any collective: refuse a checkpoint of
        another config, schedule or shard set (``--force`` turns the refusal into warnings);
        accept, and note for ``run.json``, a change of ``records.HARMLESS_KEYS``."""
        where = self.run_dir / ckpt.CHECKPOINT_NAME
        done = int((state.get("progress") or {}).get("epochs_done", 0))
        if done > self.cfg.train.epochs:                 # not even --force: it cannot be undone
            raise ckpt.CheckpointError(
                f"{where}: trained {done} epochs, more than train.epochs = "
                f"{self.cfg.train.epochs}, and a run cannot be shortened; fix: resume with "
                f"train.epochs >= {done}, or start a new run (--force without --resume, or "
                f"another --out)")
        saved_ranks = state.get("ranks")
        if (self.ctx.is_root and saved_ranks not in (None, self.ctx.size)
                and not self.cfg.train.staleness):      # a stale run is refused (its rank files)
            log.warning("--resume on %d ranks of a run checkpointed on %d: the weights go on, but "
                        "the sums run in another order and a schedule that samples or quantises "
                        "per block of the partition draws other rows, so the run equals neither "
                        "rank count's uninterrupted run bit for bit (run.json records each "
                        "start's ranks)", self.ctx.size, saved_ranks)
        if self.record is not None and "record" in state:
            forced, accepted = check_resume(state["record"], self.record, where, self.force)
            self._check_shapes(state, where)                 # what even --force cannot resume
            self._check_decay_groups(state["record"], where)
            for diff in forced if self.ctx.is_root else ():
                log.warning("--force: resuming although %s", diff)
            for diff in accepted if self.ctx.is_root else ():
                log.info("--resume: accepted %s (does not change training; in run.json)", diff)
            self.record = replace(self.record, changed=tuple(accepted), forced=tuple(forced))
            return
        want = self.cfg.to_dict()["model"]              # a checkpoint from before run records
        if state.get("model_config") != want and not self.force:
            raise ckpt.CheckpointError(
                f"{self.run_dir / ckpt.CHECKPOINT_NAME}: written for model {state.get('model_config')}, "
                f"the config asks for {want}; use the run's config or another --out directory")
        self._check_shapes(state, where)

    def _check_staleness(self, state: dict) -> None:
        """Refuse, even with ``--force``, a stale checkpoint of another ``train.staleness`` or
        shard set: its rank files hold the rows in flight of the last ``s`` epochs between the
        parts it was written on, and another ``s`` reads other epochs, another partition other
        rows."""
        record = state.get("record") or {}
        if state.get("rank_files") is None or not record:
            return
        saved = (record.get("config") or {}).get("train", {}).get("staleness")
        now, diffs = self.cfg.train.staleness, []
        if saved not in (None, now):
            diffs.append(f"train.staleness: checkpoint {saved}, now {now}")
        if self.record is not None and record.get("meta_sha256") not in (None,
                                                                         self.record.meta_sha256):
            diffs.append(f"shard set: checkpoint {record.get('shards')}, "
                         f"now {self.record.shards_path}")
        if diffs:
            raise ckpt.CheckpointError(
                f"{self.run_dir / ckpt.CHECKPOINT_NAME}: {'; '.join(diffs)}; its rank files hold "
                f"the rows in flight of the last {saved} epochs between the parts it was written "
                f"on, so this stale run cannot be resumed so, not even with --force; fix: resume "
                f"with the run's own train.staleness and shard set, or start a new run (--force "
                f"without --resume, or another --out)")

    def _check_decay_groups(self, saved: dict | None, where: Path) -> None:
        """Refuse, even with ``--force``, another ``train.weight_decay_on`` (or
        ``weight_decay_codec``) that moves a parameter to the other Adam group: Adam's state is
        stored by position in its groups, so it would load onto other parameters."""
        old = ((saved or {}).get("config") or {}).get("train")
        if old is None:
            return
        keys = {"weight_decay_on": "all", "weight_decay_codec": False}
        then = replace(self.cfg.train, **{k: old.get(k, d) for k, d in keys.items()})
        moved = [n for n, p in self.model.named_parameters()
                 if decays(n, p, then) != decays(n, p, self.cfg.train)]
        if moved:
            diffs = [f"train.{k}: checkpoint {getattr(then, k)!r}, "
                     f"now {getattr(self.cfg.train, k)!r}"
                     for k in keys if getattr(then, k) != getattr(self.cfg.train, k)]
            raise ckpt.CheckpointError(
                f"{where}: {'; '.join(diffs)} moves {', '.join(moved[:3])}"
                f"{', ...' if len(moved) > 3 else ''} to the other Adam group, and Adam's state is "
                f"stored by group, so it cannot be resumed, not even with --force; fix: resume "
                f"with the run's own weight decay groups ({self.run_dir / 'config.toml'}), or "
                f"start a new run (--force without --resume, or another --out)")

    def _check_shapes(self, state: dict, where: Path) -> None:
        """Refuse, even with ``--force``, a checkpoint whose parameters cannot load into this
        model (another width, depth, architecture, feature width or class count)."""
        saved, mine = state.get("model", {}), self.model.state_dict()
        diffs = [f"{k}: checkpoint {list(saved[k].shape) if k in saved else 'absent'}, now "
                 f"{list(mine[k].shape) if k in mine else 'absent'}"
                 for k in sorted(set(saved) | set(mine))
                 if k not in saved or k not in mine or saved[k].shape != mine[k].shape]
        if diffs:
            raise ckpt.CheckpointError(
                f"{where}: its model has other shapes than this config and shard set build ("
                + "; ".join(diffs[:3]) + ("; ..." if len(diffs) > 3 else "") + "), so it cannot "
                "be resumed, not even with --force; fix: resume with the run's own config "
                f"({self.run_dir / 'config.toml'}), or start a new run (--force without --resume, "
                "or another --out)")

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> str:
        """Train to ``train.epochs``; returns 'done', 'preempted', 'stopped' (``--stop-after``)
        or 'diverged' (a training loss that is not finite: every rank holds the same reduced
        loss, so all stop at the same epoch, and the last checkpoint is kept as it was)."""
        epochs, every = self.cfg.train.epochs, self.cfg.run.checkpoint_every
        end = epochs if self.stop_after is None else min(epochs, self.stop_after)
        self.reporter = EpochReporter(self.progress.epochs_done, epochs)
        if self.policy.adaptive and self.progress.epochs_done == 0:   # kind = "auto"
            self._auto_start = start_run(self.ctx, self.policy, list(self.model.layers))
            if self._auto_start is not None and self.ctx.is_root:
                wire = self._auto_start["wire"]        # the bytes objective times nothing
                link = (f"link {1e3 * wire['alpha_s']:.3g} ms + {1e9 * wire['beta_s_per_byte']:.3g}"
                        " ns/B (timed before epoch 0); " if self._auto_start["samples"] else "")
                bits = self._auto_start["bits"]       # empty: the parts share no edge
                log.info("auto: %sepoch 0 sends %s", link,
                         ", ".join(f"{k} {v if v != 32 else 'fp32'}" for k, v in bits.items())
                         or "nothing (no rank sends a halo row)")
        for epoch in range(self.progress.epochs_done, end):
            record, stop = self.run_epoch(epoch)
            done = epoch + 1
            save = stop or done == end or bool(every and done % every == 0)
            if "val_acc" in record or save:          # a record point: every rank, same epochs
                per_rank = self.rank_window.gather(self.ctx, self.progress, epoch,
                                                   "val_acc" in record, self._counts_received())
                if per_rank is not None:
                    record["per_rank"] = per_rank
            with fatal_if_unwritable(self.ctx, self.sink.path, self._kept()):
                self.sink.write(record)
            self.progress.epochs_done = done
            self._log_epoch(record)
            if not math.isfinite(record["loss"]):
                self._report_divergence(epoch, record["loss"])
                self.model.stale_state()     # completes what the stale layers have in flight:
                return "diverged"            # a progress thread testing it aborted MPI_Finalize
            if save:
                self.save_checkpoint()
            if stop and done < epochs:
                if self.ctx.is_root:
                    with fatal_if_unwritable(self.ctx, self.run_dir, self._kept()):
                        write_marker(self.run_dir, epoch, done)
                    log.warning("preempted at epoch %d; resume with --resume", epoch)
                return "preempted"
        if end < epochs:
            done = self.progress.epochs_done
            log.info("stopped after %d epoch%s (--stop-after); continue with --resume", done,
                     "s" * (done != 1))
            return "stopped"
        summary = self.summary()
        with fatal_if_unwritable(self.ctx, self.run_dir / SUMMARY_NAME, self._kept()):
            self.sink.summary(summary)
        return "done"

    def _report_divergence(self, epoch: int, loss: float) -> None:
        """Rank 0: the loss of ``epoch`` is not finite; what is kept and what to do."""
        if not self.ctx.is_root:
            return
        path, every = self.run_dir / ckpt.CHECKPOINT_NAME, self.cfg.run.checkpoint_every
        kept = (f"{path} holds the last saved epoch (run.checkpoint_every = {every}), untouched"
                if path.is_file() else f"no checkpoint was saved before it (run.checkpoint_every "
                f"= {every}; 0 saves at the end only)")
        resume = (", or continue from the checkpoint with --resume --force --set train.lr=..."
                  if path.is_file() else "")         # nothing to resume: --force alone helps
        log.error("epoch %d: the training loss is %s: training diverged, and its weights are no "
                  "longer finite, so the run stops here (%s; metrics.jsonl has every epoch up to "
                  "this one). Fix: a lower train.lr (now %g), or look for inf/NaN in the "
                  "features; then start again with --force%s", epoch, loss, kept,
                  self.cfg.train.lr, resume)

    def run_epoch(self, epoch: int) -> tuple[dict, bool]:
        step = self.train_step(epoch)
        stats = self.model.stats
        ran = self.auto_setting(epoch)                 # kind = "auto": the setting this step ran
        local = [0.0, stats.bytes_sent, stats.bytes_full,
                 stats.comm_s + step["allreduce_s"], stats.codec_s, step["epoch_s"]]
        self.rank_window.add(stats.bytes_sent, stats.bytes_received, step["epoch_s"], local[3],
                             step["epoch_s"] - local[3])         # compute_s: the step less MPI
        t_eval = time.perf_counter()
        accs = self.evaluate(epoch) if self._eval_due(epoch) else {}
        eval_s = time.perf_counter() - t_eval
        # kind = "auto" decides for the next epoch only after the evaluation: with
        # train.eval_codec = "train" it evaluates through the codecs this epoch trained with
        auto = self.tune(epoch, step["loss"])
        local[0] = float(self.preempt.raised)     # read last: a signal during evaluation stops here
        t_agree = time.perf_counter()
        flag, sent, full, comm_s, codec_s, step_s, *copies = sum_float64(  # epoch-end agreement
            self.ctx, local + self.replicas.figures())
        self.replicas.agree(copies, epoch)     # the weights' copies differ: every rank takes rank 0's
        # the step ends when the ranks agree on it: this small Allreduce can wait behind the
        # halo gradients a stale step posted after its gradient Allreduce, so it counts
        epoch_s = step["epoch_s"] + (time.perf_counter() - t_agree)
        if ran is not None:                            # the ranks' mean: the same on every rank
            self.policy.observe_step(ran, step_s / self.ctx.size)
        p = self.progress
        p.bytes_sent, p.bytes_full = p.bytes_sent + int(sent), p.bytes_full + int(full)
        p.allreduce_bytes += step["allreduce_bytes"] * self.ctx.size
        p.epoch_times.append(epoch_s)
        p.eval_times.append(eval_s)
        record = {"epoch": epoch, "loss": step["loss"], "ratio": step["ratio"],
                  "bytes_sent": int(sent), "bytes_full": int(full), "epoch_s": epoch_s,
                  "eval_s": eval_s, "wall_s": epoch_s + eval_s,
                  "comm_s": comm_s / self.ctx.size, "codec_s": codec_s / self.ctx.size, **accs}
        if auto is not None:
            record["auto"] = auto
            if self._auto_start is not None:                      # what epoch 0 ran with
                record["auto"] = {**auto, "start": self._auto_start}
                self._auto_start = None
        self._track_best(epoch, accs)
        return record, flag > 0

    def _counts_received(self) -> bool:
        """Whether the exchange counts received bytes (the halo exchange; not CAGNET's wire)."""
        return bool(self.model.exchangers)

    def auto_setting(self, epoch: int) -> str | None:
        """``kind = "auto"`` on the time objective: the setting (``signature``) epoch ``epoch``
        trained with, whose agreed step time the controller keeps; None for a probe epoch (its
        measurements cost time a plain step does not) and for everything else."""
        if (not self.policy.adaptive or self.policy.settings.objective != "time"
                or self.policy.due(epoch)):
            return None
        return signature(self.policy.state.bits)

    def tune(self, epoch: int, loss: float) -> dict | None:
        """``kind = "auto"``: hand the policy the step's loss and, at a decision epoch, the
        reduced figures; the decision's record (None otherwise, and for schedules)."""
        if not self.policy.adaptive:
            return None
        t0 = time.perf_counter()
        record = tune(self.ctx, self.policy, epoch, loss, self.model.stats, len(self.model.layers))
        if record is not None:                         # the check's own time (reductions, Bcast,
            record["seconds"] = time.perf_counter() - t0   # decision): not in epoch_s
        steps = (record or {}).get("steps", {})
        if self.ctx.is_root and steps.get("verdict", "keep") != "keep":
            log.info("auto: epoch %d: %s", epoch, steps_note(steps))
        return record

    def train_step(self, epoch: int) -> dict:
        """One full-batch step: forward, backward, ONE gradient Allreduce, Adam."""
        step = self.make_step(epoch, training=True)
        self.model.stats.reset()
        t0 = time.perf_counter()
        self.model.train()
        self.opt.zero_grad(set_to_none=False)
        logits = self.model(self.data.x, step)
        return self.finish_step(logits, self.params, self.ratios(epoch), t0)

    def finish_step(self, logits: torch.Tensor, params: list, ratios: list[float], t0: float) -> dict:
        """Loss of ``logits`` ``(n_owned, C)`` (sum over owned training nodes / global count),
        backward, ONE Allreduce of ``params``' gradients + the loss, Adam step."""
        mask = self.data.train
        loss = F.cross_entropy(logits[mask], self.data.y[mask], reduction="sum") / self.n_train
        loss.backward()
        for p in params:                             # a parameter unused this step: zero grad
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        loss_buf = loss.detach().reshape(1).clone()
        t1 = time.perf_counter()
        nbytes = allreduce_sum_(self.ctx, grads + [loss_buf])  # one Allreduce: grads + loss
        t2 = time.perf_counter()
        self.model.post_late_gradients()             # stale layers: behind the Allreduce, not ahead
        self.opt.step()
        if self.ctx.device.type == "cuda":           # the step's kernels are part of its time
            torch.cuda.synchronize(self.ctx.device)
        return {"loss": float(loss_buf.item()), "ratio": ratios, "allreduce_bytes": nbytes,
                "allreduce_s": t2 - t1, "epoch_s": time.perf_counter() - t0}

    def make_step(self, epoch: int, training: bool, codecs: bool = True) -> Step:
        """The step's settings, as data: the dropout seed and, per layer, the exchange settings
        of the schedule at ``epoch`` (``codecs = False``: the identity codec everywhere)."""
        if not codecs:
            return Step(epoch, training, self.cfg.train.seed)
        n = len(self.model.layers)
        # the width of the rows the step's exchange carries: a stale layer's training steps
        # exchange its input, evaluation exchanges synchronously (``HaloLayer.sync_width``)
        widths = [layer.width if training else layer.sync_width for layer in self.model.layers]
        exchanges = tuple(
            ExchangeSettings(epoch, self.policy.forward_codec(epoch, i, n, widths[i]),
                             self.policy.backward_codec(epoch, i, n, widths[i]))
            for i in range(n))
        if training and self.policy.adaptive:          # kind = "auto": what this step measures
            exchanges = tuple(with_probes(ex, self.policy, epoch, i, n)
                              for i, ex in enumerate(exchanges))
        return Step(epoch, training, self.cfg.train.seed, exchanges)

    def ratios(self, epoch: int) -> list[float]:
        """The schedule's ratio of every layer's exchange at ``epoch`` (for the metrics)."""
        n = len(self.model.layers)
        return [float(self.policy.ratio(epoch, i, n)) for i in range(n)]

    @torch.no_grad()
    def eval_logits(self, epoch: int) -> torch.Tensor:
        """Logits ``(n_owned, C)`` of the forward without dropout (one synchronous exchange per
        layer, every rank): uncompressed, or through the training codecs of ``epoch`` with
        ``train.eval_codec = 'train'``."""
        self.model.eval()
        step = self.make_step(epoch, training=False, codecs=self.cfg.train.eval_codec == "train")
        return self.model(self.data.x, step)

    @torch.no_grad()
    def evaluate(self, epoch: int) -> dict:
        """Accuracies of ``eval_logits`` over the LABELLED nodes of each mask (label >= 0) and
        ``val_loss`` (mean cross-entropy over the labelled validation nodes), reduced over
        ranks, and ``eval_bytes``: what evaluation's exchanges sent (all ranks;
        counted apart, so ``bytes_sent / bytes_full`` stays the training compression)."""
        before = self.model.stats.bytes_sent
        logits = self.eval_logits(epoch)
        pred = logits.argmax(dim=1)
        local, labelled = [], self.data.y >= 0
        for mask in (self.data.train, self.data.val, self.data.test):
            mask = mask & labelled
            local += [float((pred[mask] == self.data.y[mask]).sum()), float(mask.sum())]
        val = self.data.val & labelled
        val_loss = F.cross_entropy(logits[val], self.data.y[val], reduction="sum")
        tot = sum_float64(self.ctx, local + [float(val_loss), self.model.stats.bytes_sent - before])
        self.progress.eval_bytes += int(tot[-1])
        accs = {f"{name}_acc": tot[2 * i] / tot[2 * i + 1] if tot[2 * i + 1] else None
                for i, name in enumerate(("train", "val", "test"))}       # None: no labelled node
        return {**accs, "val_loss": tot[-2] / tot[3] if tot[3] else None, "eval_bytes": int(tot[-1])}

    def _eval_due(self, epoch: int) -> bool:
        return (epoch + 1) % self.cfg.train.eval_every == 0 or epoch + 1 == self.cfg.train.epochs

    def _track_best(self, epoch: int, accs: dict) -> bool:
        """Record an evaluation; True when it is the best so far (the first on ties). Without a
        labelled validation node (``val_acc`` None) there is nothing to select on: every
        evaluation is the best so far, so the last one wins (it was epoch 0's, at 0.0 = 0.0)."""
        if not accs:
            return False
        p = self.progress
        p.final_test_acc = accs["test_acc"]
        if accs["val_acc"] is not None and accs["val_acc"] <= p.best_val_acc:
            return False
        p.best_val_acc, p.test_at_best, p.best_epoch = accs["val_acc"], accs["test_acc"], epoch
        return True

    def _log_epoch(self, rec: dict) -> None:
        """Rank 0's progress line: every 5 % of the epochs or every 5 s, with the ETA."""
        epoch = rec["epoch"]
        if self.ctx.is_root and self.reporter.due(epoch):
            accs = " ".join(f"{k} {rec[k]:.4f}" for k in ("train_acc", "val_acc", "test_acc")
                            if rec.get(k) is not None)
            log.info("epoch %d (%d/%d) loss %.5f %s sent %d B (%.1f ms) ETA %s", epoch, epoch + 1,
                     self.cfg.train.epochs,
                     rec["loss"], accs, rec["bytes_sent"], 1e3 * rec["epoch_s"],
                     format_eta(self.reporter.eta_s(epoch)))

    # -- outputs ------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Rank 0's ``checkpoint.pt``; with staleness, first every rank's own rank file (one
        small Bcast of the tag, a Barrier before and after rank 0 writes; see ``checkpoint``)."""
        stale = self.model.stale_state()                 # this rank's own: stays on this rank
        tag = None
        if stale is not None:
            tag = ckpt.new_tag() if self.ctx.is_root else None
            tag = self.ctx.comm.bcast(tag, root=0) if self.ctx.size > 1 else tag
            with fatal_if_unwritable(self.ctx, self.run_dir, self._kept()):
                ckpt.save_rank_state(self.run_dir, self.ctx.rank, self.ctx.size, tag,
                                     self.progress.epochs_done, stale)
            self._barrier()                              # every rank file is in place
        if self.ctx.is_root:
            with fatal_if_unwritable(self.ctx, self.run_dir / ckpt.CHECKPOINT_NAME, self._kept()):
                ckpt.save_checkpoint(self.run_dir, self.checkpoint_state(tag))
        self._saved_epochs = self.progress.epochs_done
        if stale is not None:
            self._barrier()                              # checkpoint.pt names the new tag
            ckpt.prune_rank_files(self.run_dir, self.ctx.rank, self.ctx.size, keep=tag)

    def _kept(self) -> str:
        """What a run directory that could not be written still holds, and how to go on."""
        if not self._saved_epochs:
            return "no checkpoint was saved before this: once fixed, start the run again"
        return (f"{self.run_dir / ckpt.CHECKPOINT_NAME} holds epoch {self._saved_epochs - 1} as "
                f"it was saved: once fixed, continue with --resume")

    def _barrier(self) -> None:
        if self.ctx.size > 1:
            self.ctx.comm.Barrier()

    def checkpoint_state(self, rank_files: str | None = None) -> dict:
        """What ``checkpoint.pt`` holds (rank 0's view; ``rank_files``: the tag of the ranks'
        stale-state files, None without staleness)."""
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "torch_rng": torch.get_rng_state(), "progress": vars(self.progress).copy(),
                "record": None if self.record is None else self.record.fingerprint(),
                "ranks": self.ctx.size, "rank_files": rank_files,
                "autotune": self.policy.state_dict() if self.policy.adaptive else None}

    def summary(self) -> dict:
        """The run's totals for ``summary.json`` (a collective: every rank calls it)."""
        p = self.progress
        return {**peak_memory(self.ctx), "test_acc": p.test_at_best, "final_test_acc": p.final_test_acc,
                "best_val_acc": p.best_val_acc, "best_epoch": p.best_epoch,
                "epochs": p.epochs_done, "bytes_sent": p.bytes_sent, "bytes_full": p.bytes_full,
                "allreduce_bytes": p.allreduce_bytes, "eval_bytes": p.eval_bytes, "train_time_s": sum(p.epoch_times),
                "eval_time_s": sum(p.eval_times), "wall_time_s": sum(p.epoch_times) + sum(p.eval_times),
                "epoch_time_s_median": statistics.median(p.epoch_times) if p.epoch_times else 0.0,
                "ranks": self.ctx.size, "device": str(self.ctx.device),
                "mpi_library": mpi_library(), "cuda_aware_mpi": self.ctx.cuda_aware,
                "dataset": self.meta.get("dataset"), "arch": self.cfg.model.arch,
                "transport": next((ex.transport_mode for ex in self.model.exchangers), None),
                "per_rank": rank_summary(p, p.epochs_done, self._counts_received())}


def peak_memory(ctx: CommContext) -> dict:
    """The largest peak over ranks of the resident set (``ru_maxrss``, the whole process) and,
    on a GPU, of torch's device allocations, in bytes; with what ``hpcgnn.memory`` set
    (``malloc``, ``thp``). One small Allreduce."""
    import resource

    from hpcgnn import memory
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # Linux: KiB
    dev = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
    rss, dev = max_float64(ctx, [float(rss), float(dev)])
    out = {"peak_rss_bytes": int(rss), **memory.state()}
    if ctx.device.type == "cuda":
        out["peak_device_bytes"] = int(dev)
    return out
