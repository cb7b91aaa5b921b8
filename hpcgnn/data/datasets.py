"""Dataset specs -> a clean ``Graph``.

A spec names a dataset and its options: ``cora``, ``citeseer`` (shipped), ``npz:PATH`` (the npz
input format), ``h5:PATH`` (the same keys in HDF5, row slices readable: ``h5input.py``),
``ogbn-NAME:root=DIR`` (an OGB node-property dataset in a local directory),
``csbm:nodes=2000,classes=4,...`` (contextual SBM) and ``rmat:scale=20,...`` (R-MAT, Graph500).
Every graph comes back without self-loops or duplicate edges, and symmetrised when asked.
"""
from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any, Callable

from hpcgnn.data import synthetic
from hpcgnn.data.clean import clean_graph
from hpcgnn.data.errors import DatasetError
from hpcgnn.data.graph import Graph
from hpcgnn.data.npz import read_npz

log = logging.getLogger("hpcgnn.data")
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "datasets"
SHIPPED = ("cora", "citeseer")
GENERATORS: dict[str, Callable[..., Graph]] = {"csbm": synthetic.csbm, "rmat": synthetic.rmat}
SPEC_HELP = ("use cora, citeseer, npz:PATH, h5:PATH, ogbn-NAME:root=DIR, "
             "csbm:nodes=N,classes=C,... or rmat:scale=S,...")


def _value(text: str) -> Any:
    """An option value from a spec: bool, int, float or string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``'csbm:nodes=100,classes=3'`` -> ``('csbm', {'nodes': 100, 'classes': 3})``;
    ``'npz:PATH'`` -> ``('npz', {'path': 'PATH'})``."""
    name, _, rest = spec.partition(":")
    if name in ("npz", "h5"):
        if not rest:
            raise DatasetError(f"dataset spec '{spec}': no path; write {name}:PATH")
        return name, {"path": rest}
    opts: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise DatasetError(f"dataset spec '{spec}': option '{item}' is not key=value; "
                               f"write e.g. csbm:nodes=2000,classes=4")
        opts[key.strip()] = _value(val.strip())
    return name, opts


def _check_options(spec: str, fn: Callable[..., Any], opts: dict[str, Any]) -> None:
    allowed = [p for p in inspect.signature(fn).parameters if p != "name"]
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise DatasetError(f"dataset spec '{spec}': unknown option(s) {unknown}; "
                           f"this dataset takes {allowed}")


def _generate(spec: str, name: str, opts: dict[str, Any], symmetrize: bool) -> Graph:
    fn = GENERATORS[name]
    if name == "rmat" and symmetrize:
        opts.setdefault("symmetric", True)
    _check_options(spec, fn, opts)
    return fn(spec, **opts)


def _read(spec: str, name: str, opts: dict[str, Any]) -> Graph:
    if name in SHIPPED:
        _check_options(spec, lambda: None, opts)
        return read_npz(SHIPPED_DIR / f"{name}.npz", name=name)
    if name == "npz":
        return read_npz(opts["path"], name=spec)
    if name == "h5":
        from hpcgnn.data.h5input import read_h5
        return read_h5(opts["path"], name=spec)
    from hpcgnn.data.ogb import read_ogb     # optional dependency: imported only when asked
    _check_options(spec, read_ogb, {k: v for k, v in opts.items()})
    return read_ogb(name, **opts)


def load_dataset(spec: str, *, symmetrize: bool = False, **opts: Any) -> Graph:
    """The graph a spec names, clean; ``opts`` add to (and override) the spec's options."""
    name, spec_opts = parse_spec(spec)
    spec_opts.update(opts)
    if name in GENERATORS:
        return _generate(spec, name, spec_opts, symmetrize)
    if name not in SHIPPED and name not in ("npz", "h5") and not name.startswith("ogbn-"):
        raise DatasetError(f"dataset spec '{spec}': unknown dataset '{name}'; {SPEC_HELP}")
    graph, _ = clean_graph(_read(spec, name, spec_opts), symmetrize=symmetrize)
    return graph
