"""Shared fixtures: shard sets written once per session with the real preprocess step, and a
launcher for ``python -m mpi4py -m hpcgnn train`` on N ranks (through ``tests/_mpi.py``)."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Triton's interpreter runs the kernels of hpcgnn.kernels on CPU tensors (tests/test_kernels.py).
# It is read when a kernel is defined, so it is set before anything imports them, and only where
# there is no GPU: a GPU machine compiles them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _mpi import run_mpi  # noqa: E402


def pytest_configure(config):
    """In pytest's process only (a rank script that imports this module runs no kernel): the
    interpreter without its re-patch per helper call (``_triton_interp``)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        import _triton_interp
        _triton_interp.install()


CSBM = "csbm:nodes=3000,classes=4,degree=8,features=24,seed=3"

# The objects these imports made (torch's alone are about 170k) go to the garbage collector's
# permanent generation: no later full collection walks them, in pytest or in a rank script that
# imports this module, and neither does the interpreter's teardown (about 0.5 s of CPU a process
# on the 2-core machine; ``hpcgnn.__main__.freeze_imports`` does the same for a training rank).
gc.freeze()


@pytest.fixture(scope="session")
def metis_graphs() -> Path:
    """The folder of METIS's example graphs (``_graphs.metis_examples``), else skip with the
    reason."""
    from _graphs import metis_examples
    folder, why = metis_examples()
    if folder is None:
        pytest.skip(why)
    return folder


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """``shards(spec, parts, partitioner="metis", seed=0) -> Path``: a shard set, cached."""
    from hpcgnn.data.datasets import load_dataset
    from preprocess import partition_graph, write_shards
    root = tmp_path_factory.mktemp("shards")
    made: dict[tuple, Path] = {}
    graphs: dict[str, object] = {}

    def make(spec: str, parts: int, partitioner: str = "metis", seed: int = 0) -> Path:
        key = (spec, parts, partitioner, seed)
        if key not in made:
            graph = graphs.setdefault(spec, load_dataset(spec))
            out = root / f"{spec.split(':')[0]}-{parts}-{partitioner}-{seed}-{len(made)}"
            assignment = partition_graph(graph, parts, partitioner, seed=seed)
            write_shards(graph, assignment, out, partitioner=partitioner, seed=seed, force=False,
                         num_parts=parts)
            made[key] = out
        return made[key]

    return make


def train(nranks: int, shard_dir: Path, out: Path, *sets: str, config: str | None = None,
          extra: tuple[str, ...] = (), timeout: float = 120, env: dict | None = None):
    """Run ``hpcgnn train`` on ``nranks`` ranks; returns the CompletedProcess."""
    args = ["-m", "hpcgnn", "train", "--shards", str(shard_dir), "--out", str(out)]
    if config:
        args += ["--config", config]
    for s in sets:
        args += ["--set", s]
    return run_mpi(nranks, args + list(extra), timeout=timeout, env=env)


def train_together(nranks: int, runs: list[tuple], work: Path,
                   timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """``hpcgnn train`` runs ``[(shard_dir, out, sets, env[, extra]), ...]`` (``extra``: more
    arguments, e.g. ``("--stop-after", "3")``), all of ``nranks`` ranks, in ONE mpiexec job
    (``run_together``)."""
    return run_together(nranks, [(["train", "--shards", str(run[0]), "--out", str(run[1]),
                                   *(a for s in run[2] for a in ("--set", s)),
                                   *(run[4] if len(run) > 4 else ())], run[3]) for run in runs],
                        work, timeout)


def run_together(nranks: int, commands: list[tuple[list[str], dict]], work: Path,
                 timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """``hpcgnn`` commands ``[(argv after "hpcgnn", env), ...]`` in ONE mpiexec job of
    ``nranks`` ranks (``tests/_batch.py``): each rank runs them in turn, in order, so the job
    pays a rank's start (``import torch``) once. One result per command: rank 0's exit code and
    output (as ``stderr``); where the job ended in or before it, the job's exit code and output
    and what every rank wrote for it."""
    jobs = [{"argv": [str(a) for a in argv], "env": dict(env or {}), "log": str(work / f"log-{i}")}
            for i, (argv, env) in enumerate(commands)]
    work.mkdir(parents=True, exist_ok=True)
    (work / "jobs.json").write_text(json.dumps(jobs))
    job = run_mpi(nranks, [Path(__file__).with_name("_batch.py"), work / "jobs.json"], timeout=timeout)
    results = []
    for j in jobs:
        log = Path(j["log"])
        if (log / "rc-0").is_file():
            results.append(subprocess.CompletedProcess(j["argv"], int((log / "rc-0").read_text()),
                                                       "", (log / "rank-0.txt").read_text()))
        else:
            told = "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(log.glob("rank-*.txt")))
            results.append(subprocess.CompletedProcess(j["argv"], job.returncode or 1, job.stdout,
                                                       f"{job.stderr}\n{told}"))
    return results


def together(tmp_path_factory, plan: dict):
    """``get(key) -> (CompletedProcess, run_dir)`` for ``plan = {key: (ranks, shard_dir, sets,
    env)}``: the first ``get`` of a rank count trains every run of that count not yet done in
    one job (``train_together``); later ones read what it left."""
    done: dict = {}

    def get(key):
        if key not in done:
            ranks = plan[key][0]
            keys = [k for k, v in plan.items() if v[0] == ranks and k not in done]
            work = tmp_path_factory.mktemp(f"together-{ranks}")
            runs = [(plan[k][1], work / f"run-{i}", plan[k][2], plan[k][3]) for i, k in enumerate(keys)]
            for k, run, proc in zip(keys, runs, train_together(ranks, runs, work)):
                done[k] = (proc, run[1])
        return done[key]

    return get


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def refused_before_torch(proc, ranks: int, want: str) -> None:
    """A job run with ``PYTHONPROFILEIMPORTTIME=1`` ended with exit code 2 and one ERROR line
    from rank 0 for all ``ranks``, holding ``want``, and no rank imported torch or scipy (every
    rank's import log is on stderr)."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln]
    head = f"[rank 0/{ranks}] ERROR ranks 0-{ranks - 1}: "
    assert len(errors) == 1 and errors[0].startswith(head) and want in errors[0], proc.stderr[-3000:]
    imported = {ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines()
                if ln.startswith("import time:") and "|" in ln}
    assert "mpi4py.MPI" in imported and "torch" not in imported and "scipy" not in imported


def check_ok(proc) -> None:
    assert proc.returncode == 0, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def initial_params(shard_dir: Path, *sets: str, config: str | None = None) -> dict:
    """A fresh model's parameters (and buffers) as ``hpcgnn train --shards SHARD_DIR --set
    SETS`` on ONE rank starts from them: the trainer's model before any step, the state dict's
    keys as a checkpoint's ``model``. (A 1-epoch run at lr 1e-30 is not that: Adam moves every
    parameter by about the lr, so the zero biases become +-1e-30, which is ReLU's derivative 1
    instead of 0 on a row whose aggregated input is all zero, e.g. a node without in-edges.)"""
    import tempfile

    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.train.build import prepare_trainer
    ctx = CommContext.from_world("cpu")
    assert ctx.size == 1
    with tempfile.TemporaryDirectory() as run_dir:
        model = prepare_trainer(ctx, load_config(config, list(sets)), shard_dir,
                                Path(run_dir) / "run").model
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_here(shard_dir: Path, out: Path, *sets: str, config: str | None = "configs/cora.toml",
               resume: bool = False, stop_after: int | None = None, force: bool = False
               ) -> list[dict]:
    """Train on ONE rank inside the pytest process (MPI singleton); returns metrics records.
    The trainer's signal handlers are restored afterwards."""
    import signal

    from hpcgnn.comm.context import CommContext
    from hpcgnn.config import load_config
    from hpcgnn.train.build import prepare_trainer
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        ctx = CommContext.from_world("cpu")
        assert ctx.size == 1
        trainer = prepare_trainer(ctx, load_config(config, list(sets)), shard_dir, out, resume=resume,
                                  stop_after=stop_after, force=force)
        trainer.start()
        trainer.run()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    return read_metrics(out)
