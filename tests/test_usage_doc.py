"""``docs/usage.md`` against the command lines and the code: every option of every ``python -m
hpcgnn`` and ``python -m preprocess`` subcommand is in the page's synopsis of that command, and
the synopsis names no option the parser lacks; every ``HPCGNN_*`` variable that ``hpcgnn/`` or
``preprocess/`` reads is listed under "Environment variables". The page is parsed here; the
parsers are the programs' own (``_parser()``), so an option added, renamed or dropped on one
side only fails here."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import hpcgnn.__main__ as hpcgnn_cli
import preprocess.__main__ as preprocess_cli

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "usage.md"
OPTION = re.compile(r"(?<![\w-])(--?[a-z][a-z-]*)")
VARIABLE = re.compile(r"HPCGNN_[A-Z0-9_]+")
LAUNCH = {"-n", "-m"}                       # mpiexec -n R python -m ...


def section(text: str, heading: str) -> str:
    """The page's text from the ``heading`` line to the next heading of its level or above."""
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    rest = text[start + len(heading) + 2:]
    end = re.search(rf"^#{{1,{len(level)}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def first_block(text: str) -> str:
    return re.search(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M).group(1)


def options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` but help; an option with a short and a long form is
    there under both, and the page must show one of them (see ``covered``)."""
    return {s for a in parser._actions if not isinstance(a, argparse._HelpAction)
            for s in a.option_strings}


def covered(parser: argparse.ArgumentParser, shown: set[str]) -> tuple[set[str], set[str]]:
    """(options of the parser the synopsis leaves out, options the synopsis shows that the
    parser lacks)."""
    missing = {a.option_strings[-1] for a in parser._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction)
               and not shown & set(a.option_strings)}
    return missing, shown - options(parser)


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in hpcgnn_cli._parser()._actions
                  if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def synopses(text: str) -> dict[str, set[str]]:
    """``{command: options shown}`` of the page's synopsis blocks."""
    found = {}
    for cmd in ("train", "predict", "plot"):
        found[cmd] = set(OPTION.findall(first_block(section(text, f"## `hpcgnn {cmd}`")))) - LAUNCH
    block = first_block(section(text, "## `python -m preprocess`"))
    for name in ("partition", "verify", "convert"):
        found[name] = set()
    for line in block.replace("\\\n", " ").split("\npython"):
        words = line.split()
        name = "verify" if "verify" in words else "convert" if "convert" in words else "partition"
        found[name] |= set(OPTION.findall(line)) - LAUNCH
    return found


def parsers() -> dict[str, argparse.ArgumentParser]:
    sub = subparsers()
    return {"train": sub["train"], "predict": sub["predict"], "plot": sub["plot"],
            "partition": preprocess_cli._parser(), "verify": preprocess_cli._verify_parser(),
            "convert": preprocess_cli._convert_parser()}


def mismatches(text: str) -> dict[str, tuple[set[str], set[str]]]:
    shown = synopses(text)
    return {cmd: m for cmd, p in parsers().items() if any(m := covered(p, shown[cmd]))}


def test_every_synopsis_matches_its_parser():
    assert mismatches(PAGE.read_text()) == {}


def test_a_doctored_synopsis_is_caught():
    doctored = PAGE.read_text().replace("[--stop-after N]", "[--stop N]").replace(
        "verify DIR [-q]", "verify DIR")
    assert mismatches(doctored) == {"train": ({"--stop-after"}, {"--stop"}),
                                    "verify": ({"--quiet"}, set())}


def code_variables() -> set[str]:
    """Every ``HPCGNN_*`` name in the Python sources of ``hpcgnn/`` and ``preprocess/``."""
    return {v for pkg in ("hpcgnn", "preprocess") for f in (REPO / pkg).rglob("*.py")
            for v in VARIABLE.findall(f.read_text())}


def test_every_variable_the_code_reads_is_listed():
    listed = set(VARIABLE.findall(section(PAGE.read_text(), "## Environment variables")))
    assert code_variables() - listed == set()
