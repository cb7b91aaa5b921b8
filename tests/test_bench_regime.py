"""``bench/regime.py``'s table gives each algorithm's wall-clock per epoch with evaluation beside
its median training step, each against the halo exchange of the same graph, P and link. A real
sweep: 4 MPI ranks on shared memory, a tiny cSBM preprocessed to HDF5 shards, 2 epochs (the
timings themselves need an idle machine and are not checked)."""
import json
import os
import subprocess
import sys
from pathlib import Path

REGIME = Path(__file__).resolve().parents[1] / "bench" / "regime.py"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMP_NUM_THREADS": "1"}


def test_the_table_has_the_wall_clock_with_evaluation_beside_the_step(tmp_path):
    out = tmp_path / "regime"
    proc = subprocess.run(
        [sys.executable, str(REGIME), "--graphs", "csbm-metis",
         "--csbm", "csbm:nodes=300,classes=3,degree=4,features=8,seed=1", "--ranks", "4",
         "--rates", "shm", "--epochs", "2", "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, **MPI_ENV},
        stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert {r["algorithm"] for r in results} == {"halo", "1.5d", "2d"}
    for r in results:        # epoch 1's wall-clock holds its step and the run's one evaluation
        assert r["epoch_wall_s"] > r["epoch_s"] > 0 and r["train_wall_s"] > r["epoch_wall_s"]
    md = out.with_suffix(".md").read_text()
    assert "epoch: the median training step; wall: the mean wall-clock per epoch with evaluation" in md
    head = "| graph | P | link | algorithm | parts | words counted | closed form | epoch (ms) | vs halo | wall (ms) | vs halo |"
    assert head in md
    rows = {line.split(" | ")[3]: line.strip("| ").split(" | ") for line in md.splitlines()
            if line.startswith("| csbm-metis |")}
    assert set(rows) == {"halo", "1.5d", "2d"}
    halo = next(r for r in results if r["algorithm"] == "halo")
    for r in results:
        cells = rows[r["algorithm"]]
        assert cells[7] == f"{1e3 * r['epoch_s']:.1f}" and cells[9] == f"{1e3 * r['epoch_wall_s']:.1f}"
        assert cells[8] == f"{halo['epoch_s'] / r['epoch_s']:.2f}x"
        assert cells[10] == f"{halo['epoch_wall_s'] / r['epoch_wall_s']:.2f}x"
    assert "P=4: fastest step " in md and ", wall-clock " in md
