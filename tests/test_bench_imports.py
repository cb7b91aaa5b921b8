"""The bench scripts measure the checkout they are in: each puts its own checkout first on
``sys.path`` before anything imports ``hpcgnn``, so a worktree of another commit, run with a venv
whose installed (editable) hpcgnn is a different checkout, times its own code."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ("codecs", "codec_host", "dropout", "epoch", "launch_cost", "retexo_study", "stale_study")


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_bench_script_imports_its_own_checkouts_hpcgnn(script, tmp_path):
    decoy = tmp_path / "hpcgnn"          # an installed hpcgnn of another checkout, on the path
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise SystemExit('DECOY: another checkout of hpcgnn was imported')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / f"{script}.py"), "--help"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL)
    assert "DECOY" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == 0, proc.stderr
