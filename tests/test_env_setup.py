"""``env/setup.sh`` refuses a wrong MPI route before it makes the venv or installs torch (which
takes minutes and, for a CUDA build, gigabytes); the Makefile sets up the venv it runs."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from _mpi import REPO


def setup(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    # torch from a file that is not there: if the script got as far as torch, pip fails at once
    full = {**os.environ, "HPCGNN_VENV": str(tmp_path / "venv"),
            "HPCGNN_TORCH": str(tmp_path / "no-such-torch.whl"), **env}
    return subprocess.run(["bash", str(REPO / "env" / "setup.sh")], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, env=full)


def test_unknown_mpi_route_is_refused_before_the_venv_is_made(tmp_path):
    res = setup(tmp_path, HPCGNN_MPI="openmpi")
    assert res.returncode == 2, res.stderr
    assert "HPCGNN_MPI=openmpi is not one of pip, mpich, site" in res.stderr
    assert not (tmp_path / "venv").exists() and "torch" not in res.stderr


def test_site_route_without_mpicc_is_refused_before_the_venv_is_made(tmp_path):
    tools = tmp_path / "bin"                     # a PATH with what the script needs, no mpicc
    tools.mkdir()
    for tool in ("dirname", "sha256sum", "cut", "sed", "python3"):
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} not on PATH")
        (tools / tool).symlink_to(found)
    env = {k: v for k, v in os.environ.items() if k != "MPICC"}
    env.update(PATH=str(tools), HPCGNN_MPI="site", HPCGNN_VENV=str(tmp_path / "venv"),
               HPCGNN_TORCH=str(tmp_path / "no-such-torch.whl"))
    res = subprocess.run([shutil.which("bash"), str(REPO / "env" / "setup.sh")],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                         env=env)
    assert res.returncode == 2, res.stderr
    assert "HPCGNN_MPI=site but no mpicc on PATH" in res.stderr
    assert not (tmp_path / "venv").exists()


def fake_venv(path: Path) -> Path:
    """A venv ``env/setup.sh`` takes as up to date: its stamp for the pip route and this
    pyproject, and a ``bin/python`` that answers every import check with success."""
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (path / "bin" / "python").chmod(0o755)
    digest = subprocess.run(["sha256sum", str(REPO / "pyproject.toml")], capture_output=True,
                            text=True, check=True).stdout[:16]
    (path / ".hpcgnn-setup").write_text(f"route=pip pyproject={digest}\n\n")
    return path


def test_make_sets_up_the_venv_it_then_runs(tmp_path):
    """``make demo VENV=DIR`` (and ``make test``) ran ``env/setup.sh`` on ``.venv`` (or on an
    exported HPCGNN_VENV), then DIR's python: the venv made was not the one used."""
    if shutil.which("make") is None:
        pytest.skip("make not on PATH")
    wanted, other = fake_venv(tmp_path / "wanted"), fake_venv(tmp_path / "other")
    env = {**os.environ, "HPCGNN_VENV": str(other)}
    for name in ("HPCGNN_EXTRAS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"):   # under `make test` too
        env.pop(name, None)
    for target in ("setup", "setup-test"):
        if target == "setup-test":     # the test extra: the stamp must name it
            for venv in (wanted, other):
                (venv / ".hpcgnn-setup").write_text(
                    (venv / ".hpcgnn-setup").read_text().split("\n")[0] + "\ntest\n")
        res = subprocess.run(["make", "-s", "-C", str(REPO), target, f"VENV={wanted}"],
                             capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL, env=env)
        assert res.returncode == 0, res.stderr
        assert f"venv at {wanted} is up to date" in res.stderr, (target, res.stderr)


def test_a_venv_keeps_the_mpi_it_was_made_with(tmp_path):
    """A venv made with HPCGNN_MPI=mpich, set up again without HPCGNN_MPI (``make demo
    VENV=DIR`` does that) is up to date as it is: the default route installed pip's Open MPI
    into it, a second mpiexec and libmpi over MPICH's. A different route asked for is refused
    before anything is installed, naming the venv and the way out."""
    venv = fake_venv(tmp_path / "mpich")
    stamp = venv / ".hpcgnn-setup"
    stamp.write_text(stamp.read_text().replace("route=pip ", "route=mpich ", 1))
    env = {k: v for k, v in os.environ.items() if k not in ("HPCGNN_MPI", "HPCGNN_EXTRAS")}
    res = subprocess.run(["bash", str(REPO / "env" / "setup.sh")], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL,
                         env={**env, "HPCGNN_VENV": str(venv)})
    assert res.returncode == 0, res.stderr
    assert f"venv at {venv} is up to date (route=mpich " in res.stderr, res.stderr
    assert "Open MPI" not in res.stderr
    for asked in ("pip", "site"):
        res = setup(tmp_path, HPCGNN_VENV=str(venv), HPCGNN_MPI=asked, MPICC="/bin/true")
        assert res.returncode == 2, res.stderr
        assert (f"{venv} was made with HPCGNN_MPI=mpich; HPCGNN_MPI={asked} would put a second "
                f"MPI into it") in res.stderr, res.stderr
        assert "installing" not in res.stderr and "MPI:" not in res.stderr
