"""Stale runs checkpoint their state per rank, on real ranks (3 ranks over a 6-part set).

A stale run (``train.staleness = 2``) stopped after 3 epochs leaves ``checkpoint.pt`` (the
rank count, the tag of its rank files, no stale buffers) and one rank file per rank, each
holding that rank's rows in flight only (every tensor has the rank's own halo or send row
count). Resuming on 3 ranks continues exactly (the losses of an uninterrupted run) and leaves
one set of 3 rank files (and none of the temporary files of saves a kill cut short); each rank
reads only its own file (a bad rank-1 file is named by rank 1 alone); a rank file of another
checkpoint is refused as a mixed set; and resuming on another rank count (2 or 1) is refused
on every rank with the reason and the fix, exit code 2, before any exchange.
"""
from __future__ import annotations

import re
import shutil

import pytest
import torch

from conftest import CSBM, check_ok, read_metrics, train, train_together

pytestmark = pytest.mark.mpi

RANKS, PARTS = 3, 6
SETS = ("model.arch=gcn", "model.hidden=8", "model.dropout=0.5", "train.staleness=2",
        "train.smoothing=0.5", "train.epochs=8")


def _train(ranks, shard_dir, out, *extra):
    return train(ranks, shard_dir, out, *SETS, extra=tuple(extra), timeout=180)


@pytest.fixture(scope="module")
def stale_runs(shards, tmp_path_factory):
    """(shard dir, root): ``straight`` (8 epochs), ``split`` and ``other`` (stopped after 3
    and 4 epochs, same config), all on 3 ranks."""
    root = tmp_path_factory.mktemp("stale-ckpt")
    shard_dir = shards(CSBM, PARTS, "random")
    for proc in train_together(RANKS, [(shard_dir, root / "straight", SETS, {}),
                                       (shard_dir, root / "split", SETS, {}, ("--stop-after", "3")),
                                       (shard_dir, root / "other", SETS, {}, ("--stop-after", "4"))],
                               root):
        check_ok(proc)
    return shard_dir, root


def _rank_files(run_dir) -> dict[int, str]:
    """rank -> tag of the ``checkpoint.rank-RRRRR.TAG.pt`` files in ``run_dir``."""
    out = {}
    for path in run_dir.glob("checkpoint.rank-*.pt"):
        m = re.fullmatch(r"checkpoint\.rank-(\d+)\.([0-9a-f]+)\.pt", path.name)
        assert m and int(m.group(1)) not in out, path.name
        out[int(m.group(1))] = m.group(2)
    return out


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def test_a_stale_checkpoint_holds_one_state_per_rank(stale_runs):
    from hpcgnn.train.inputs import load_part
    shard_dir, root = stale_runs
    run = root / "split"
    head = torch.load(run / "checkpoint.pt", weights_only=True)
    assert head["ranks"] == RANKS and "stale" not in head
    files = _rank_files(run)
    assert sorted(files) == list(range(RANKS)) and set(files.values()) == {head["rank_files"]}
    counts = {r: {load_part(shard_dir, r, RANKS)[1].n_halo,
                  int(load_part(shard_dir, r, RANKS)[1].send_counts.sum())} for r in range(RANKS)}
    assert len({frozenset(c) for c in counts.values()}) == RANKS     # the ranks' counts differ
    for r, tag in files.items():
        data = torch.load(run / f"checkpoint.rank-{r:05d}.{tag}.pt", weights_only=True)
        assert (data["rank"], data["ranks"], data["tag"], data["epochs_done"]) == (r, RANKS, tag, 3)
        rows = {int(t.shape[0]) for t in _tensors(data["state"]) if t.dim() == 2}
        assert rows and rows <= counts[r], (r, rows, counts)        # its own part's rows only


def test_resume_on_the_same_ranks_is_exact_and_keeps_one_set(stale_runs, tmp_path):
    shard_dir, root = stale_runs
    run = tmp_path / "run"
    shutil.copytree(root / "split", run)
    old = set(_rank_files(run).values())
    for r, tag in _rank_files(run).items():          # saves a kill cut short left these behind
        data = (run / f"checkpoint.rank-{r:05d}.{tag}.pt").read_bytes()
        (run / f".checkpoint.rank-{r:05d}.0123456789ab.pt.tmp-{4000 + r}").write_bytes(data[:100])
    (run / ".checkpoint.pt.tmp-3999").write_bytes((run / "checkpoint.pt").read_bytes()[:100])
    for r in (RANKS, RANKS + 1):                     # rank files a run on more ranks left here
        (run / f"checkpoint.rank-{r:05d}.0123456789ab.pt").write_bytes(b"left over")
    check_ok(_train(RANKS, shard_dir, run, "--resume"))
    assert not list(run.glob(".checkpoint*.tmp-*"))
    want = [r["loss"] for r in read_metrics(root / "straight")]
    assert [r["loss"] for r in read_metrics(run)] == want
    files = _rank_files(run)
    head = torch.load(run / "checkpoint.pt", weights_only=True)
    assert sorted(files) == list(range(RANKS)) and set(files.values()) == {head["rank_files"]}
    assert head["rank_files"] not in old                           # the old set was removed


def _refused(proc, ranks: int, *words) -> list[str]:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln]
    who = "rank 0" if ranks == 1 else f"ranks 0-{ranks - 1}"      # every rank hit it
    line = next((ln for ln in errors if ln.startswith(f"[rank 0/{ranks}] ERROR {who}: ")), "")
    assert all(w in line for w in words), (words, proc.stderr)
    return errors


@pytest.mark.parametrize("ranks", [2, 1])
def test_another_rank_count_is_refused_on_every_rank(stale_runs, tmp_path, ranks):
    shard_dir, root = stale_runs
    run = tmp_path / "run"
    shutil.copytree(root / "split", run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.suffix == ".pt"}
    errors = _refused(_train(ranks, shard_dir, run, "--resume"), ranks,
                      f"checkpointed on {RANKS} ranks and cannot resume on {ranks}",
                      f"mpirun -n {RANKS}", "another --out")
    assert not any("no error; stopping with the others" in ln for ln in errors)  # each its own
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.suffix == ".pt"} == before


@pytest.mark.parametrize("change", ["staleness", "shard set"])
def test_another_staleness_or_shard_set_is_refused_even_with_force(stale_runs, shards, tmp_path,
                                                                    change):
    """The rank files hold the rows of the last s epochs between the checkpoint's parts: another
    s or another partition cannot read them (were tracebacks on every rank after the start-up
    agreement: a KeyError, and a gradient of the old partition's shape)."""
    shard_dir, root = stale_runs
    run = tmp_path / "run"
    shutil.copytree(root / "split", run)
    if change == "staleness":
        proc = train(RANKS, shard_dir, run, *SETS, "train.staleness=1",
                     extra=("--resume", "--force"), timeout=180)
        _refused(proc, RANKS, "train.staleness: checkpoint 2, now 1", "not even with --force")
    else:
        other = shards(CSBM, PARTS, "random", seed=1)
        proc = train(RANKS, other, run, *SETS, extra=("--resume", "--force"), timeout=180)
        _refused(proc, RANKS, f"shard set: checkpoint {shard_dir}", "not even with --force")


def test_each_rank_reads_only_its_own_file_and_a_mixed_set_is_refused(stale_runs, tmp_path):
    shard_dir, root = stale_runs
    run = tmp_path / "run"
    shutil.copytree(root / "split", run)
    tag = _rank_files(run)[1]
    other = root / "other"
    mine = run / f"checkpoint.rank-00001.{tag}.pt"
    shutil.copyfile(other / f"checkpoint.rank-00001.{_rank_files(other)[1]}.pt", mine)
    proc = _train(RANKS, shard_dir, run, "--resume")
    assert proc.returncode == 2, proc.stderr
    bad = f"[rank 0/{RANKS}] ERROR rank 1: {mine}: belongs to another checkpoint"
    assert bad in proc.stderr and "a mixed set" in proc.stderr, proc.stderr
    # ranks 0 and 2 never opened rank 1's file: they stop only because rank 1 failed
    assert f"[rank 0/{RANKS}] ERROR ranks 0, 2: no error; stopping with the others" in proc.stderr
    mine.unlink()
    proc = _train(RANKS, shard_dir, run, "--resume")
    assert proc.returncode == 2 and f"[rank 0/{RANKS}] ERROR rank 1: {mine}: missing" in proc.stderr


@pytest.mark.mpi
def test_staleness_past_the_last_epoch_is_warned_about(shards, tmp_path):
    """``train.staleness >= train.epochs`` trains every epoch in the synchronous warm-up: rank 0
    says so (it was silent), and the run still trains."""
    proc = train(2, shards("cora", 2), tmp_path / "run", "train.staleness=3", "train.epochs=3",
                 config="configs/cora.toml")
    check_ok(proc)
    assert "train.staleness = 3 >= train.epochs = 3" in proc.stderr
    assert proc.stderr.count("nothing trains stale") == 1                # rank 0 only
    assert len(read_metrics(tmp_path / "run")) == 3
