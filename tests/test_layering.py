"""The package's import graph: no circles, and every dependency points down the layers
``hashing/errors/log/memory < data, kernels < codecs < config, schedule < comm < nn < train <
predict, plot, __main__`` (DESIGN.md: ``codecs <- comm <- nn <- train <- __main__``, ``data``
below). Every ``import`` counts, including those inside functions. ``comm`` reads no shard
files: the shard set is read once, above it, and handed down. docs/architecture.md's tree
places every area at the level ``LEVEL`` gives it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hpcgnn"
LEVEL = {"hashing": 0, "errors": 0, "log": 0, "memory": 0, "data": 1, "kernels": 1, "datasets": 1,
         "codecs": 2, "combinations": 3, "config": 3, "schedule": 3, "autotune": 3, "comm": 4, "nn": 5,
         "train": 6, "predict": 7, "plot": 7, "__main__": 8}


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """What ``path`` imports; ``from pkg import submodule`` counts as the submodule only."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [n for n in subs if n in modules] or [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out |= {n for n in names if n.startswith("hpcgnn")}
    return out


def graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PKG.rglob("*.py")}
    return {m: {d for d in _imports(p, set(files)) if d in files and d != m}
            for m, p in files.items()}


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hpcgnn"


def test_dependencies_point_down():
    up = [(m, d) for m, deps in graph().items() for d in deps
          if _area(m) != _area(d) and LEVEL[_area(d)] > LEVEL[_area(m)]]
    assert up == [], f"imports running upward: {up}"


def test_no_import_cycles():
    g, state, cycles = graph(), {}, []
    # a package's __init__ re-exports its modules (and runs before any of them): not a node
    inits = {m for m in g if (PKG.parent / m.replace(".", "/") / "__init__.py").exists()}
    g = {m: deps - inits for m, deps in g.items() if m not in inits}

    def visit(m, stack):
        state[m] = "open"
        for d in g[m]:
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in g:
        if m not in state:
            visit(m, [m])
    assert cycles == [], f"import cycles: {cycles}"


def test_every_area_has_a_level():
    assert {_area(m) for m in graph()} - {"hpcgnn"} <= set(LEVEL)


def test_comm_reads_no_files():
    for path in (PKG / "comm").glob("*.py"):
        text = path.read_text()
        for call in ("read_meta", "read_shard", "read_global_ids", "read_part", "h5py"):
            assert call not in text, f"{path.name} reads the shard set ({call})"


def documented_levels(page: str) -> dict[str, int]:
    """``{area: level}`` of docs/architecture.md's tree of ``hpcgnn/``: the names that start a
    line (``x.py`` or ``x/``), at the level that line or the line above it states."""
    tree = page.split("\nhpcgnn/\n", 1)[1].split("```", 1)[0]
    levels, level = {}, None
    for line in tree.splitlines():
        if not line.startswith("  "):                  # preprocess/, outside the package
            continue
        m = re.search(r"\blevel (\d+)\b", line)
        level = int(m.group(1)) if m else level
        names = re.match(r"\s*((?:\w+(?:\.py|/)\s+)+)", line + " ").group(1).split()
        levels.update({n.removesuffix(".py").removesuffix("/"): level for n in names})
    return levels


def test_the_architecture_page_places_every_area_at_its_level():
    page = (PKG.parent / "docs" / "architecture.md").read_text()
    assert documented_levels(page) == LEVEL
