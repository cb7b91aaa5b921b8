"""``docs/configuration.md`` against the run config itself (``hpcgnn/config.py``): every section
and every key of ``hpcgnn.config.Config`` is on the page, with the dataclass's default and the
field's docstring as its meaning, and the page lists no key the config lacks. The page is parsed
here (its ``### `[section]` `` tables), not by the generator; ``docs/config_doc.py --check``
must agree too. A test on a doctored copy of the page shows that a missing key, a wrong
default and a stale meaning are each caught."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from hpcgnn.config import Config

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "configuration.md"
HEADING = re.compile(r"### `\[(\w+)\]`")
ROW = re.compile(r"\| `(\w+)` \| `([^`]*)` \| (.*) \|")


def page_tables(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    """``{section: {key: (default as written, meaning)}}`` of the page's config tables; any
    other heading ends a table."""
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    current = None
    for line in map(str.strip, text.splitlines()):
        if line.startswith("#"):
            m = HEADING.fullmatch(line)
            current = tables.setdefault(m.group(1), {}) if m else None
        elif current is not None and (m := ROW.fullmatch(line)):
            current[m.group(1)] = (m.group(2), m.group(3).replace("\\|", "|"))
    return tables


def attribute_docstrings() -> dict[tuple[str, str], str]:
    """``{(class, field): docstring}`` read from the source of ``hpcgnn/config.py``."""
    out = {}
    for cls in (n for n in ast.parse((REPO / "hpcgnn" / "config.py").read_text()).body
                if isinstance(n, ast.ClassDef)):
        for i in range(len(cls.body) - 1):
            field, doc = cls.body[i], cls.body[i + 1]
            if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and \
                    isinstance(getattr(doc, "value", None), ast.Constant):
                out[(cls.name, field.target.id)] = " ".join(str(doc.value.value).split())
    return out


def expected() -> dict[str, dict[str, tuple[object, str]]]:
    """``{section: {key: (default, docstring)}}`` of the config dataclasses."""
    docs = attribute_docstrings()
    out = {}
    for section in fields(Config):
        cls = section.default_factory
        out[section.name] = {
            f.name: (f.default if f.default is not MISSING else f.default_factory(),
                     docs.get((cls.__name__, f.name), ""))
            for f in fields(cls)}
    return out


def problems(text: str) -> list[str]:
    """What the page gets wrong about the config (empty when nothing)."""
    page, found = page_tables(text), []
    for section, keys in expected().items():
        table = page.get(section)
        if table is None:
            found.append(f"section [{section}] is not on the page")
            continue
        found += [f"{section}.{k}: on the page, not in the config" for k in set(table) - set(keys)]
        for key, (default, doc) in keys.items():
            if key not in table:
                found.append(f"{section}.{key}: missing")
                continue
            written, meaning = table[key]
            value = tomllib.loads(f"v = {written}")["v"]
            want = list(default) if isinstance(default, tuple) else default
            if value != want or type(value) is not type(want):
                found.append(f"{section}.{key}: default {written} on the page, {default!r} in code")
            if " ".join(meaning.split()) != doc:
                found.append(f"{section}.{key}: meaning differs from the field's docstring")
    return found


def test_page_documents_every_key_with_its_default_and_docstring():
    assert problems(PAGE.read_text()) == []


def test_a_doctored_page_is_caught():
    text = PAGE.read_text()
    no_lr = "\n".join(line for line in text.splitlines() if not line.startswith("| `lr` |"))
    assert problems(no_lr) == ["train.lr: missing"]
    wrong = text.replace("| `epochs` | `200` |", "| `epochs` | `100` |")
    assert problems(wrong) == ["train.epochs: default 100 on the page, 200 in code"]
    stale = text.replace("| `hidden` | `16` | hidden", "| `hidden` | `16` | width")
    assert problems(stale) == ["model.hidden: meaning differs from the field's docstring"]
    extra = text.replace("| `hidden` | `16` |", "| `width` | `16` | x |\n| `hidden` | `16` |")
    assert problems(extra) == ["model.width: on the page, not in the config"]


def test_generator_agrees_with_the_page():
    run = subprocess.run([sys.executable, str(REPO / "docs" / "config_doc.py"), "--check"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
