"""A rank that fails its start-up checks ends the job cleanly with every halo transport.

Nothing collective may run before the ranks agree that nobody failed (``hpcgnn.train.launch``):
the transport's choice of collective and its dist-graph communicators are made at the first
exchange, so a rank with a corrupt shard, waiting in the failure agreement, never meets the
others inside ``Create_dist_graph_adjacent``. Each case: one truncated part on the last rank,
the transport forced (or chosen automatically) on 2 ranks, and the neighbourhood collective
(whose dist-graph communicator is where a failed rank once hung the others) on 8 too; the job exits with code 2,
the failing rank names the file and the fix, the others say why they stop, no traceback.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import train

pytestmark = pytest.mark.mpi

TRANSPORTS = {"alltoallv": {"HPCGNN_EXCHANGE": "alltoallv"},
              "neighbor": {"HPCGNN_EXCHANGE": "neighbor"},
              "auto": {}}
LIMIT_S = 90      # a hang fails here (subprocess.TimeoutExpired); a clean exit takes seconds


@pytest.mark.parametrize("transport,ranks", [(t, 2) for t in TRANSPORTS] + [("neighbor", 8)])
def test_corrupt_shard_ends_the_job_with_every_transport(shards, tmp_path, ranks, transport):
    bad = tmp_path / "shards"
    shutil.copytree(shards("cora", ranks, "metis"), bad)
    part = bad / f"part-{ranks - 1:05d}.h5"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    try:
        proc = train(ranks, bad, tmp_path / "run", "train.epochs=2", timeout=LIMIT_S,
                     env=TRANSPORTS[transport])
    except subprocess.TimeoutExpired:
        pytest.fail(f"{transport} on {ranks} ranks: the job hung (> {LIMIT_S} s) after a "
                    f"start-up failure")
    assert proc.returncode == 2, proc.stderr
    assert f"[rank 0/{ranks}] ERROR rank {ranks - 1}: " in proc.stderr and part.name in proc.stderr
    assert "preprocess" in proc.stderr                                 # the fix
    others = "rank 0" if ranks == 2 else f"ranks 0-{ranks - 2}"      # stop because of the other
    assert f"[rank 0/{ranks}] ERROR {others}: no error; stopping with the others" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
