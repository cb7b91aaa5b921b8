"""OGB node-property datasets (``ogbn-arxiv``, ``ogbn-products``, ``ogbn-papers100M``, ...) read
with the ``ogb`` package from a local directory laid out as OGB downloads it::

    ROOT/ogbn_arxiv/RELEASE_v1.txt, raw/edge.csv.gz (or raw/data.npz), raw/node-label.csv.gz,
    split/time/train.csv.gz ...

The raw files are read with ``ogb.io`` directly, not through ``NodePropPredDataset``, which
would prompt on stdin, try to download, and cache with a pickle that torch >= 2.6 refuses.
"""
from __future__ import annotations

import os
import pickle
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np

from hpcgnn.data.errors import DatasetError
from hpcgnn.data.graph import Graph
from hpcgnn.data.validate import check_graph

DOWNLOAD_HINT = ("download it on a machine with internet (python -c \"from ogb.nodeproppred "
                 "import NodePropPredDataset as D; D('{name}', root='{root}')\"), then copy "
                 "the directory it makes, {root}/{dir} (its raw/ and split/), to {root}/{dir} "
                 "here; hpcgnn reads it offline")


def _import_ogb():
    """``ogb.nodeproppred``, imported without ogb's version check: ``import ogb`` starts a
    thread that asks PyPI for the latest version (the ``outdated`` package, ``requests.get``
    without a timeout), and the process waits for it at exit, which on a compute node whose
    firewall drops the packets is minutes after the work is done. With ``outdated`` unimportable
    while ogb is first imported, ogb skips the check (it expects ``outdated`` to be optional)."""
    hide = "outdated" not in sys.modules and "ogb" not in sys.modules
    if hide:
        sys.modules["outdated"] = None        # `from outdated import ...` raises ImportError
    try:
        import ogb.nodeproppred as onp
    finally:
        if hide:
            del sys.modules["outdated"]
    return onp


def _meta_info(name: str) -> dict:
    try:
        import pandas as pd
        onp = _import_ogb()
    except ImportError as exc:
        raise DatasetError(f"{name}: the 'ogb' package is not installed; pip install ogb "
                           f"(or pip install 'hpcgnn[ogb]')") from exc
    master = pd.read_csv(Path(onp.__file__).parent / "master.csv", index_col=0,
                         keep_default_na=False)
    if name not in master:
        raise DatasetError(f"dataset '{name}': not an OGB node-property dataset; choose one of "
                           f"{list(master.keys())}")
    info = dict(master[name])
    if info["is hetero"] == "True" or int(info["num tasks"]) != 1:
        raise DatasetError(f"dataset '{name}': heterogeneous or multi-task; hpcgnn reads "
                           f"homogeneous single-label datasets (ogbn-arxiv, -products, "
                           f"-papers100M)")
    return info


def _dataset_dir(name: str, root: str | os.PathLike, info: dict) -> Path:
    d = Path(root) / name.replace("-", "_")
    hint = DOWNLOAD_HINT.format(name=name, root=root, dir=d.name)
    if not d.is_dir():
        raise DatasetError(f"{d}: no such directory, so {name} is not in root={root}; {hint}")
    for raw in _raw_files(d, info):
        if not raw.is_file():
            raise DatasetError(f"{raw}: missing, so {d} is not a complete OGB download; {hint}")
    return d


def _raw_files(d: Path, info: dict) -> list[Path]:
    """The raw files ``read_ogb`` reads (the split's are checked as they are read)."""
    if info["binary"] == "True":
        return [d / "raw" / f for f in ("data.npz", "node-label.npz")]
    extra = [] if info["additional node files"] == "None" else \
        [f"{name}.csv.gz" for name in info["additional node files"].split(",")]
    return [d / "raw" / f for f in ("edge.csv.gz", "num-node-list.csv.gz",
                                    "num-edge-list.csv.gz", "node-feat.csv.gz",
                                    "node-label.csv.gz", *extra)]


def _labels(d: Path, info: dict) -> np.ndarray:
    if info["binary"] == "True":
        y = np.load(d / "raw" / "node-label.npz")["node_label"]
    else:
        import pandas as pd
        y = pd.read_csv(d / "raw" / "node-label.csv.gz", compression="gzip", header=None).values
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    return np.where(np.isnan(y), -1, y).astype(np.int64)


def _split(d: Path, info: dict) -> tuple[np.ndarray, ...]:
    path = d / "split" / info["split"]
    if (path / "split_dict.pt").is_file():
        import torch
        s = torch.load(path / "split_dict.pt", weights_only=False)
        return tuple(np.asarray(s[k], dtype=np.int64) for k in ("train", "valid", "test"))
    import pandas as pd
    out = []
    for part in ("train", "valid", "test"):
        f = path / f"{part}.csv.gz"
        if not f.is_file():
            raise DatasetError(f"{f}: missing; the OGB split files are part of the download")
        out.append(pd.read_csv(f, compression="gzip", header=None).values[:, 0].astype(np.int64))
    return tuple(out)


def _raw_graph(d: Path, info: dict) -> dict:
    from ogb.io.read_graph_raw import read_binary_graph_raw, read_csv_graph_raw
    inverse = info["add_inverse_edge"] == "True"
    if info["binary"] == "True":
        return read_binary_graph_raw(str(d / "raw"), add_inverse_edge=inverse)[0]
    extra = [] if info["additional node files"] == "None" else \
        info["additional node files"].split(",")
    return read_csv_graph_raw(str(d / "raw"), add_inverse_edge=inverse,
                              additional_node_files=extra)[0]


def read_ogb(name: str, root: str = "data/ogb") -> Graph:
    """Read OGB dataset ``name`` from ``root`` (which holds e.g. ``ogbn_arxiv/``)."""
    info = _meta_info(name)
    d = _dataset_dir(name, root, info)
    try:
        g, labels, (train, val, test) = _raw_graph(d, info), _labels(d, info), _split(d, info)
    except DatasetError:
        raise
    except (OSError, EOFError, ValueError, RuntimeError, zlib.error, zipfile.BadZipFile,
            pickle.UnpicklingError) as exc:   # a truncated .gz (EOFError) or .npz, ogb's ...
        raise DatasetError(f"{d}: cannot read its files ({type(exc).__name__}: {exc}), so the "
                           f"copy is incomplete or damaged; "
                           f"{DOWNLOAD_HINT.format(name=name, root=root, dir=d.name)}") from exc
    n = int(g["num_nodes"])
    if g.get("node_feat") is None:
        raise DatasetError(f"{d}: has no node features (raw/node-feat.csv.gz); hpcgnn needs them")
    src, dst = (np.asarray(a, dtype=np.int64) for a in g["edge_index"])
    if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= n):
        raise DatasetError(f"{d}: raw/edge.csv.gz holds node ids outside 0..{n - 1} "
                           f"(num-node-list says {n}); re-download the dataset")
    order = np.argsort(dst, kind="stable")
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    graph = Graph(name=name, num_nodes=n, indptr=indptr, indices=src[order],
                  features=np.asarray(g["node_feat"], dtype=np.float32), labels=labels,
                  train_idx=train, val_idx=val, test_idx=test)
    check_graph(graph, str(d), int(info["num classes"]))
    return graph
