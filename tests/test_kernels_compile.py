"""The Triton kernels compile for an H100 (sm_90) on a machine without a GPU, with the launch
arguments the launchers really pass; and the launch counts and float instructions the bit-exact
contract needs: at most 2 launches per codec call (1 for quant alone), no FMA contraction, only
correctly rounded divisions. (The interpreter tests check the values; this checks that a GPU
machine gets kernels at all.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_with_exact_float_ops():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_compile_kernels.py")), "90"],
                          capture_output=True, text=True, env=env, timeout=900,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    calls = {r["call"]: r["launches"] for r in lines if "call" in r}
    kernels = [r for r in lines if "kernel" in r]
    assert {r["kernel"] for r in kernels} == {"_select_kernel", "_encode_kernel", "_decode_kernel",
                                            "_dropout_kernel"}
    for name, n in calls.items():
        selects = "sample" in name or "random" in name
        want = 2 if name.startswith("dropout") else (2 if selects else 1)
        assert n == want, (name, n)
    for r in kernels:
        assert r["fma"] == 0 and r["div_approx"] == 0, r
        quantises = r["kernel"] == "_encode_kernel" and r["constexprs"]["BITS"] != 32
        assert (r["div_rn"] > 0) == quantises, r
