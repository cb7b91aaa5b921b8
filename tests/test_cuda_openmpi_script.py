"""env/cuda-aware-openmpi.sh refuses what it cannot build from, naming the option and the fix,
before it configures anything (the build itself takes minutes: see docs/gpu.md for what ran)."""
from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "env" / "cuda-aware-openmpi.sh"


def script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, stdin=subprocess.DEVNULL)


def test_no_subcommand_prints_the_usage(tmp_path):
    proc = script(cwd=tmp_path)
    assert proc.returncode == 2 and "fetch [DIR]" in proc.stderr and "build [OPTION...]" in proc.stderr


def test_missing_sources_name_the_option_and_fetch(tmp_path):
    proc = script("build", "--src", str(tmp_path / "empty"), "--prefix", str(tmp_path / "p"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "no Open MPI source tarball found" in proc.stderr and "fetch" in proc.stderr
    assert "--tarball PATH" in proc.stderr
    proc = script("build", "--tarball", str(tmp_path / "nope.tar.xz"), cwd=tmp_path)
    assert proc.returncode == 2 and f"--tarball {tmp_path / 'nope.tar.xz'}: no such file" in proc.stderr


def test_a_cuda_root_without_cuda_h_is_refused(tmp_path):
    tarball = tmp_path / "openmpi-0.tar.gz"
    tarball.write_bytes(b"")
    proc = script("build", "--tarball", str(tarball), "--cuda", str(tmp_path), "--prefix",
                  str(tmp_path / "p"), cwd=tmp_path)
    assert proc.returncode == 2
    assert f"--cuda {tmp_path}: no {tmp_path}/include/cuda.h" in proc.stderr
    assert not (tmp_path / "p.build").exists()                  # nothing unpacked


def test_a_tarball_without_configure_is_refused(tmp_path):
    (tmp_path / "src" / "openmpi-9").mkdir(parents=True)
    (tmp_path / "src" / "openmpi-9" / "README").write_text("not Open MPI")
    tarball = tmp_path / "openmpi-9.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(tmp_path / "src" / "openmpi-9", arcname="openmpi-9")
    proc = script("build", "--tarball", str(tarball), "--without-cuda", "--stop-after", "configure",
                  "--prefix", str(tmp_path / "p"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "no configure script at the top of the tarball" in proc.stderr
    assert "CUDA root: none" in proc.stderr


def test_stop_after_takes_two_values(tmp_path):
    proc = script("build", "--stop-after", "make", cwd=tmp_path)
    assert proc.returncode == 2 and "--stop-after make: one of configure, install" in proc.stderr
