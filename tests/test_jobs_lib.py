"""``jobs/lib/train.sh``'s check of the task count against the shard set, before a SLURM job
launches any rank: every layout one of the parallel algorithms trains is let through (halo: R
divides K; 1.5D: R = K c; 2D: R = q^2, q dividing K; 3D: R = q^3, q^2 dividing K), the others
are refused naming the rules. The trainer's own check of the config's algorithm is tested
with the algorithms (``test_cagnet*.py``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _mpi import REPO


def check(tmp_path, parts: int, ntasks: int) -> subprocess.CompletedProcess:
    (tmp_path / "meta.json").write_text(json.dumps({"num_parts": parts}))
    script = ("source jobs/lib/common.sh && source jobs/lib/train.sh && "
              f"hpcgnn_check_shards {tmp_path} {ntasks}")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, env=env)


@pytest.mark.parametrize("parts,ntasks", [(4, 4), (4, 2), (4, 1), (4, 8), (4, 12), (6, 9),
                                          (6, 4), (4, 16), (9, 27)])
def test_every_trainable_layout_passes(tmp_path, parts, ntasks):
    proc = check(tmp_path, parts, ntasks)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("parts,ntasks", [(4, 3), (3, 4), (6, 27), (6, 10)])
def test_other_task_counts_are_refused_with_the_rules(tmp_path, parts, ntasks):
    proc = check(tmp_path, parts, ntasks)
    assert proc.returncode != 0
    assert f"num_parts={parts} but the job has {ntasks} tasks" in proc.stderr
    assert "q^2 with q dividing" in proc.stderr and "q^3 with q^2 dividing" in proc.stderr


def needs_resume(run_dir: Path, restarts: int) -> bool:
    script = ("source jobs/lib/common.sh && source jobs/lib/train.sh && "
              f"hpcgnn_needs_resume {run_dir}")
    env = {**os.environ, "SLURM_RESTART_COUNT": str(restarts)}
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode == 0


@pytest.mark.parametrize("files,restarts,want", [
    ((), 1, False),                                              # no checkpoint: --force
    (("checkpoint.pt",), 0, False),                              # a first start: neither
    (("checkpoint.pt",), 1, True),                               # a periodic checkpoint
    (("checkpoint.pt", "preempted.json"), 0, True),              # preempted, requeued by us
    (("checkpoint.pt", "summary.json"), 1, True),                # restarted after it finished
])
def test_a_restarted_job_resumes_what_its_run_directory_holds(tmp_path, files, restarts, want):
    """A restart that came after the run finished resumes it (trains nothing) instead of
    training it all again with --force over the finished run."""
    for name in files:
        (tmp_path / name).write_text("{}")
    assert needs_resume(tmp_path, restarts) == want


def test_a_warning_after_the_ranks_have_ended_does_not_kill_the_job_script():
    """SLURM's USR1 warning that reaches the batch shell after the ranks have ended (training
    finished, or checkpointed, just before it): the script goes on to requeue or to end with
    the ranks' status. The shell's USR1 went back to its default action there and the shell
    died of it (under SLURM: FAILED, ExitCode 0:10, after a complete run)."""
    script = ("source jobs/lib/common.sh && hpcgnn_run_forwarding true && "
              "kill -USR1 $$ && sleep 0.2 && echo went on")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "went on", (proc.returncode, proc.stderr)


# A rank that USR1 kills for its first second (bash's default action, as jobs/lib/bind.sh before
# its first line), then handles it and, as hpcgnn train's rank 0 does, says so by creating
# $HPCGNN_LISTENING (unless told not to).
STARTING_RANK = ("sleep 1; trap 'echo got it; exit 0' USR1; "
                 "[[ $SAY == 1 ]] && touch \"$HPCGNN_LISTENING\"; sleep 8 >/dev/null 2>&1 & wait; exit 3")


@pytest.mark.parametrize("say", [1, 0])
def test_a_warning_as_the_ranks_start_waits_until_they_listen(tmp_path, say):
    """A USR1 to the job script 0.2 s after the launch: passed on only once the ranks listen
    (the file appears), or, where it never does, after HPCGNN_LISTEN_WAIT seconds. Passed on at
    once, it killed a rank still starting (exit 138)."""
    script = ("source jobs/lib/common.sh; (sleep 0.2; kill -USR1 $$) & "
              "hpcgnn_run_forwarding bash -c \"$RANK\"; echo \"status $?\"")
    # the wait counts whole seconds (bash's SECONDS): 3 passes on after 2-3 s, past the rank's 1
    env = {**os.environ, "RANK": STARTING_RANK, "SAY": str(say),
           "HPCGNN_LISTEN_WAIT": "60" if say else "3",
           "HPCGNN_LISTENING": str(tmp_path / ".ranks-listening"), "HPCGNN_RESIGNAL": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=90, stdin=subprocess.DEVNULL, env=env)
    took = time.monotonic() - t0
    assert proc.stdout.split() == ["got", "it", "status", "0"], (proc.stdout, proc.stderr)
    assert took < 30 if say else took > 1.9, took      # the file, not the 60 s wait; the wait
    assert "got USR1: the ranks are not listening yet" in proc.stderr, proc.stderr


# A module system's `module` as Lmod 9.2.4's reads LD_PRELOAD (TACC/Lmod#835): unset, it is an
# "unbound variable" under set -u
FAKE_MODULE = ('module() { local preload=$HPCGNN_TEST_UNSET_PRELOAD; echo "module $* done" >&2; '
               '[[ ${2:-} != exit ]] || exit 7; }\n')


def test_a_site_files_module_load_works_under_the_jobs_set_u(tmp_path):
    """jobs/lib/common.sh sources the site file (and the venv's activate) with unset variables
    allowed and puts `set -u` back after; a failing line of the site file still ends the job."""
    site = tmp_path / "site.sh"
    site.write_text(FAKE_MODULE + "module load gcc/12.3 openmpi/4.1.6\n")
    env = {k: v for k, v in os.environ.items() if k != "HPCGNN_TEST_UNSET_PRELOAD"}
    env.update(HPCGNN_SITE=str(site), HPCGNN_VENV=str(Path(sys.executable).parent.parent),
               HPCGNN_HOME=str(REPO))
    script = ("set -euo pipefail; source jobs/lib/common.sh; hpcgnn_env; "
              "[[ $- == *u* ]] && echo \"set -u is back; python $(command -v python)\"")
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "module load gcc/12.3 openmpi/4.1.6 done" in proc.stderr
    assert proc.stdout.strip() == f"set -u is back; python {Path(sys.executable).parent}/python"
    site.write_text(FAKE_MODULE + "false\necho after >&2\n")           # set -e still holds
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode == 1 and "after" not in proc.stderr, proc.stderr


def test_site_mpi_sources_the_site_file_and_loads_modules_under_set_u(tmp_path):
    """env/site-mpi.sh (set -euo pipefail) sources env/site.sh and runs `module load`: a module
    system that reads an unset variable ended it ("unbound variable") before any module loaded."""
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "site-mpi.sh").write_text((REPO / "env" / "site-mpi.sh").read_text())
    (tmp_path / "env" / "site.sh").write_text(FAKE_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "HPCGNN_TEST_UNSET_PRELOAD"}
    proc = subprocess.run(["bash", str(tmp_path / "env" / "site-mpi.sh"), "exit"], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode == 7 and "module load exit done" in proc.stderr, proc.stderr  # loaded


def test_a_warning_before_the_launch_or_to_listening_ranks(tmp_path):
    """A USR1 the script got before the launch (``HPCGNN_SIGNALLED=1``, as jobs/train.sbatch
    sets it) also waits until the ranks listen (sent at once, it killed the starting rank:
    status 138); one that comes once they listen is passed on at once, not after
    ``HPCGNN_RESIGNAL`` seconds (30 here: the rank would have ended with status 3 first)."""
    listening = tmp_path / ".ranks-listening"
    base = {**os.environ, "HPCGNN_LISTENING": str(listening), "HPCGNN_LISTEN_WAIT": "60",
            "HPCGNN_RESIGNAL": "30", "SAY": "1"}
    before = ("source jobs/lib/common.sh; HPCGNN_SIGNALLED=1 hpcgnn_run_forwarding "
              "bash -c \"$RANK\"; echo \"status $?\"")
    ready = ("trap 'echo got it; exit 0' USR1; touch \"$HPCGNN_LISTENING\"; "
             "sleep 8 >/dev/null 2>&1 & wait; exit 3")
    after = ("source jobs/lib/common.sh; (until [[ -e $HPCGNN_LISTENING ]]; do sleep 0.05; done; "
             "kill -USR1 $$) & "
             "hpcgnn_run_forwarding bash -c \"$RANK\"; echo \"status $?\"")
    for script, rank, said in ((before, STARTING_RANK, "got USR1 before the launch"),
                               (after, ready, "got USR1: passing it to the ranks")):
        listening.unlink(missing_ok=True)
        t0 = time.monotonic()
        proc = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                              timeout=90, stdin=subprocess.DEVNULL, env={**base, "RANK": rank})
        assert proc.stdout.split() == ["got", "it", "status", "0"], (proc.stdout, proc.stderr)
        assert time.monotonic() - t0 < 6 and said in proc.stderr, proc.stderr
