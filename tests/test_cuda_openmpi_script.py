"""env/cuda-aware-openmpi.sh refuses what it cannot build from, naming the option and the fix,
before it configures anything (the build itself takes minutes: see docs/gpu.md for what ran);
bench/gpu-session.sh carries only an Open MPI that will load on the GPU machine, and part 1
keeps it."""
from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

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



def _no_configure_tarball(tmp_path: Path) -> Path:
    """A tarball that stops ``build`` at its first step after the plan (no configure script)."""
    top = tmp_path / "tree" / "openmpi-9"
    top.mkdir(parents=True, exist_ok=True)
    (top / "README").write_text("not Open MPI")
    tarball = tmp_path / "openmpi-9.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(top, arcname="openmpi-9")
    return tarball


def _plan(tmp_path: Path, venv: Path, *extra: str) -> subprocess.CompletedProcess:
    return script("build", "--tarball", str(_no_configure_tarball(tmp_path)), "--without-cuda",
                  "--prefix", str(tmp_path / "p"), "--venv", str(venv), "--src", str(tmp_path / "carried"),
                  *extra, cwd=tmp_path)


def _venv_without_mpi4py(tmp_path: Path) -> Path:
    """A 'venv' whose python sees no site-packages (``-S``), so no mpi4py."""
    venv = tmp_path / "bare"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    return venv


def test_the_mpi4py_route_is_decided_before_anything_is_built(tmp_path):
    """An existing venv's binary mpi4py (PyPI's: it loads the libmpi it finds in the venv's lib/)
    is kept; else a carried wheel for the venv's python; else the carried sdist. Each is said
    before Open MPI is unpacked."""
    import mpi4py
    if (Path(mpi4py.__file__).parent / "_mpiabi.py").exists():      # PyPI's binary mpi4py here
        proc = _plan(tmp_path, Path(sys.prefix))
        assert proc.returncode == 2, proc.stderr
        assert f"mpi4py: {sys.prefix}'s binary mpi4py is kept" in proc.stderr
        assert "no configure script" in proc.stderr      # the plan came first, then the unpack

    bare = _venv_without_mpi4py(tmp_path)
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "mpi4py-4.1.2.tar.gz").write_bytes(b"")
    proc = _plan(tmp_path, bare)
    assert "mpi4py: compiled from mpi4py-4.1.2.tar.gz against the new MPI" in proc.stderr, proc.stderr
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    other = "cp27" if tag != "cp27" else "cp36"
    (carried / f"mpi4py-4.1.2-{other}-{other}-manylinux1_x86_64.whl").write_bytes(b"")
    proc = _plan(tmp_path, bare)                         # a wheel for another python: not taken
    assert "mpi4py: compiled from" in proc.stderr, proc.stderr
    wheel = f"mpi4py-4.1.2-{tag}-{tag}-manylinux1_x86_64.whl"
    (carried / wheel).write_bytes(b"")
    proc = _plan(tmp_path, bare)
    assert f"mpi4py: the binary wheel {wheel} (nothing to compile)" in proc.stderr, proc.stderr


def test_a_wrong_mpi4py_is_refused_before_the_build(tmp_path):
    wheel = tmp_path / "mpi4py-4.1.2-cp312-cp312-manylinux1_x86_64.whl"
    wheel.write_bytes(b"")
    proc = _plan(tmp_path, tmp_path / "no-venv", "--mpi4py", str(wheel))
    assert proc.returncode == 2
    assert f"{tmp_path / 'no-venv'} does not exist, and a new venv gets mpi4py from an sdist" in proc.stderr
    assert "bench/gpu-venv.sh" in proc.stderr
    assert not (tmp_path / "p.build").exists()           # nothing unpacked
    odd = tmp_path / "mpi4py.zip"
    odd.write_bytes(b"")
    proc = _plan(tmp_path, Path(sys.prefix), "--mpi4py", str(odd))
    assert proc.returncode == 2 and "give an sdist (.tar.gz) or a wheel (.whl)" in proc.stderr
    proc = _plan(tmp_path, Path(sys.prefix), "--mpi4py", str(tmp_path / "none.tar.gz"))
    assert proc.returncode == 2 and f"--mpi4py {tmp_path / 'none.tar.gz'}: no such file" in proc.stderr
    assert not (tmp_path / "p.build").exists()


# -- bench/gpu-session.sh: the Open MPI made here ('prebuild') and carried to the GPU machine ----
SESSION = REPO / "bench" / "gpu-session.sh"
CORE = ("lib/libmpi.so", "lib/libopen-pal.so", "lib/libopen-rte.so", "lib/libmca_common_cuda.so",
        "bin/orted", "bin/orterun")


def _shared_lib(tmp_path: Path, name: str, links: Path | None = None) -> Path:
    """A real shared library ``name``, linked against ``links`` (another one) where given."""
    import shutil
    cc = shutil.which("cc")
    if cc is None or shutil.which("ldd") is None:
        pytest.skip("needs cc and ldd")
    src, lib = tmp_path / f"{name}.c", tmp_path / f"{name}.so"
    src.write_text(f"int need(void);\nint {name}(void) {{ return need(); }}\n" if links
                   else "int need(void) { return 0; }\n")
    extra = [f"-L{links.parent}", f"-l{links.stem[3:]}", f"-Wl,-rpath,{links.parent}"] if links else []
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src), *extra], check=True, timeout=60)
    return lib


def _session_checkout(tmp_path: Path, core: Path) -> Path:
    """A checkout with bench/gpu-session.sh and stubs for what it runs: env/cuda-aware-openmpi.sh
    records its arguments and installs a prefix whose MPI core files are ``core`` (a real shared
    library), with its stamp; bench/gpu.sh and the venvs' pythons succeed doing nothing."""
    root = tmp_path / "checkout"
    (root / "bench").mkdir(parents=True)
    (root / "env").mkdir()
    (root / "bench" / "gpu-session.sh").write_text(SESSION.read_text())
    (root / "bench" / "gpu.sh").write_text("exit 0\n")
    files = " ".join(CORE)
    (root / "env" / "cuda-aware-openmpi.sh").write_text(
        'echo "$*" >> calls.log\n'
        "[[ -f .openmpi-cuda/.hpcgnn-build ]] && exit 0\n"
        f"for f in {files}; do mkdir -p .openmpi-cuda/$(dirname $f); cp {core} .openmpi-cuda/$f; done\n"
        "echo stamp > .openmpi-cuda/.hpcgnn-build\n")
    (root / ".cuda-headers" / "include").mkdir(parents=True)
    (root / ".cuda-headers" / "include" / "cuda.h").write_text("")
    for venv in (".venv", ".venv-cuda"):
        (root / venv / "bin").mkdir(parents=True)
        (root / venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
        (root / venv / "bin" / "python").chmod(0o755)
    return root


def _session(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "bench/gpu-session.sh", *args], capture_output=True, text=True,
                          timeout=120, cwd=root, stdin=subprocess.DEVNULL)


def test_prebuild_refuses_an_open_mpi_that_needs_this_machines_libraries(tmp_path):
    """Open MPI's configure links the system's hwloc and libevent wherever their -dev packages
    are installed (the development machine's build loaded libhwloc.so.15, libevent-2.1.so.7
    and libudev.so.1 from /lib), which the GPU machine need not have: prebuild asks for Open
    MPI's own, and refuses (removing the stamp, so part 1 builds there instead) a build whose
    MPI core loads anything from outside it but libc, libm and zlib."""
    need = _shared_lib(tmp_path, "libneed")
    root = _session_checkout(tmp_path, _shared_lib(tmp_path, "libcore", links=need))
    proc = _session(root, "prebuild")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "may lack: libneed.so" in proc.stderr and "do not carry it" in proc.stderr
    assert not (root / ".openmpi-cuda" / ".hpcgnn-build").exists()


def test_prebuild_and_part_1_configure_alike_so_the_carried_build_is_kept(tmp_path):
    """The stamp of env/cuda-aware-openmpi.sh holds the configure arguments: part 1 must pass
    prebuild's (Open MPI's own hwloc and libevent), or it builds again on the lease."""
    root = _session_checkout(tmp_path, _shared_lib(tmp_path, "libcore"))
    proc = _session(root, "prebuild")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (root / ".openmpi-cuda" / ".hpcgnn-build").exists()
    proc = _session(root, "1", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prebuild, part1 = (root / "calls.log").read_text().splitlines()
    assert prebuild.startswith("build --src .src --cuda .cuda-headers --stop-after install")
    assert "--with-hwloc=internal --with-libevent=internal" in prebuild
    assert "--cuda .cuda-headers" in part1
    assert part1.split(" -- ")[1] == prebuild.split(" -- ")[1]
    assert (tmp_path / "out" / "gpu-session-1.tgz").exists()


def _logging_venv(tmp_path: Path, prefix: Path) -> tuple[Path, Path]:
    """A 'venv' whose python logs its arguments and answers the script's checks: no pip
    Open MPI of its own, mpi4py loading ``prefix``'s libmpi, every other call a success;
    with the stamp ``env/setup.sh`` leaves after a pip-route set-up of this pyproject."""
    venv, log = tmp_path / "venv", tmp_path / "python.log"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(
        f'#!/bin/sh\necho "$*" >> "{log}"\ncase "$*" in\n'
        f'  *\'distribution("openmpi")\'*) exit 1 ;;\n'
        f'  */proc/self/maps*) echo "{prefix}/lib/libmpi.so.40" ;;\nesac\nexit 0\n')
    (venv / "bin" / "python").chmod(0o755)
    digest = subprocess.run(["sha256sum", str(REPO / "pyproject.toml")], capture_output=True,
                            text=True, check=True).stdout[:16]
    (venv / ".hpcgnn-setup").write_text(f"route=pip pyproject={digest}\ntest\n")
    return venv, log


def test_the_venv_it_links_keeps_that_mpi_through_env_setup(tmp_path):
    """The script links a venv to its Open MPI (removing pip's) and records route=cuda-openmpi
    in the venv's stamp: a later ``env/setup.sh`` (after a pyproject change) installs no MPI
    into it (hpcgnn alone is installed); another route asked for is refused. It used to leave the
    stamp's route=pip, and setup.sh then installed pip's Open MPI over the CUDA-aware one. No
    Open MPI is built here: the prefix holds the script's own build stamp."""
    import os
    prefix = (tmp_path / "p").resolve()
    prefix.mkdir()
    (prefix / ".hpcgnn-build").write_text("tarball=openmpi-9.tar.gz cuda=none configure=\n")
    venv, log = _logging_venv(tmp_path, prefix)
    wheel = tmp_path / "mpi4py-4.1.2-cp312-cp312-manylinux1_x86_64.whl"
    wheel.write_bytes(b"")
    proc = _plan(tmp_path, venv, "--mpi4py", str(wheel))
    assert proc.returncode == 0, proc.stderr
    assert "Open MPI already built in" in proc.stderr and "done:" in proc.stderr
    assert (venv / "bin" / "mpiexec").resolve() == prefix / "bin" / "mpiexec"
    stamp = (venv / ".hpcgnn-setup").read_text().split("\n")
    assert stamp[0].startswith("route=cuda-openmpi pyproject=") and stamp[1] == "test", stamp
    stamp[0] = "route=cuda-openmpi pyproject=0123456789abcdef"       # pyproject.toml changed
    (venv / ".hpcgnn-setup").write_text("\n".join(stamp))
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("HPCGNN_MPI", "HPCGNN_EXTRAS")}
    res = subprocess.run(["bash", str(REPO / "env" / "setup.sh")], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL, env={**env, "HPCGNN_VENV": str(venv)})
    assert res.returncode == 0, res.stderr
    assert "the Open MPI env/cuda-aware-openmpi.sh built: keeping it" in res.stderr, res.stderr
    assert f"MPI: kept as env/cuda-aware-openmpi.sh linked it (mpiexec: {prefix}/bin/mpiexec)" \
        in res.stderr, res.stderr
    installs = [ln for ln in log.read_text().splitlines() if "pip install" in ln]
    assert installs == [f"-m pip install --quiet -e {REPO}"], installs      # no openmpi, mpi4py
    assert (venv / ".hpcgnn-setup").read_text().startswith("route=cuda-openmpi pyproject=")
    res = subprocess.run(["bash", str(REPO / "env" / "setup.sh")], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL,
                         env={**env, "HPCGNN_VENV": str(venv), "HPCGNN_MPI": "pip"})
    assert res.returncode == 2 and "HPCGNN_MPI=pip would put a second MPI into it" in res.stderr
