"""VARCO's ``learned`` codec as the authors' code applies it (issue 23), on real ranks: the
encoder/decoder pair touches the halo rows only while the exchange compresses.

- at ratio 1 the pair is never applied, so a ``learned`` run at ratio 1 is full communication,
  bit for bit (before the fix, ``decoder(encoder(.))`` was applied at every ratio and drifted
  from the identity under Adam: 76.0 % against 82.0 % on Cora);
- the pair starts as the identity and making it draws nothing from the global RNG, so the
  first step of a ``learned`` run is the first step of the same ``truncate`` run, bit for bit;
- while compressing, the pair trains (its parameters leave the identity).
This file is also the MPI worker (one launch, several trainings).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import check_ok, read_metrics, run_mpi  # noqa: E402

# the ranks' worker: test_compressed.py's (hpcgnn train with each schedule in turn, into OUT/NAME)
TRAIN_SCHEDULES = Path(__file__).resolve().with_name("test_compressed.py")
GRAPH = "csbm:nodes=3000,classes=4,degree=8,features=48,seed=3"
RUN = """
[model]
hidden = 16
layers = 2
[train]
epochs = 6
eval_every = 1
"""
VARCO = 'kind = "linear"\nmax_ratio = 16.0\nmin_ratio = 1.0\nslope = 1.0\n'   # k = 1,1,1,3,16,16
SCHEDULES = {
    "full": 'codec = "none"\nkind = "constant"\nratio = 1.0\n',
    "learned-ratio1": 'codec = "learned"\nkind = "constant"\nratio = 1.0\n',
    "truncate": 'codec = "truncate"\n' + VARCO,
    "learned": 'codec = "learned"\n' + VARCO,
}


@pytest.mark.mpi
def test_learned_pair_only_while_compressing(shards, tmp_path):
    (tmp_path / "run.toml").write_text(RUN)
    for name, text in SCHEDULES.items():
        (tmp_path / f"{name}.toml").write_text(text)
    proc = run_mpi(2, [str(TRAIN_SCHEDULES), str(shards(GRAPH, 2, "random")), str(tmp_path),
                       *SCHEDULES], timeout=240)
    check_ok(proc)
    m = {name: read_metrics(tmp_path / name) for name in SCHEDULES}
    keys = ("loss", "train_acc", "val_acc", "test_acc", "bytes_sent")
    assert [[r[k] for k in keys] for r in m["learned-ratio1"]] == \
        [[r[k] for k in keys] for r in m["full"]]                      # bit for bit
    assert m["learned"][0]["loss"] == m["truncate"][0]["loss"]         # same start, same step 0
    assert m["learned"][0]["bytes_sent"] == m["truncate"][0]["bytes_sent"]
    state = torch.load(tmp_path / "learned" / "checkpoint.pt", weights_only=True)["model"]
    enc = state["layers.0.encoder.weight"]
    assert not torch.equal(enc, torch.eye(enc.shape[0]))               # it trained while k < F
    assert "layers.1.encoder.weight" not in state                       # last layer: none
