"""``bench/epoch.py``'s table gives each configuration's wall-clock per epoch with evaluation
beside its median training step. A real run: hpcgnn on 1 and 2 MPI ranks over HDF5 shards of a
tiny cSBM, 3 epochs, PyG skipped (it needs ``torch_geometric``; the timings themselves need an
idle machine and are not checked)."""
import json
import os
import subprocess
import sys
from pathlib import Path

EPOCH = Path(__file__).resolve().parents[1] / "bench" / "epoch.py"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMP_NUM_THREADS": "1"}


def test_the_table_has_the_wall_clock_with_evaluation_beside_the_step(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EPOCH), "--dataset", "csbm:nodes=300,classes=3,degree=4,features=8,seed=1",
         "--epochs", "3", "--skip-pyg", "--shards-root", str(tmp_path / "shards"),
         "--results", str(tmp_path / "res")],
        capture_output=True, text=True, timeout=600, env={**os.environ, **MPI_ENV},
        stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "res" / "epoch.json").read_text())["results"]
    assert set(results) == {"hpcgnn-1rank", "hpcgnn-2rank", "hpcgnn-2rank-no-overlap"}
    for r in results.values():          # the median of step + evaluation over the same epochs
        assert r["epoch_wall_s"] > r["epoch_s"] > 0
    md = (tmp_path / "res" / "epoch.md").read_text()
    assert ("| configuration | median epoch (s) | speed-up vs 1 rank | with evaluation (s) "
            "| speed-up vs 1 rank | CPU s per rank per epoch |") in md
    assert "with evaluation: the same epochs' wall-clock with one evaluation each" in md
    base = results["hpcgnn-1rank"]["epoch_wall_s"]
    for name, r in results.items():
        cells = next(line for line in md.splitlines() if line.startswith(f"| {name} |")).split(" | ")
        assert cells[3] == f"{r['epoch_wall_s']:.2f}" and cells[4] == f"{base / r['epoch_wall_s']:.2f}"
