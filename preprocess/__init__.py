"""Offline preprocessing: read a dataset, partition it, write one HDF5 shard per rank.

Python API (the CLI is ``python -m preprocess``)::

    graph = hpcgnn.data.datasets.load_dataset("cora")
    parts = partition_graph(graph, 4, "metis", seed=0)
    meta = write_shards(graph, parts, "shards/cora-4", partitioner="metis", seed=0)
    verify_shards("shards/cora-4")

Across MPI ranks (each rank holds a row slice, PT-Scotch partitions; ``dist_run.py``)::

    preprocess.dist_run.run_distributed(MPI.COMM_WORLD, "h5:big.h5", 16, "ptscotch",
                                        "shards/big-16", seed=0, force=False, symmetrize=False)
"""
from preprocess.errors import PreprocessError
from preprocess.partition import partition_graph
from preprocess.verify import VerifyReport, verify_shards
from preprocess.write import write_shards

__all__ = ["PreprocessError", "VerifyReport", "partition_graph", "verify_shards", "write_shards"]
