"""The jobs/ scripts on a real one-node SLURM on localhost (env/slurm/up.sh, down.sh).

The session fixture installs slurm-wlm, munge and libpmix-dev with apt when they are missing,
starts munged, slurmctld and slurmd in a temporary directory with their own slurm.conf, waits
for the node to be idle, and stops the daemons by their PIDs at the end, even when a test
fails. It runs only as root (or with password-less sudo) and only when asked: in CI (``CI``
set) or with ``HPCGNN_SLURM_TESTS=1``; elsewhere the SLURM tests skip and say why. The tests
at the top need no SLURM: they run the batch scripts with plain bash.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from _mpi import other_mpi_of

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "jobs"
VENV = Path(sys.executable).parent.parent
APT_PACKAGES = ("slurm-wlm", "munge", "libpmix-dev")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE"}


def job_env(**extra: str) -> dict:
    """The environment jobs are submitted with: this venv, this checkout, one thread a rank."""
    env = dict(os.environ, HPCGNN_HOME=str(REPO), HPCGNN_VENV=str(VENV), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def run(cmd: list, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, **kw)


# --- without SLURM: the scripts' own checks, run with plain bash ------------------------------

def test_preprocess_job_reuses_a_verified_set_and_refuses_other_settings(tmp_path):
    out = tmp_path / "cora-2"
    first = run(["bash", JOBS / "preprocess.sbatch", "cora", 2, out], env=job_env())
    assert first.returncode == 0, first.stderr
    assert "partitioning cora into 2 parts" in first.stderr
    again = run(["bash", JOBS / "preprocess.sbatch", "cora", 2, out], env=job_env())
    assert again.returncode == 0 and "reusing the verified shard set" in again.stderr
    other = run(["bash", JOBS / "preprocess.sbatch", "cora", 2, out, "--seed", 3], env=job_env())
    assert other.returncode != 0
    assert "meta.json has seed=0, this job asks for 3; pass --force" in other.stderr


def test_preprocess_job_does_not_reuse_a_set_made_without_symmetrize(tmp_path):
    """A directed input preprocessed without --symmetrize, then asked for with it: the job must
    not hand back the directed set as if it were the symmetrised one."""
    import numpy as np
    from tests._graphs import save_npz
    n = 6                                              # a one-way cycle: row j lists j - 1
    npz = save_npz(tmp_path / "one-way.npz", n=n, adj_indptr=np.arange(n + 1),
                   adj_indices=(np.arange(n) - 1) % n, labels=np.arange(n) % 2)
    out = tmp_path / "set"
    first = run(["bash", JOBS / "preprocess.sbatch", f"npz:{npz}", 2, out], env=job_env())
    assert first.returncode == 0, first.stderr
    assert json.loads((out / "meta.json").read_text())["num_edges"] == n
    sym = run(["bash", JOBS / "preprocess.sbatch", f"npz:{npz}", 2, out, "--symmetrize"],
              env=job_env())
    assert sym.returncode != 0 and "reusing" not in sym.stderr, sym.stderr
    assert "meta.json has symmetrize=False, this job asks for True; pass --force" in sym.stderr
    forced = run(["bash", JOBS / "preprocess.sbatch", f"npz:{npz}", 2, out, "--symmetrize",
                  "--force"], env=job_env())
    assert forced.returncode == 0, forced.stderr
    assert json.loads((out / "meta.json").read_text())["num_edges"] == 2 * n
    again = run(["bash", JOBS / "preprocess.sbatch", f"npz:{npz}", 2, out, "--symmetrize"],
                env=job_env())
    assert again.returncode == 0 and "reusing the verified shard set" in again.stderr


@pytest.mark.parametrize("kind", ["npz", "metis-graph"])
def test_preprocess_job_does_not_reuse_a_set_of_an_input_since_rewritten(tmp_path, kind):
    """The input file regenerated at the same path (other labels, say) after its set was written:
    the job must not hand back the old set as this input's; meta.json's ``input`` (size and
    modification time as read) tells them apart. A METIS graph file too (its spec has options
    after the path)."""
    import numpy as np
    from tests._graphs import save_npz

    def write(edges: int) -> Path:                 # a cycle of 8, or a path of 8 (7 edges)
        if kind == "npz":
            return save_npz(tmp_path / "g.npz", n=8, **({} if edges == 8 else
                                                        {"labels": np.arange(8) % 3}))
        lines = [sorted({(v - 2) % 8 + 1, v % 8 + 1} if edges == 8 else
                        {u for u in (v - 1, v + 1) if 1 <= u <= 8}) for v in range(1, 9)]
        path = tmp_path / "g.graph"
        path.write_text(f"8 {edges}\n" + "".join(" ".join(map(str, ln)) + "\n" for ln in lines))
        return path

    path, out = write(8), tmp_path / "set"
    spec = f"npz:{path}" if kind == "npz" else f"metis-graph:{path},classes=3"
    first = run(["bash", JOBS / "preprocess.sbatch", spec, 2, out], env=job_env())
    assert first.returncode == 0, first.stderr
    assert json.loads((out / "meta.json").read_text())["input"]["size"] == path.stat().st_size
    again = run(["bash", JOBS / "preprocess.sbatch", spec, 2, out], env=job_env())
    assert again.returncode == 0 and "reusing the verified shard set" in again.stderr
    write(7)                                                     # rewritten in place
    stale = run(["bash", JOBS / "preprocess.sbatch", spec, 2, out], env=job_env())
    assert stale.returncode != 0 and "reusing" not in stale.stderr, stale.stderr
    assert f"{path} changed since the set in {out} was written" in stale.stderr
    assert "pass --force" in stale.stderr
    forced = run(["bash", JOBS / "preprocess.sbatch", spec, 2, out, "--force"],
                 env=job_env())
    assert forced.returncode == 0, forced.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_classes"] == 3 if kind == "npz" else meta["num_edges"] == 14


def test_preprocess_job_rewrites_a_set_that_does_not_verify(tmp_path):
    out = tmp_path / "cora-2"
    assert run(["bash", JOBS / "preprocess.sbatch", "cora", 2, out], env=job_env()).returncode == 0
    with open(out / "part-00001.h5", "r+b") as f:      # an interrupted or corrupted set
        f.seek(-64, os.SEEK_END)
        f.write(b"\0" * 64)
    redo = run(["bash", JOBS / "preprocess.sbatch", "cora", 2, out], env=job_env())
    assert redo.returncode == 0, redo.stderr
    assert "does not verify" in redo.stderr
    assert run([sys.executable, "-m", "preprocess", "verify", out]).returncode == 0


def test_train_job_refuses_a_rank_count_other_than_the_parts(tmp_path):
    shards = tmp_path / "cora-2"
    assert run(["bash", JOBS / "preprocess.sbatch", "cora", 2, shards], env=job_env()).returncode == 0
    config = tmp_path / "run.toml"
    config.write_text("[train]\nepochs = 2\n")
    res = run(["bash", JOBS / "train.sbatch", shards, config], env=job_env(SLURM_NTASKS="3"))
    assert res.returncode != 0
    assert f"{shards} has num_parts=2 but the job has 3 tasks: submit with --ntasks=2" in res.stderr


@pytest.mark.parametrize("script, args", [("train.sbatch", ["shards", "run.toml"]),
                                          ("preprocess.sbatch", ["cora", "2", "out"])])
def test_a_wrong_hpcgnn_home_is_named_with_its_fix(tmp_path, script, args):
    """HPCGNN_HOME pointing at no repository (a typo, an old checkout in ~/.bashrc): the job
    said only "slurm_script: line 62: .../jobs/lib/common.sh: No such file or directory"."""
    res = run(["bash", JOBS / script, *args], env=job_env(HPCGNN_HOME=str(tmp_path / "nowhere")),
              cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert (f"HPCGNN_HOME={tmp_path / 'nowhere'} has no jobs/lib/common.sh: point it at the "
            "hpcgnn repository, or unset it") in res.stderr, res.stderr


def test_a_job_without_the_submitting_environment_names_how_to_pass_the_venv(tmp_path):
    """Under `sbatch --export=NONE` the job lacks HPCGNN_VENV set at submission: "set
    HPCGNN_VENV" alone sent the user to set it where the job cannot see it."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "jobs").symlink_to(JOBS)                       # a repository without a .venv
    env = {k: v for k, v in job_env(HPCGNN_HOME=str(home)).items() if k != "HPCGNN_VENV"}
    res = run(["bash", JOBS / "train.sbatch", "shards", CORA], cwd=tmp_path,
              env={**env, "SLURM_EXPORT_ENV": "NONE"})
    assert res.returncode == 2, res.stderr
    assert f"no venv at {home}/.venv" in res.stderr, res.stderr
    assert ("the job was submitted with --export=NONE: pass it as --export=NONE,HPCGNN_VENV=DIR "
            "or set it in env/site.sh") in res.stderr, res.stderr


def test_train_job_names_its_usage():
    res = run(["bash", JOBS / "train.sbatch", "only-one-arg"], env=job_env())
    assert res.returncode != 0 and "usage: sbatch [--ntasks=K] jobs/train.sbatch SHARDS CONFIG" in res.stderr


def test_sweep_refuses_tasks_that_would_share_a_run_directory(tmp_path):
    """Two schedules with one file name, an --out, or HPCGNN_RUN_DIR would make several array
    tasks write one run directory (the later ones failed in the queue, or raced): refused
    before anything is submitted; so are an --array among HPCGNN_TRAIN_OPTS (it replaced the
    sweep's range) and an HPCGNN_ARRAY_MAX that is no number (sbatch took `0-0%x`)."""
    shards = tmp_path / "cora-2"
    assert run(["bash", JOBS / "preprocess.sbatch", "cora", 2, shards], env=job_env()).returncode == 0
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "s.toml").write_text((REPO / "configs" / "schedules" / "full.toml").read_text())
    env = job_env(HPCGNN_RUNS=str(tmp_path / "runs"))
    same = run(["bash", JOBS / "sweep.sh", shards, CORA, tmp_path / "a" / "s.toml",
                tmp_path / "b" / "s.toml"], env=env, cwd=tmp_path)
    assert same.returncode == 2 and "would share the run directory sweep-<array id>/s" in same.stderr
    out = run(["bash", JOBS / "sweep.sh", shards, CORA, tmp_path / "a" / "s.toml", "--", "--out",
               tmp_path / "r"], env=env, cwd=tmp_path)
    assert out.returncode == 2 and "--out would give every task one run directory" in out.stderr
    fixed = run(["bash", JOBS / "sweep.sh", shards, CORA, tmp_path / "a" / "s.toml"],
                env={**env, "HPCGNN_RUN_DIR": str(tmp_path / "r")}, cwd=tmp_path)
    assert fixed.returncode == 2 and "HPCGNN_RUN_DIR" in fixed.stderr and "unset it" in fixed.stderr
    # an --array in the train options would replace the sweep's; a cap that is no number
    for extra, said in (({"HPCGNN_TRAIN_OPTS": "--time=5 --array=0-9"}, "--array=0-9 in HPCGNN_TRAIN_OPTS"),
                        ({"HPCGNN_TRAIN_OPTS": "-a 3"}, "--array=3 in HPCGNN_TRAIN_OPTS"),
                        ({"HPCGNN_ARRAY_MAX": "x"}, "HPCGNN_ARRAY_MAX=x is not a positive")):
        res = run(["bash", JOBS / "sweep.sh", shards, CORA, tmp_path / "a" / "s.toml"],
                  env={**env, **extra}, cwd=tmp_path)
        assert res.returncode == 2 and said in res.stderr, (extra, res.stderr)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("visible, local_env, want", [
    ("0,1,2,3", {"SLURM_LOCALID": "2"}, "2"),                 # srun
    ("4,5", {"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, "5"),        # Open MPI's mpirun
    ("4,5", {"SLURM_LOCALID": "3"}, "5"),                     # more ranks than GPUs: wrap round
    ("7", {"SLURM_LOCALID": "1"}, "7"),                       # already one GPU per rank
    # mpirun inside a batch job: every rank inherits the batch step's SLURM_LOCALID=0 (seen on
    # the local SLURM with both MPIs), so it gave every rank the first GPU
    ("4,5", {"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, "5"),
    ("4,5", {"SLURM_LOCALID": "0", "MPI_LOCALRANKID": "1"}, "5"),   # MPICH's Hydra
])
def test_bind_leaves_each_rank_the_gpu_of_its_local_rank(visible, local_env, want):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "MPI_LOCALRANKID", "PMI_"))}
    env.update(local_env, CUDA_VISIBLE_DEVICES=visible)
    res = run([JOBS / "lib" / "bind.sh", "printenv", "CUDA_VISIBLE_DEVICES"], env=env)
    assert res.returncode == 0 and res.stdout.strip() == want


# --- the one-node SLURM ------------------------------------------------------------------------

def _privilege() -> list[str] | None:
    """[] as root, ["sudo", "-n"] with password-less sudo, None when neither."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and run(["sudo", "-n", "true"], timeout=10).returncode == 0:
        return ["sudo", "-n"]
    return None


def _why_not(priv: list[str] | None) -> str | None:
    if not sys.platform.startswith("linux"):
        return "the local SLURM needs Linux"
    if not (os.environ.get("CI") or os.environ.get("HPCGNN_SLURM_TESTS") == "1"):
        return ("brings up a real one-node SLURM (apt-get install slurm-wlm munge, daemons as "
                "root): runs in CI or with HPCGNN_SLURM_TESTS=1")
    if priv is None:
        return "needs root or password-less sudo to install slurm-wlm/munge and start slurmd"
    if not all(shutil.which(d) for d in DAEMONS) and not shutil.which("apt-get"):
        return "slurm-wlm and munge are not installed and there is no apt-get to install them"
    return None


def _install(priv: list[str]) -> None:
    """apt-get install the packages when a daemon or the pmix library is missing."""
    have_pmix = any(Path(d, "libpmix.so").exists() for d in ("/usr/lib/x86_64-linux-gnu",
                                                              "/usr/lib/aarch64-linux-gnu", "/usr/lib"))
    if all(shutil.which(d) for d in DAEMONS) and have_pmix:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *APT_PACKAGES]):
        res = run([*priv, "env", "DEBIAN_FRONTEND=noninteractive", *cmd], timeout=600, env=env)
        if res.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed (exit {res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}")


@dataclass
class LocalSlurm:
    """A running one-node SLURM: submit, inspect, signal and wait for jobs."""

    root: Path
    env: dict

    def sbatch(self, *args, cwd: Path, env: dict | None = None) -> str:
        res = run(["sbatch", "--parsable", *args], cwd=cwd, env={**(env or job_env()), **self.env})
        assert res.returncode == 0, f"sbatch {args} failed: {res.stderr}"
        return res.stdout.strip().split(";")[0]

    def script(self, path: Path, *args, cwd: Path, env: dict | None = None) -> str:
        """Run a helper script (jobs/chain.sh, jobs/sweep.sh) that submits jobs; its stdout."""
        res = run(["bash", path, *args], cwd=cwd, env={**(env or job_env()), **self.env})
        assert res.returncode == 0, f"{path.name} failed: {res.stderr}"
        return res.stdout.strip()

    def job(self, job_id: str) -> dict[str, str]:
        res = run(["scontrol", "show", "job", "-o", job_id], env={**os.environ, **self.env})
        assert res.returncode == 0, f"scontrol show job {job_id}: {res.stderr}"
        return dict(re.findall(r"(\w+)=(\S*)", res.stdout))

    def signal(self, job_id: str, sig: str = "USR1") -> None:
        """Signal the batch shell only, as #SBATCH --signal=B:USR1@N does before the limit."""
        res = run(["scancel", f"--signal={sig}", "--batch", job_id], env={**os.environ, **self.env})
        assert res.returncode == 0, res.stderr

    def wait(self, job_id: str, timeout: float, log: Path | None = None) -> dict[str, str]:
        """Poll until the job ends (a requeued job goes on); its last record."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rec = self.job(job_id)
            if rec.get("JobState") in TERMINAL:
                return rec
            time.sleep(0.5)
        run(["scancel", job_id], env={**os.environ, **self.env})
        tail = log.read_text()[-3000:] if log and log.exists() else "(no job output)"
        pytest.fail(f"job {job_id} still {rec.get('JobState')} after {timeout} s:\n{tail}")

    def completed(self, job_id: str, timeout: float, log: Path) -> dict[str, str]:
        rec = self.wait(job_id, timeout, log)
        out = log.read_text() if log.exists() else "(no job output)"
        assert rec["JobState"] == "COMPLETED", f"job {job_id}: {rec['JobState']} {rec.get('ExitCode')}\n{out[-3000:]}"
        return rec


def _subreaper(on: bool) -> None:
    """Make this process adopt orphaned descendants (prctl PR_SET_CHILD_SUBREAPER), so that
    env/slurm/reaper.py, orphaned when up.sh exits, is our child and can be reaped here."""
    import ctypes
    ctypes.CDLL(None).prctl(36, int(on), 0, 0, 0)


def slurm_up(priv: list[str], root: Path, gpus: int = 0) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    """env/slurm/up.sh ROOT (a node with ``gpus`` stand-in GPUs) with this process as the
    subreaper of what it leaves running; returns the run and the PIDs it recorded (munged,
    slurmctld, slurmd, reaper)."""
    _subreaper(True)
    try:
        up = run([*priv, "env", f"SLURM_LOCAL_GPUS={gpus}", "bash", REPO / "env" / "slurm" / "up.sh",
                  root], timeout=120)
    finally:
        _subreaper(False)
    pids = {p.stem: int(p.read_text()) for p in (root / "pids").glob("*.pid")}
    return up, pids


def slurm_down(priv: list[str], root: Path, pids: dict[str, int]) -> subprocess.CompletedProcess:
    """env/slurm/down.sh ROOT, then reap the reaper (our adopted child) if it has ended."""
    down = run([*priv, "bash", REPO / "env" / "slurm" / "down.sh", root], timeout=120)
    if "reaper" in pids:
        try:
            os.waitpid(pids["reaper"], os.WNOHANG)
        except ChildProcessError:
            pass
    return down


def zombies(pids) -> list[int]:
    """Those of ``pids`` that are zombies (ended, never reaped)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            out.append(pid)
    return out


@pytest.fixture(scope="session")
def slurm():
    priv = _privilege()
    why = _why_not(priv)
    if why:
        pytest.skip(why)
    _install(priv)
    root = Path(tempfile.mkdtemp(prefix="hpcgnn-slurm-"))   # short: the munge socket path
    pids: dict[str, int] = {}
    try:
        up, pids = slurm_up(priv, root)
        assert up.returncode == 0, f"env/slurm/up.sh failed:\n{up.stderr[-4000:]}"
        conf = re.search(r"export SLURM_CONF=(\S+)", up.stdout).group(1)
        yield LocalSlurm(root, {"SLURM_CONF": conf})
    finally:
        down = slurm_down(priv, root, pids)
        print(down.stderr, file=sys.stderr)
        run([*priv, "rm", "-rf", root])


MPI_PROBE = """
import os, signal, sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
print(f"rank {comm.rank} of {comm.size} OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}", flush=True)
"""

SIGNAL_PROBE = """
import signal, sys, time
from pathlib import Path
from mpi4py import MPI
comm = MPI.COMM_WORLD
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(time.monotonic()))
Path(sys.argv[0]).with_name(f"ready-{comm.rank}").touch()
t0 = time.monotonic()
while not got and time.monotonic() - t0 < 90:
    time.sleep(0.05)
print(f"rank {comm.rank} got USR1: {bool(got)} after {time.monotonic() - t0:.1f} s", flush=True)
sys.exit(0 if got else 3)
"""


def probe_job(tmp_path: Path, header: str, program: str) -> Path:
    """A batch script that starts ranks exactly as jobs/train.sbatch does (jobs/lib/common.sh)."""
    (tmp_path / "probe.py").write_text(program)
    path = tmp_path / "probe.sbatch"
    path.write_text(f"""#!/usr/bin/env bash
{header}
set -euo pipefail
source "$HPCGNN_HOME/jobs/lib/common.sh"
hpcgnn_env
hpcgnn_launcher
hpcgnn_run_forwarding "${{LAUNCH[@]}}" python {tmp_path / 'probe.py'}
""")
    return path


@pytest.mark.slurm
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_launcher_starts_one_rank_per_task(slurm, tmp_path, launcher):
    script = probe_job(tmp_path, "#SBATCH --ntasks=2 --cpus-per-task=1 --time=2", MPI_PROBE)
    log = tmp_path / "job.out"
    job = slurm.sbatch(f"--output={log}", script, cwd=tmp_path, env=job_env(HPCGNN_LAUNCHER=launcher))
    slurm.completed(job, 60, log)
    out = log.read_text()
    assert f"launcher: {launcher}" in out
    assert "rank 0 of 2 OMP_NUM_THREADS=1" in out and "rank 1 of 2 OMP_NUM_THREADS=1" in out


@pytest.mark.slurm
def test_a_job_submitted_with_export_none_starts_its_ranks_with_srun(slurm, tmp_path):
    """`sbatch --export=NONE` (a common site default): SLURM sets SLURM_EXPORT_ENV=NONE in the
    job, srun reads it, and every rank started with an empty environment ("exec: python: not
    found", exit 127; the auto launcher's srun probe failed too and fell back to mpirun
    without a word). The script's own environment (the venv, OMP_NUM_THREADS) reaches the ranks."""
    script = probe_job(tmp_path, "#SBATCH --ntasks=2 --cpus-per-task=1 --time=2", MPI_PROBE)
    log = tmp_path / "job.out"
    passed = f"HPCGNN_HOME={REPO},HPCGNN_VENV={VENV},HPCGNN_LAUNCHER=srun"
    job = slurm.sbatch(f"--export=NONE,{passed}", f"--output={log}", script, cwd=tmp_path)
    slurm.completed(job, 60, log)
    out = log.read_text()
    assert "launcher: srun" in out, out
    assert "rank 0 of 2 OMP_NUM_THREADS=1" in out and "rank 1 of 2 OMP_NUM_THREADS=1" in out, out


@pytest.mark.slurm
def test_warning_signal_reaches_every_rank(slurm, tmp_path):
    """The real directive: a 1-minute job asks for USR1 60 s before its end, i.e. at once;
    slurmctld sends it at its next time-limit pass (every 30 s), to the batch shell, whose trap
    passes it through the launcher to both ranks, which exit 0 well before the limit."""
    header = "#SBATCH --ntasks=2 --cpus-per-task=1 --time=1 --signal=B:USR1@60"
    script = probe_job(tmp_path, header, SIGNAL_PROBE)
    log = tmp_path / "job.out"
    job = slurm.sbatch(f"--output={log}", script, cwd=tmp_path)
    slurm.completed(job, 90, log)
    out = log.read_text()
    assert "got USR1: passing it to the ranks" in out
    assert "rank 0 got USR1: True" in out and "rank 1 got USR1: True" in out


# --- training jobs on Cora ---------------------------------------------------------------------

EPOCHS = 120          # long enough that a signal sent at the first epoch lands mid-run
CORA = REPO / "configs" / "cora.toml"


@dataclass
class ChainRun:
    shards: Path
    run_dir: Path
    prep_log: Path
    train_log: Path


@pytest.fixture(scope="module")
def chain_run(slurm, tmp_path_factory) -> ChainRun:
    """jobs/chain.sh: preprocess Cora into 2 shards, then (afterok) train on 2 ranks."""
    work = tmp_path_factory.mktemp("chain")
    shards, runs = work / "shards" / "cora-2", work / "runs"
    env = job_env(HPCGNN_RUNS=str(runs),
                  HPCGNN_PREP_OPTS=f"--output={work}/prep-%j.out",
                  HPCGNN_TRAIN_OPTS=f"--output={work}/train-%j.out")
    ids = slurm.script(JOBS / "chain.sh", "cora", 2, shards, CORA,
                       "--set", f"train.epochs={EPOCHS}", cwd=work, env=env)
    prep, train = ids.split()
    prep_log, train_log = work / f"prep-{prep}.out", work / f"train-{train}.out"
    assert slurm.job(train)["JobState"] == "PENDING"     # held by its dependency
    slurm.completed(prep, 120, prep_log)
    slurm.completed(train, 240, train_log)
    return ChainRun(shards, runs / f"slurm-{train}", prep_log, train_log)


def segments(run_dir: Path) -> list[dict]:
    """RUN_DIR/slurm.jsonl: one line per start of the job."""
    return [json.loads(s) for s in (run_dir / "slurm.jsonl").read_text().splitlines()]


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by epoch (a resumed run may repeat an epoch: the last line wins)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["epoch"]: m for m in lines}


@pytest.mark.slurm
def test_chain_preprocesses_then_trains_two_ranks(chain_run):
    assert "partitioning cora into 2 parts" in chain_run.prep_log.read_text()
    summary = json.loads((chain_run.run_dir / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["epochs"] == EPOCHS
    assert 0.6 < summary["test_acc"] <= 1.0, summary          # GCN on Cora: ~0.8 (chance: 0.14)
    assert sorted(read_metrics(chain_run.run_dir)) == list(range(EPOCHS))
    starts = segments(chain_run.run_dir)
    assert [s["ntasks"] for s in starts] == ["2"] and not starts[0]["resumed"]


@pytest.mark.slurm
def test_preempted_job_requeues_and_ends_like_an_uninterrupted_run(slurm, chain_run, tmp_path):
    """USR1 to the batch shell (what --signal=B:USR1@120 sends before the time limit, here sent
    at once with scancel): the ranks checkpoint and exit, the job requeues itself, the second
    start resumes; losses and accuracies equal the chain's uninterrupted run. Launched with
    mpirun, so both launchers' signal forwarding is covered (the chain used srun)."""
    log = tmp_path / "train.out"
    env = job_env(HPCGNN_RUNS=str(tmp_path / "runs"), HPCGNN_LAUNCHER="mpirun")
    job = slurm.sbatch(f"--output={log}", "--ntasks=2", JOBS / "train.sbatch", chain_run.shards,
                       CORA, "--set", f"train.epochs={EPOCHS}", cwd=tmp_path, env=env)
    run_dir = tmp_path / "runs" / f"slurm-{job}"
    wait_for_epochs(run_dir, 0, log)
    slurm.signal(job, "USR1")
    rec = slurm.completed(job, 240, log)

    assert rec["Restarts"] == "1", "the job did not requeue itself once"
    assert [(s["job_id"], s["resumed"]) for s in segments(run_dir)] == [(job, False), (job, True)]
    out = log.read_text()
    assert "got USR1: passing it to the ranks" in out, out[-3000:]
    assert f"requeueing job {job}" in out, out[-3000:]
    assert_same_training(chain_run.run_dir, run_dir)


@pytest.mark.slurm
@pytest.mark.parametrize("when", ["script-starting", "ranks-starting"])
def test_a_warning_as_the_job_starts_checkpoints_and_requeues(slurm, chain_run, tmp_path, when):
    """USR1 to the batch shell as the job starts (a preemption at once, a --time near the
    lead): while the script sets up (before its forwarding trap), or while the ranks start
    (before python has set up its handler). Either killed the job (exit 138, FAILED, never
    requeued); now the ranks get it once they listen, checkpoint after their first epoch, the
    job requeues itself and ends like the uninterrupted run."""
    log = tmp_path / "train.out"
    # sent again every second, not 5: the whole run takes a few seconds here
    env = job_env(HPCGNN_RUNS=str(tmp_path / "runs"), HPCGNN_RESIGNAL="1")
    if when == "ranks-starting":
        # Each rank's bash (jobs/lib/bind.sh) sleeps 2 s before its first line, `trap '' USR1`
        # (BASH_ENV is read first): a USR1 passed on as the ranks start finds every rank there,
        # as it found one now and then with bash's start-up alone (exit 138).
        slow = tmp_path / "slow-rank-start.sh"
        slow.write_text('[[ $0 == */bind.sh ]] && sleep 2\n')
        env["BASH_ENV"] = str(slow)
    job = slurm.sbatch(f"--output={log}", "--ntasks=2", JOBS / "train.sbatch", chain_run.shards,
                       CORA, "--set", f"train.epochs={EPOCHS}", cwd=tmp_path, env=env)
    run_dir = tmp_path / "runs" / f"slurm-{job}"
    deadline = time.monotonic() + 60
    if when == "script-starting":          # the log is opened just before the script runs
        while not log.exists():
            assert time.monotonic() < deadline, f"job {job} did not start"
            time.sleep(0.01)
        time.sleep(0.1)
    else:                                  # the script's last line before it launches
        wait_for_text(log, "run dir ", timeout=60)
    slurm.signal(job, "USR1")
    rec = slurm.completed(job, 240, log)
    out = log.read_text()
    assert rec["Restarts"] == "1", out[-3000:]
    assert [s["resumed"] for s in segments(run_dir)] == [False, True]
    assert "preempted at epoch " in out, out[-3000:]
    if when == "script-starting":
        assert "got USR1 before the launch" in out, out[-3000:]
    else:
        assert "not listening yet" in out, out[-3000:]
    assert not (run_dir / ".ranks-listening").exists()    # the script's, removed after the launch
    assert_same_training(chain_run.run_dir, run_dir)


def assert_same_training(reference: Path, run_dir: Path) -> None:
    """Every epoch's loss and accuracy, the summary, and the final weights and optimizer state
    (bit for bit) equal those of the reference run."""
    want, got = read_metrics(reference), read_metrics(run_dir)
    assert sorted(got) == list(range(EPOCHS))
    for epoch in range(EPOCHS):
        assert got[epoch]["loss"] == pytest.approx(want[epoch]["loss"], rel=1e-6, abs=1e-7), epoch
        assert got[epoch]["test_acc"] == want[epoch]["test_acc"], epoch
    a = json.loads((reference / "summary.json").read_text())
    b = json.loads((run_dir / "summary.json").read_text())
    for key in ("test_acc", "final_test_acc", "best_val_acc", "epochs", "bytes_sent"):
        assert b[key] == a[key], key
    import torch                                          # the final weights, bit for bit
    want, got = (torch.load(d / "checkpoint.pt", map_location="cpu", weights_only=False)
                 for d in (reference, run_dir))
    for part in ("model", "optimizer"):
        flat_want, flat_got = dict(_tensors(want[part])), dict(_tensors(got[part]))
        assert flat_got.keys() == flat_want.keys(), part
        for name, tensor in flat_want.items():
            assert torch.equal(flat_got[name], tensor), f"{part}{name} differs"


def _tensors(obj, path: str = ""):
    """(path, tensor) for every tensor in a nest of dicts, lists and tuples."""
    import torch
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{path}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{path}[{i}]")


def wait_for_epochs(run_dir: Path, more_than: int, log: Path, timeout: float = 120) -> None:
    """Until metrics.jsonl holds more than ``more_than`` lines."""
    path, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while not path.exists() or len(path.read_text().splitlines()) <= more_than:
        assert time.monotonic() < deadline, f"no epoch {more_than} after {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


@pytest.mark.slurm
def test_job_requeued_by_slurm_resumes_once_without_a_duplicate(slurm, chain_run, tmp_path):
    """``scontrol requeue`` from outside (what an admin, a node failure or PreemptMode=REQUEUE
    do): SLURM signals the job and requeues it itself, so the script's own requeue is refused;
    it must not resubmit a second job on the same run directory. The restart resumes (from the
    preemption checkpoint, or the periodic one when the ranks were killed first) and ends like
    the uninterrupted run."""
    log = tmp_path / "train.out"
    env = job_env(HPCGNN_RUNS=str(tmp_path / "runs"))
    job = slurm.sbatch(f"--output={log}", "--ntasks=2", JOBS / "train.sbatch", chain_run.shards,
                       CORA, "--set", f"train.epochs={EPOCHS}", "--set", "run.checkpoint_every=5",
                       cwd=tmp_path, env=env)
    run_dir = tmp_path / "runs" / f"slurm-{job}"
    wait_for_epochs(run_dir, 7, log)
    res = run(["scontrol", "requeue", job], env={**os.environ, **slurm.env})
    assert res.returncode == 0, res.stderr
    rec = slurm.completed(job, 240, log)

    assert rec["Restarts"] == "1"
    assert [(s["job_id"], s["resumed"]) for s in segments(run_dir)] == [(job, False), (job, True)]
    out = log.read_text()
    assert "resubmitting instead" not in out and "submitted job" not in out, out[-3000:]
    queue = run(["squeue", "-h", "-o", "%i %j"], env={**os.environ, **slurm.env})
    assert "hpcgnn-train" not in queue.stdout, queue.stdout
    assert_same_training(chain_run.run_dir, run_dir)


@pytest.mark.slurm
def test_resubmitted_job_keeps_its_limits_and_counts_towards_max_restarts(slurm, chain_run, tmp_path):
    """HPCGNN_ON_PREEMPT=resubmit: the new job resumes the run with the time limit and memory
    given to sbatch on the command line (not the script's defaults), and its own preemption
    counts as a restart, so HPCGNN_MAX_RESTARTS=1 stops the loop there."""
    env = job_env(HPCGNN_RUNS=str(tmp_path / "runs"), HPCGNN_ON_PREEMPT="resubmit",
                  HPCGNN_MAX_RESTARTS="1")
    run_dir = tmp_path / "runs" / "resub"
    first = slurm.sbatch(f"--output={tmp_path}/first.out", "--ntasks=2", "--time=7", "--mem=500",
                         JOBS / "train.sbatch", chain_run.shards, CORA, "--set",
                         "train.epochs=100000", "--out", run_dir, cwd=tmp_path, env=env)
    wait_for_epochs(run_dir, 0, tmp_path / "first.out")
    slurm.signal(first, "USR1")
    slurm.completed(first, 60, tmp_path / "first.out")
    out = (tmp_path / "first.out").read_text()
    second = re.search(r"submitted job (\d+) to resume", out).group(1)
    rec = slurm.job(second)
    assert rec["TimeLimit"] == "00:07:00" and rec["MinMemoryNode"] == "500M", rec
    log = run_dir / f"slurm-{second}.out"
    deadline = time.monotonic() + 120
    while not log.exists() or "resumed from" not in log.read_text():
        assert time.monotonic() < deadline, f"job {second} did not resume:\n{out[-3000:]}"
        time.sleep(0.2)
    slurm.signal(second, "USR1")
    rec = slurm.wait(second, 60, log)
    text = log.read_text()
    assert rec["JobState"] == "FAILED", (rec, text[-3000:])
    assert "preempted after 1 restarts (HPCGNN_MAX_RESTARTS=1)" in text, text[-3000:]
    assert "submitted job" not in text, text[-3000:]
    queue = run(["squeue", "-h", "-o", "%i %j"], env={**os.environ, **slurm.env})
    assert "hpcgnn-train" not in queue.stdout, queue.stdout


def wait_for_text(path: Path, text: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or text not in path.read_text():
        assert time.monotonic() < deadline, f"no {text!r} in {path} after {timeout} s"
        time.sleep(0.2)
    return path.read_text()


@pytest.fixture(scope="module")
def gpu_slurm(slurm):
    """A second local SLURM whose node declares 2 stand-in GPUs (after the first is up)."""
    priv = _privilege()
    root = Path(tempfile.mkdtemp(prefix="hpcgnn-slurmg-"))
    pids: dict[str, int] = {}
    try:
        up, pids = slurm_up(priv, root, gpus=2)
        assert up.returncode == 0, up.stderr[-3000:]
        yield LocalSlurm(root, {"SLURM_CONF": re.search(r"export SLURM_CONF=(\S+)", up.stdout).group(1)})
    finally:
        slurm_down(priv, root, pids)
        run([*priv, "rm", "-rf", root])


@pytest.mark.slurm
def test_resubmitted_job_keeps_its_gpus_and_the_options_given_in_the_environment(gpu_slurm, tmp_path):
    """HPCGNN_ON_PREEMPT=resubmit from a job that asked for GPUs with --gres (and memory and
    CPUs per GPU, a whole node): the new job asks for the same (it got no GPUs at all, and
    resumed on CPUs; with --cpus-per-task=1 in place of --cpus-per-gpu). SLURM shows a job
    neither its --signal nor its --output; given as SBATCH_SIGNAL and SBATCH_OUTPUT they reach
    the new job, and the log says which lead it has."""
    gpu = gpu_slurm
    shards, run_dir = tmp_path / "cora-2", tmp_path / "run"
    # the shards by a preprocessing job asked for as on a GPU-only partition: sbatch refused
    # --cpus-per-gpu and --mem-per-gpu beside the script's #SBATCH --cpus-per-task=1 --mem=8G
    prep = gpu.sbatch("--gpus=1", "--cpus-per-gpu=1", "--mem-per-gpu=1000", f"--output={tmp_path}/prep.out",
                      JOBS / "preprocess.sbatch", "cora", 2, shards, cwd=tmp_path)
    gpu.completed(prep, 120, tmp_path / "prep.out")
    env = job_env(HPCGNN_ON_PREEMPT="resubmit", SBATCH_SIGNAL="B:USR1@100",
                  SBATCH_OUTPUT=f"{tmp_path}/mine-%j.out")
    first = gpu.sbatch("--ntasks=2", "--time=9", "--gres=gpu:2", "--mem-per-gpu=1000",
                       "--cpus-per-gpu=1", "--exclusive", JOBS / "train.sbatch", shards, CORA,
                       "--set", "train.epochs=100000", "--out", run_dir, cwd=tmp_path, env=env)
    log = tmp_path / f"mine-{first}.out"
    wait_for_epochs(run_dir, 0, log)
    gpu.signal(first, "USR1")
    out = wait_for_text(log, "training ended")
    found = re.search(r"submitted job (\d+) to resume", out)
    assert found, out[-3000:]
    second = found.group(1)
    want, got = gpu.job(first), gpu.job(second)
    for key in ("TresPerNode", "MemPerTres", "CpusPerTres", "OverSubscribe", "NumTasks",
                "TimeLimit"):
        assert got.get(key) == want.get(key), (key, want.get(key), got.get(key))
    assert want["TresPerNode"] == "gres:gpu:2" and want["OverSubscribe"] == "NO", want
    assert want["CpusPerTres"] == "gres:gpu:1", want
    assert got["StdOut"] == f"{tmp_path}/mine-{second}.out", got
    assert f"job {second} warns at B:USR1@100" in out, out[-3000:]
    wait_for_text(tmp_path / f"mine-{second}.out", "resumed from")
    run(["scancel", second], env={**os.environ, **gpu.env})
    gpu.wait(second, 60)


@pytest.mark.slurm
@pytest.mark.parametrize("launcher, gpus", [
    ("srun", "--ntasks=2 --gpus-per-task=1"), ("mpirun", "--ntasks=2 --gpus-per-task=1"),
    ("srun", "--nodes=1 --ntasks-per-node=2 --gpus-per-node=2"),
    ("mpirun", "--gpus=2 --ntasks-per-gpu=1")])
def test_cpus_per_gpu_reach_the_ranks(gpu_slurm, tmp_path, launcher, gpus):
    """A GPU job that asks for CPUs per GPU (--cpus-per-gpu=2; SLURM then sets no
    SLURM_CPUS_PER_TASK) starts each rank with 2 CPUs and OMP_NUM_THREADS=2, as
    --cpus-per-task=2 would (each rank got one, and one thread), whether the GPUs are asked
    for per task, per node or per job (then there is no SLURM_GPUS_PER_TASK either)."""
    script = probe_job(tmp_path, f"#SBATCH {gpus} --cpus-per-gpu=2 --time=2", MPI_PROBE)
    log = tmp_path / "job.out"
    job = gpu_slurm.sbatch(f"--output={log}", script, cwd=tmp_path,
                           env=job_env(HPCGNN_LAUNCHER=launcher))
    gpu_slurm.completed(job, 60, log)
    out = log.read_text()
    assert f"launcher: {launcher}" in out and " 2 ranks x 2 CPUs)" in out, out
    assert "rank 0 of 2 OMP_NUM_THREADS=2" in out and "rank 1 of 2 OMP_NUM_THREADS=2" in out, out
    assert "warning" not in out, out


@pytest.mark.slurm
def test_a_gpu_job_with_fewer_tasks_than_gpus_says_so(gpu_slurm, tmp_path):
    """GPUs asked for per node without a task count (`--gpus-per-node=2`): one rank, one GPU
    used, the other idle; said before the ranks start, with the options that fix it."""
    script = probe_job(tmp_path, "#SBATCH --gpus-per-node=2 --time=2", MPI_PROBE)
    log = tmp_path / "job.out"
    gpu_slurm.completed(gpu_slurm.sbatch(f"--output={log}", script, cwd=tmp_path), 60, log)
    out = log.read_text()
    assert ("warning: the job has 2 GPUs on this node but 1 tasks: each rank uses one GPU, 1 stay "
            "idle; submit with --ntasks-per-gpu=1 (or --ntasks-per-node=2)") in out, out
    assert out.index("warning: the job has") < out.index("rank 0 of 1"), out


@pytest.mark.slurm
def test_resubmitted_array_task_is_its_own_job_and_keeps_the_schedule(slurm, chain_run, tmp_path):
    """HPCGNN_ON_PREEMPT=resubmit from a sweep task: the new job is not an array task, and must
    not take itself for the old one (an inherited SLURM_ARRAY_* made it look the old, finished
    task up, conclude "SLURM is ending the job itself" at its own preemption and stop, leaving
    the run unfinished); it resumes with the task's schedule and resubmits again."""
    env = job_env(HPCGNN_RUNS=str(tmp_path / "runs"), HPCGNN_ON_PREEMPT="resubmit")
    schedule = REPO / "configs" / "schedules" / "fixed-128.toml"
    array = slurm.script(JOBS / "sweep.sh", chain_run.shards, CORA, schedule, "--", "--set",
                         "train.epochs=100000", cwd=tmp_path, env=env)
    run_dir = tmp_path / "runs" / f"sweep-{array}" / "fixed-128"
    first = run_dir / f"slurm-{array}_0.out"
    wait_for_epochs(run_dir, 0, first)
    slurm.signal(f"{array}_0", "USR1")
    second = re.search(r"submitted job (\d+) to resume", wait_for_text(first, "to resume")).group(1)
    log = run_dir / f"slurm-{second}.out"                # moved into the run directory
    wait_for_text(log, "resumed from")
    slurm.signal(second, "USR1")
    out = wait_for_text(log, "training ended")
    third = re.search(r"submitted job (\d+) to resume", out)
    run(["scancel", "--signal=KILL", third.group(1) if third else second],
        env={**os.environ, **slurm.env})
    assert third and "SLURM is ending the job itself" not in out, out[-3000:]
    starts = segments(run_dir)
    assert [(s["job_id"], s["array_task_id"], s["resumed"]) for s in starts[:2]] == \
        [(array, "0", False), (second, None, True)], starts
    assert (run_dir / "schedule.toml").read_text() == schedule.read_text()


@pytest.mark.slurm
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_term_to_the_batch_shell_reaches_every_rank_as_usr1(slurm, tmp_path, launcher):
    """A TERM to the job script (a preemption, scancel --signal=TERM) goes on to the launcher as
    USR1: srun and mpirun would take TERM as "kill the ranks now", before any checkpoint."""
    script = probe_job(tmp_path, "#SBATCH --ntasks=2 --cpus-per-task=1 --time=2", SIGNAL_PROBE)
    log = tmp_path / "job.out"
    job = slurm.sbatch(f"--output={log}", script, cwd=tmp_path, env=job_env(HPCGNN_LAUNCHER=launcher))
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, f"ranks not ready after 60 s:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)
    slurm.signal(job, "TERM")
    slurm.completed(job, 60, log)
    out = log.read_text()
    assert "got TERM: passing it to the ranks as USR1" in out
    assert "rank 0 got USR1: True" in out and "rank 1 got USR1: True" in out


@pytest.mark.slurm
def test_a_cancelled_training_job_stays_cancelled(slurm, chain_run, tmp_path):
    """scancel sends TERM too: the ranks checkpoint, but the job must not requeue or resubmit
    itself (it would undo the cancel)."""
    log = tmp_path / "train.out"
    env = job_env(HPCGNN_RUNS=str(tmp_path / "runs"))
    job = slurm.sbatch(f"--output={log}", "--ntasks=2", JOBS / "train.sbatch", chain_run.shards,
                       CORA, "--set", f"train.epochs={EPOCHS}", cwd=tmp_path, env=env)
    wait_for_epochs(tmp_path / "runs" / f"slurm-{job}", 2, log)
    assert run(["scancel", job], env={**os.environ, **slurm.env}).returncode == 0
    slurm.wait(job, 60, log)
    time.sleep(2)                      # a requeue or resubmission would show by now
    rec = slurm.job(job)
    assert rec["JobState"] == "CANCELLED" and rec["Restarts"] == "0", rec
    queue = run(["squeue", "-h", "-o", "%i %j"], env={**os.environ, **slurm.env})
    assert "hpcgnn-train" not in queue.stdout, queue.stdout
    assert "requeueing" not in log.read_text() and "submitted job" not in log.read_text()


@pytest.mark.slurm
@pytest.mark.parametrize("on_preempt", ["requeue", "resubmit"])
def test_a_cancelled_job_that_checkpointed_is_not_requeued_or_resubmitted(slurm, tmp_path,
                                                                          on_preempt):
    """The moment after a scancel when the ranks have checkpointed and exited 0 (whether they
    get there before SLURM kills the step is a race, so the job script is put there itself):
    the job is CANCELLED, and the script's next step (jobs/lib/train.sh) must not undo that."""
    script = tmp_path / "cancelled.sbatch"
    script.write_text(f"""#!/usr/bin/env bash
#SBATCH --ntasks=1 --time=2
set -euo pipefail
source "$HPCGNN_HOME/jobs/lib/common.sh"
source "$HPCGNN_HOME/jobs/lib/train.sh"
trap '' TERM                                   # the training script's TERM trap, in short
scancel "$SLURM_JOB_ID"
for _ in $(seq 50); do
    scontrol show job -o "$SLURM_JOB_ID" | grep -q JobState=RUNNING || break
    sleep 0.1
done
hpcgnn_continue_later {tmp_path / 'run'} shards config
echo "continue_later returned"
""")
    log = tmp_path / "job.out"
    env = job_env(HPCGNN_ON_PREEMPT=on_preempt, SLURM_CONF=slurm.env["SLURM_CONF"])
    job = slurm.sbatch(f"--output={log}", script, cwd=tmp_path, env=env)
    rec = slurm.wait(job, 60, log)
    time.sleep(2)                      # a requeue or resubmission would show by now
    out = log.read_text()
    assert rec["JobState"] == "CANCELLED" and slurm.job(job)["Restarts"] == "0", (rec, out)
    assert "SLURM is ending the job itself" in out, out
    assert "submitted job" not in out and "requeueing" not in out, out
    queue = run(["squeue", "-h", "-o", "%i %j"], env={**os.environ, **slurm.env})
    assert "hpcgnn-train" not in queue.stdout and "cancelled" not in queue.stdout, queue.stdout


@pytest.mark.slurm
def test_sweep_without_hpcgnn_home_runs_every_schedule(slurm, chain_run, tmp_path):
    """One array task per schedule, each training with its own schedule, and
    ``HPCGNN_TRAIN_OPTS`` reaching sbatch, an --export=NONE among them too (it replaced the
    sweep's --export, which carries the schedule list: every task trained without its
    schedule, in runs/slurm-<id>). No HPCGNN_HOME: each array task finds the
    repository from its own job record. One task of an array has the array's own job id, and
    `scontrol show job <that id>` lists every task: that task must still find it, and every
    schedule must get its run and summary."""
    names = ("full", "fixed-128", "quant2-all")
    schedules = [REPO / "configs" / "schedules" / f"{n}.toml" for n in names]
    env = {k: v for k, v in job_env(HPCGNN_RUNS=str(tmp_path / "runs"), HPCGNN_ARRAY_MAX="2",
                                    HPCGNN_TRAIN_OPTS="--comment=hpcgnn-sweep-test "
                                                      f"--export=NONE,HPCGNN_VENV={VENV}").items()
           if k != "HPCGNN_HOME"}
    array = slurm.script(JOBS / "sweep.sh", chain_run.shards, CORA, *schedules, "--",
                         "--set", "train.epochs=3", cwd=tmp_path, env=env)
    ids, sent = [], {}
    for task, name in enumerate(names):
        run_dir = tmp_path / "runs" / f"sweep-{array}" / name
        rec = slurm.completed(f"{array}_{task}", 240, run_dir / f"slurm-{array}_{task}.out")
        ids.append(rec["JobId"])
        assert rec.get("Comment") == "hpcgnn-sweep-test", rec    # HPCGNN_TRAIN_OPTS
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["epochs"] == 3 and summary["ranks"] == 2
        assert "job log moved to" in (run_dir / f"slurm-{array}_{task}.out").read_text()
        sent[name] = (summary["bytes_sent"], summary["bytes_full"])
    assert sent["full"][0] == sent["full"][1]                  # uncompressed
    assert sent["fixed-128"][1] == sent["full"][1]             # the same exchanges ...
    assert sent["fixed-128"][0] < sent["full"][0] / 2          # ... compressed: its own schedule
    assert array in ids, (array, ids)              # the task that shares the array's id ran too
    assert not list(tmp_path.glob("*.out")), "job logs left in the submission directory"


@pytest.mark.slurm
def test_chain_from_paths_with_spaces_finds_the_repository_and_moves_the_logs(slurm, tmp_path):
    """The repository, the submission directory and the shard set under names with spaces, and
    no HPCGNN_HOME: each job finds the repository from its Command= (the script's path, then
    its arguments, joined by spaces) and moves its log out of the submission directory."""
    repo = tmp_path / "my repo"
    repo.symlink_to(REPO)
    work = tmp_path / "sub dir"
    work.mkdir()
    env = {k: v for k, v in job_env().items() if k != "HPCGNN_HOME"}
    ids = slurm.script(repo / "jobs" / "chain.sh", "cora", 2, work / "shards" / "cora 2", CORA,
                       "--set", "train.epochs=2", cwd=work, env=env)
    prep, train = ids.split()
    prep_log = work / "runs" / "logs" / f"hpcgnn-prep-{prep}.out"
    slurm.completed(prep, 120, prep_log)
    log = work / "runs" / f"slurm-{train}" / f"slurm-{train}.out"
    slurm.completed(train, 240, log)
    assert "job log moved to" in prep_log.read_text() and "job log moved to" in log.read_text()
    assert json.loads((log.parent / "summary.json").read_text())["epochs"] == 2
    assert not list(work.glob("*.out")), "job logs left in the submission directory"


@pytest.mark.slurm
def test_sweep_waits_for_the_preprocessing_job_that_makes_its_shards(slurm, tmp_path):
    """HPCGNN_DEPENDENCY on the job that writes SHARDS: meta.json is not there at submission,
    so the part count comes from HPCGNN_PARTS (without it: refused, naming it)."""
    shards = tmp_path / "cora-2"
    schedule = REPO / "configs" / "schedules" / "full.toml"
    env = job_env(HPCGNN_RUNS=str(tmp_path / "runs"))
    prep = slurm.sbatch("--begin=now+3", f"--output={tmp_path}/prep.out", JOBS / "preprocess.sbatch",
                        "cora", 2, shards, cwd=tmp_path, env=env)
    res = run(["bash", JOBS / "sweep.sh", shards, CORA, schedule], cwd=tmp_path,
              env={**env, **slurm.env, "HPCGNN_DEPENDENCY": f"afterok:{prep}"})
    assert res.returncode == 2 and "give its part count as HPCGNN_PARTS" in res.stderr, res.stderr
    array = slurm.script(JOBS / "sweep.sh", shards, CORA, schedule, "--", "--set", "train.epochs=2",
                         cwd=tmp_path, env={**env, "HPCGNN_DEPENDENCY": f"afterok:{prep}",
                                            "HPCGNN_PARTS": "2"})
    slurm.completed(prep, 120, tmp_path / "prep.out")
    run_dir = tmp_path / "runs" / f"sweep-{array}" / "full"
    slurm.completed(f"{array}_0", 240, run_dir / f"slurm-{array}_0.out")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["epochs"] == 2


@pytest.mark.slurm
def test_preprocess_job_with_tasks_partitions_across_them(slurm, tmp_path):
    """sbatch --nodes=1 --ntasks-per-node=2 jobs/preprocess.sbatch ... --partitioner ptscotch
    runs the distributed path on the job's 2 ranks (it ran one process and left a task idle); METIS on 2 tasks is
    refused, naming the fix. The random partitioner runs the same path where PT-Scotch is
    another MPI's than the venv's (Debian's in an MPICH venv: refused, test_preprocess_dist)."""
    from preprocess.ptscotch import PtScotchError, _find_library
    try:
        partitioner = "random" if other_mpi_of(_find_library()) else "ptscotch"
    except PtScotchError as exc:
        pytest.skip(f"PT-Scotch not installed: {exc}")
    log = tmp_path / "prep.out"
    # asked for as --nodes=1 --ntasks-per-node=2 (the script's #SBATCH --ntasks=1 made that one
    # rank), memory per CPU (sbatch refused it beside the script's #SBATCH --mem=8G)
    job = slurm.sbatch("--nodes=1", "--ntasks-per-node=2", "--mem-per-cpu=500M", f"--output={log}",
                       JOBS / "preprocess.sbatch", "rmat-sliced:scale=8", 3, tmp_path / "r8",
                       "--partitioner", partitioner, cwd=tmp_path)
    slurm.completed(job, 120, log)
    out = log.read_text()
    assert "done on 2 ranks" in out and "OK " in out, out
    assert json.loads((tmp_path / "r8" / "meta.json").read_text())["partitioner"] == partitioner
    log = tmp_path / "metis.out"
    job = slurm.sbatch("--ntasks=2", f"--output={log}", JOBS / "preprocess.sbatch", "cora", 2,
                       tmp_path / "c2", cwd=tmp_path)
    assert slurm.wait(job, 60, log)["JobState"] == "FAILED"
    assert "the job has 2 tasks, but --partitioner metis runs in one process" in log.read_text()
    assert not (tmp_path / "c2").exists()


@pytest.mark.slurm
def test_chain_passes_preprocess_args(slurm, tmp_path):
    """HPCGNN_PREP_ARGS reach `python -m preprocess` in the chain's preprocessing job. A
    --dependency among HPCGNN_TRAIN_OPTS is added to the training job's afterok on the
    preprocessing job (sbatch kept only the last --dependency: training started at once)."""
    shards = tmp_path / "cora-2"
    other = slurm.sbatch("--begin=now+3", "--wrap", "true", cwd=tmp_path)
    env = job_env(HPCGNN_RUNS=str(tmp_path / "runs"), HPCGNN_PREP_ARGS="--partitioner random --seed 3",
                  HPCGNN_TRAIN_OPTS=f"--comment=mine --dependency=afterany:{other}")
    prep, train = slurm.script(JOBS / "chain.sh", "cora", 2, shards, CORA, "--set", "train.epochs=2",
                               cwd=tmp_path, env=env).split()
    rec = slurm.job(train)
    assert f"afterok:{prep}" in rec["Dependency"] and f"afterany:{other}" in rec["Dependency"], rec
    assert rec["Comment"] == "mine", rec
    slurm.completed(prep, 120, tmp_path / "runs" / "logs" / f"hpcgnn-prep-{prep}.out")
    meta = json.loads((shards / "meta.json").read_text())
    assert (meta["partitioner"], meta["seed"]) == ("random", 3)
    log = tmp_path / "runs" / f"slurm-{train}" / f"slurm-{train}.out"
    slurm.completed(train, 240, log)


@pytest.mark.slurm
def test_four_ranks_per_node_run_on_the_local_node_and_log_under_the_run_dir(slurm, tmp_path):
    """Four ranks asked for the way GPU clusters do, `--nodes=1 --ntasks-per-node=4` (no
    --ntasks), on the local SLURM, whatever the machine's cores (the node declares at least 8
    CPUs). The script's own `#SBATCH --ntasks=2` made SLURM allocate 4 tasks but set
    SLURM_NTASKS=2: 2 ranks ran (and `--ntasks-per-node=1` was refused). With --chdir, the
    job's log (opened in the working directory, not the submission one) still moves into its
    run directory (it stayed in the working directory)."""
    shards, work, elsewhere = tmp_path / "cora-4", tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    assert run([sys.executable, "-m", "preprocess", "--dataset", "cora", "--parts", 4, "--out",
                shards, "-q"], timeout=120).returncode == 0
    job = slurm.sbatch("--nodes=1", "--ntasks-per-node=4", f"--chdir={work}", JOBS / "train.sbatch",
                       shards, CORA, "--set", "train.epochs=3", cwd=elsewhere)
    log = work / "runs" / f"slurm-{job}" / f"slurm-{job}.out"
    slurm.completed(job, 240, log)
    summary = json.loads((log.parent / "summary.json").read_text())
    assert summary["ranks"] == 4 and summary["epochs"] == 3
    assert segments(log.parent)[0]["ntasks"] == "4"
    assert not list(work.glob("*.out")), "job log left in the working directory"


@pytest.mark.slurm
def test_down_reaps_the_daemons(slurm, tmp_path):
    """A second SLURM in its own directory: after down.sh none of its daemons is a zombie."""
    priv = _privilege()
    root = Path(tempfile.mkdtemp(prefix="hpcgnn-slurm2-"))
    try:
        up, pids = slurm_up(priv, root)
        assert up.returncode == 0, up.stderr[-3000:]
        assert set(pids) == {"munged", "slurmctld", "slurmd", "reaper"}, pids
        down = slurm_down(priv, root, pids)
        assert down.returncode == 0, down.stderr
        assert zombies(pids.values()) == [], (pids, down.stderr)
        assert not [p for p in pids.values() if Path(f"/proc/{p}").exists()], pids
    finally:
        run([*priv, "rm", "-rf", root])
