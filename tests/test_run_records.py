"""Run records and safe resume on 2 real ranks: RUN_DIR/config.toml, schedule.toml and run.json
are written at start; 5 epochs + ``--resume`` + 5 equal 10 straight epochs bit for bit under a
linear VARCO schedule with the ``random`` codec; ``--resume`` refuses any other config key,
schedule or shard set on every rank, naming the key, and ``--force`` overrides."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from conftest import check_ok, read_metrics, train

pytestmark = pytest.mark.mpi

SCHEDULE = """# linear VARCO, random channels: ratio 16 -> 1 over T = 10 epochs (slope 1)
codec = "random"
kind = "linear"
max_ratio = 16.0
min_ratio = 1.0
slope = 1.0
"""
CONFIG = "configs/cora.toml"


def _train(shard_dir, out, schedule, *sets, extra=()):
    return train(2, shard_dir, out, "train.epochs=10", *sets, config=CONFIG,
                 extra=(("--schedule", str(schedule)) if schedule else ()) + tuple(extra))


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory):
    """(shard_dir, schedule path, straight 10-epoch run, 5 + resume + 5 run)."""
    root = tmp_path_factory.mktemp("records")
    schedule = root / "varco-random.toml"
    schedule.write_text(SCHEDULE)
    shard_dir = shards("cora", 2, "metis")
    check_ok(_train(shard_dir, root / "straight", schedule))
    check_ok(_train(shard_dir, root / "split", schedule, extra=("--stop-after", "5")))
    assert len(read_metrics(root / "split")) == 5 and not (root / "split" / "summary.json").exists()
    check_ok(_train(shard_dir, root / "split", schedule, extra=("--resume",)))
    return shard_dir, schedule, root / "straight", root / "split"


def _weights(run_dir) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]


def test_resume_with_schedule_is_bit_exact(runs):
    _, _, straight, split = runs
    a, b = read_metrics(straight), read_metrics(split)
    assert [r["epoch"] for r in b] == list(range(10))
    assert [r["ratio"] for r in a][0][0] == 16.0 and a[-1]["ratio"][0] == 1.0   # the schedule ran
    for key in ("loss", "ratio", "bytes_sent", "train_acc", "val_acc", "val_loss", "test_acc"):
        assert [r[key] for r in b] == [r[key] for r in a], key
    wa, wb = _weights(straight), _weights(split)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((split / "summary.json").read_text())["epochs"] == 10


def test_run_directory_records(runs):
    from hpcgnn.config import load_config
    shard_dir, schedule, _, split = runs
    cfg = load_config(CONFIG, ["train.epochs=10", f"run.out={split}"])
    assert load_config(split / "config.toml") == cfg                 # every key, resolved
    assert (split / "schedule.toml").read_bytes() == schedule.read_bytes()
    rec = json.loads((split / "run.json").read_text())
    want = hashlib.sha256((shard_dir / "meta.json").read_bytes()).hexdigest()
    assert rec["shards"] == {"path": str(shard_dir.resolve()), "meta_sha256": want}
    assert rec["hpcgnn_version"] == "0.1.0"
    assert [c["resume"] for c in rec["commands"]] == [False, True]
    assert "--stop-after" in rec["commands"][0]["argv"] and "--resume" in rec["commands"][1]["argv"]
    assert "schedule_epoch" not in torch.load(split / "checkpoint.pt", weights_only=True)


def _refused(proc, *words):
    """Refused at start-up: rank 0 (which reads the checkpoint) names every word once."""
    assert proc.returncode != 0, proc.stderr
    line = next((ln for ln in proc.stderr.splitlines() if ln.startswith("[rank 0/2] ERROR rank 0: ")), "")
    assert all(w in line for w in words), (words, proc.stderr)
    assert "--force" in line, line
    assert "[rank 0/2] ERROR rank 1: no error; stopping with the others" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_resume_refuses_other_settings_on_every_rank(runs, shards, tmp_path):
    shard_dir, schedule, _, split = runs
    run = tmp_path / "run"
    shutil.copytree(split, run)
    before = (run / "checkpoint.pt").read_bytes()
    other = tmp_path / "other.toml"
    other.write_text(SCHEDULE.replace("max_ratio = 16.0", "max_ratio = 8.0"))
    # every difference is named in one refusal (one launch checks four kinds of key)
    _refused(_train(shards("cora", 2, "random"), run, other, "train.epochs=20", "train.lr=0.02",
                    extra=("--resume",)),
             "train.epochs: checkpoint 10, now 20", "train.lr: checkpoint 0.01, now 0.02",
             "schedule.max_ratio: checkpoint 16.0, now 8.0", "shard set meta.json sha256")
    _refused(_train(shard_dir, run, None, extra=("--resume",)), "--schedule: checkpoint", "now none")
    assert (run / "checkpoint.pt").read_bytes() == before             # nothing was touched


def test_force_resumes_anyway(runs, tmp_path):
    shard_dir, schedule, _, split = runs
    run = tmp_path / "run"
    shutil.copytree(split, run)
    proc = _train(shard_dir, run, schedule, "train.epochs=12", extra=("--resume", "--force"))
    check_ok(proc)
    assert "--force: resuming although train.epochs: checkpoint 10, now 12" in proc.stderr
    assert [r["epoch"] for r in read_metrics(run)] == list(range(12))
    assert "epochs = 12" in (run / "config.toml").read_text()


def test_resume_accepts_keys_that_do_not_change_the_math_and_records_them(runs, tmp_path):
    """Evaluation and checkpoint cadence and the run directory may change on --resume: the
    run continues bit for bit, and run.json's resume command lists what changed."""
    shard_dir, schedule, straight, _ = runs
    run = tmp_path / "run"
    check_ok(_train(shard_dir, run, schedule, extra=("--stop-after", "5")))
    moved = tmp_path / "moved"
    shutil.move(run, moved)                                   # run.out changes too
    proc = _train(shard_dir, moved, schedule, "train.eval_every=2", "run.checkpoint_every=3",
                  extra=("--resume",))
    check_ok(proc)
    assert "--resume: accepted train.eval_every: checkpoint 1, now 2" in proc.stderr
    got, want = read_metrics(moved), read_metrics(straight)
    assert [r["loss"] for r in got] == [r["loss"] for r in want]          # the math is the same
    assert [r["epoch"] for r in got if "val_acc" in r] == [0, 1, 2, 3, 4, 5, 7, 9]
    last = json.loads((moved / "run.json").read_text())["commands"][-1]
    assert last["resume"] and last["forced"] == []
    assert sorted(c.split(":")[0] for c in last["changed"]) == [
        "run.checkpoint_every", "run.out", "train.eval_every"]
    assert "train.eval_every: checkpoint 1, now 2" in last["changed"]
    assert "eval_every = 2" in (moved / "config.toml").read_text()


def test_harmless_and_math_keys_are_told_apart(tmp_path):
    """The pure check: a math key is refused by name, a harmless one beside it is not named;
    RETEXO's eval_every changes which state each stage keeps, so it is a math key there."""
    from hpcgnn.config import load_config
    from hpcgnn.data.shardset import ShardSet
    from hpcgnn.train.records import ResumeMismatch, RunRecord, check_resume, differences, \
        harmless_changes

    def record(*sets):
        return RunRecord.make(load_config(None, list(sets)), None, ShardSet(tmp_path, {}, "0" * 64))
    old = record("train.eval_every=1").fingerprint()
    now = record("train.eval_every=4", "run.checkpoint_every=2", "train.lr=0.02")
    with pytest.raises(ResumeMismatch) as err:
        check_resume(old, now, tmp_path / "checkpoint.pt", force=False)
    assert "train.lr: checkpoint 0.01, now 0.02" in str(err.value)
    assert "eval_every" not in str(err.value) and "checkpoint_every" not in str(err.value)
    forced, accepted = check_resume(old, now, tmp_path / "checkpoint.pt", force=True)
    assert forced == ["train.lr: checkpoint 0.01, now 0.02"]
    assert accepted == ["run.checkpoint_every: checkpoint 0, now 2",
                        "train.eval_every: checkpoint 1, now 4"]
    retexo = ("train.method=retexo", "train.rounds_per_layer=5", "train.epochs=10")
    r_old, r_now = record(*retexo).fingerprint(), record(*retexo, "train.eval_every=3").fingerprint()
    assert differences(r_old, r_now) == ["train.eval_every: checkpoint 1, now 3"]
    assert harmless_changes(r_old, r_now) == []


def test_a_key_the_checkpoints_version_lacked_counts_as_its_default(tmp_path):
    """A checkpoint of an older hpcgnn has no entry for a key added since
    (``train.weight_decay_on``): it ran with the default, so a resume at the default is no
    difference, one off it is."""
    from hpcgnn.config import load_config
    from hpcgnn.data.shardset import ShardSet
    from hpcgnn.train.records import RunRecord, differences

    def record(*sets):
        return RunRecord.make(load_config(None, list(sets)), None, ShardSet(tmp_path, {}, "0" * 64))
    old = record().fingerprint()
    assert old["config"]["train"].pop("weight_decay_on") == "all"
    assert differences(old, record().fingerprint()) == []
    assert differences(old, record("train.weight_decay_on=first_layer").fingerprint()) == \
        ["train.weight_decay_on: checkpoint 'all', now 'first_layer'"]
