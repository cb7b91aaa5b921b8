"""The ``[comm]`` config section: keys, the environment's overrides (named in the error when
bad), what a run records of both, and that each transport setting trains the same model."""
from __future__ import annotations

import json

import pytest

from conftest import CSBM, check_ok, read_metrics, train_together


def test_environment_overrides_the_section():
    from hpcgnn.comm.settings import CommSettings
    from hpcgnn.config import load_config
    cfg = load_config(None, ["comm.transport=neighbor", "comm.max_message=4096"])
    got = CommSettings.resolve(cfg.comm, {"HPCGNN_EXCHANGE": "alltoallv", "HPCGNN_CUDA_AWARE": "0"})
    assert (got.transport, got.max_message, got.progress, got.cuda_aware) == \
        ("alltoallv", 4096, "test", "false")
    assert got.overridden({"HPCGNN_EXCHANGE": "alltoallv"}) == {"transport": "HPCGNN_EXCHANGE=alltoallv"}
    with pytest.raises(ValueError, match=r"HPCGNN_MAX_MESSAGE='lots': expected a byte count"):
        CommSettings.resolve(None, {"HPCGNN_MAX_MESSAGE": "lots"})
    with pytest.raises(ValueError, match=r"HPCGNN_PROGRESS='async': expected one of test, fine, thread"):
        CommSettings.resolve(None, {"HPCGNN_PROGRESS": "async"})


def test_bad_keys_are_config_errors():
    from hpcgnn.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"comm.transport = 'mpi' is not allowed; use 'auto'"):
        load_config(None, ["comm.transport=mpi"])
    with pytest.raises(ConfigError, match=r"comm.max_message = 0"):
        load_config(None, ["comm.max_message=0"])


@pytest.mark.mpi
def test_transport_keys_train_the_same_model_and_are_recorded(shards, tmp_path):
    shard_dir = shards(CSBM, 3, "random")
    sets = ("train.epochs=4",)
    for proc in train_together(3, [(shard_dir, tmp_path / "auto", sets, {}),
                                   (shard_dir, tmp_path / "nbr", (*sets, "comm.transport=neighbor",
                                    "comm.max_message=900"), {"HPCGNN_LOG_ALL_RANKS": "0"})],
                               tmp_path, timeout=180):
        check_ok(proc)
    want = [r["loss"] for r in read_metrics(tmp_path / "auto")]
    assert [r["loss"] for r in read_metrics(tmp_path / "nbr")] == want
    summary = json.loads((tmp_path / "nbr" / "summary.json").read_text())
    assert summary["transport"] == "neighbor"
    assert json.loads((tmp_path / "auto" / "summary.json").read_text())["transport"] == "alltoallv"
    command = json.loads((tmp_path / "nbr" / "run.json").read_text())["commands"][-1]
    assert command["comm"]["transport"] == "neighbor" and command["comm"]["max_message"] == 900
    assert command["environment"]["HPCGNN_LOG_ALL_RANKS"] == "0"
