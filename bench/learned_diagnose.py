"""Why VARCO's ``learned`` codec lost 5 pt on Cora (issue 23): one real training per variant,
each changing one thing about how the learned encoder/decoder pair is applied.

    mpiexec -n 4 python -m mpi4py bench/learned_diagnose.py --shards shards/cora-4 \
        --schedule S.toml --seeds 0 1 2 --variants old frozen codec-lr1e-4 old-ratio1 \
        --out runs/learned-diagnose

Variants (everything else is the run of ``configs/cora.toml`` with the schedule given):
- ``now``          the codec as this checkout applies it (``hpcgnn.nn.propagation``);
- ``old``          as it was before issue 23: ``decoder(encoder(x))`` on the halo rows at every
                   ratio, ratio 1 included, and in evaluation, with identity-initialised
                   ``F x F`` maps and Adam at the model's ``lr``;
- ``frozen``       ``old`` with the pair's parameters never updated (stays the identity: the
                   same run as ``truncate``, a control);
- ``codec-lrX``    ``old`` with the pair's Adam learning rate X instead of ``train.lr``;
- ``old-ratio1``   ``old`` with the pair bypassed where the forward codec sends every channel
                   (ratio 1) and in evaluation.
Per run it prints the test accuracy (at the best validation epoch) and, at the epoch the ratio
reaches 1 and at the end, how far the pair is from the identity: ``||E - I||_F``, ``||D - I||_F``
and the relative error ``||D E x - x|| / ||x||`` of the rows rank 0 sends.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hpcgnn.comm.context import CommContext
from hpcgnn.config import load_config
from hpcgnn.nn import propagation
from hpcgnn.schedule import load_schedule
from hpcgnn.train.build import prepare_trainer

CURRENT = propagation.HaloPropagation.halo_rows


def _old(self, src, settings, local, modules=(None, None)):
    """The pre-issue-23 application: the pair around every exchange, every ratio, eval too."""
    encoder, decoder = modules
    handle = self.exchanger.start(src, settings, encoder)
    out = local()
    halo = self.exchanger.finish(handle, decoder)
    return out, (None if self.single else halo)


def _old_ratio1(self, src, settings, local, modules=(None, None)):
    """``old`` with the pair only where the forward codec selects channels."""
    return _old(self, src, settings, local, modules if settings.forward.channels == "learned"
                else (None, None))


def _codec_params(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".encoder." in n or ".decoder." in n]


def _set_codec_lr(trainer, lr: float) -> None:
    codec = {id(p) for p in _codec_params(trainer.model)}
    groups = []
    for g in trainer.opt.param_groups:
        for part in ([p for p in g["params"] if id(p) in codec],
                     [p for p in g["params"] if id(p) not in codec]):
            if part:
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": part,
                               "lr": lr if id(part[0]) in codec else g["lr"]})
    trainer.opt = torch.optim.Adam(groups, lr=trainer.cfg.train.lr)


def _drift(trainer) -> dict:
    """Distance of every pair from the identity, and its error on rank 0's sent rows."""
    out = {}
    for i, layer in enumerate(trainer.model.layers):
        if layer.encoder is None:
            continue
        e, d = layer.encoder, layer.decoder
        eye = torch.eye(e.weight.shape[0])
        with torch.no_grad():
            x = trainer.model_inputs[i]
            y = d(e(x))
            rel = float((y - x).norm() / x.norm().clamp(min=1e-30))
        out[f"layer{i}"] = {"enc_dist": float((e.weight - eye).norm()),
                            "dec_dist": float((d.weight - eye).norm()), "rel_err": rel}
    return out


def _capture_inputs(trainer) -> None:
    """Keep the rows each layer's exchange is handed (the encoder's input) at the last step."""
    trainer.model_inputs = {}
    for i, layer in enumerate(trainer.model.layers):
        if layer.encoder is None:
            continue
        ex = layer.prop.exchanger

        def hook(module, args, i=i, ex=ex):
            trainer.model_inputs[i] = args[0].detach().clone()
        layer.encoder.register_forward_pre_hook(hook)


def run_one(ctx, args, variant: str, seed: int) -> dict:
    cfg = load_config("configs/cora.toml", [f"train.seed={seed}"])
    out = Path(args.out) / f"{variant}-{seed}"
    propagation.HaloPropagation.halo_rows = {"old": _old, "frozen": _old,
                                              "old-ratio1": _old_ratio1}.get(
        variant.split("-lr")[0] if variant.startswith("codec") else variant,
        _old if variant.startswith("codec") else CURRENT)
    trainer = prepare_trainer(ctx, cfg, args.shards, out, load_schedule(args.schedule))
    if variant == "frozen":
        for p in _codec_params(trainer.model):
            p.requires_grad_(False)
    if variant.startswith("codec-lr"):
        _set_codec_lr(trainer, float(variant[len("codec-lr"):]))
    _capture_inputs(trainer)
    trainer.start()
    drift = {}
    run_epoch = trainer.run_epoch

    def watched(epoch):
        rec = run_epoch(epoch)
        if epoch in (args.watch, cfg.train.epochs - 1):
            drift[epoch] = _drift(trainer)
        return rec
    trainer.run_epoch = watched
    trainer.run()
    summary = json.loads((out / "summary.json").read_text()) if ctx.is_root else {}
    return {"variant": variant, "seed": seed, "test_acc": summary.get("test_acc"),
            "final_test_acc": summary.get("final_test_acc"), "drift": drift}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", required=True)
    ap.add_argument("--schedule", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=["old", "frozen", "codec-lr1e-4",
                                                      "old-ratio1", "now"])
    ap.add_argument("--watch", type=int, default=40, help="epoch to report drift at besides the last")
    ap.add_argument("--out", default="runs/learned-diagnose")
    args = ap.parse_args()
    ctx = CommContext.from_world("cpu")
    for seed in args.seeds:
        for variant in args.variants:
            res = run_one(ctx, args, variant, seed)
            if ctx.is_root:
                print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
