"""The documentation a clone ships links only to files in the clone: every relative link (and
image) in the README, the changelog, ``docs/``, ``bench/`` and ``env/`` Markdown points at a
file of this repository that exists, and a ``#anchor`` into a Markdown file names one of its
headings (GitHub's anchors). Nothing points outside the repository (a user's clone has no
``../shared/``). ``PENDING`` lists pages that another branch adds; drop them once merged.
docs/testing.md's table names every test file."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PENDING: set[str] = set()
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def pages() -> list[Path]:
    found = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "env" / "README.md"]
    found += sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "bench").rglob("*.md"))
    return [p for p in found if p.is_file()]


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of ``page``: lower case, punctuation dropped, spaces to '-',
    repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def broken(page: Path) -> list[str]:
    """Every link of ``page`` that leaves the repository or names no file or heading."""
    bad = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):                    # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if REPO not in dest.parents and dest != REPO:
            bad.append(f"{target}: outside the repository")
            continue
        rel = dest.relative_to(REPO).as_posix()
        if not dest.exists():
            if rel not in PENDING:
                bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {rel}")
    return bad


def test_every_link_resolves_inside_the_clone():
    problems = {p.relative_to(REPO).as_posix(): broken(p) for p in pages()}
    assert {k: v for k, v in problems.items() if v} == {}


def test_the_checker_catches_bad_links(tmp_path):
    page = REPO / "docs" / "_probe_links.md"
    page.write_text("[a](../../shared/DESIGN.md) [b](usage.md#no-such-heading) [c](nothere.md) "
                    "[d](usage.md#resume) `[e](inline.md)`\n\n```\n[f](fenced.md)\n```\n")
    try:
        assert broken(page) == ["../../shared/DESIGN.md: outside the repository",
                                "usage.md#no-such-heading: no heading #no-such-heading in docs/usage.md",
                                "nothere.md: no such file"]
    finally:
        page.unlink()


def test_readme_is_a_front_page():
    assert len((REPO / "README.md").read_text().splitlines()) <= 160


def test_the_testing_page_names_every_test_file():
    """docs/testing.md's table of what each test file checks names every ``tests/test_*.py``,
    and no file that is not there."""
    text = (REPO / "docs" / "testing.md").read_text()
    table = text.split("\n## What each test file checks\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(test_\w+\.py)`", table))
    files = {p.name for p in (REPO / "tests").glob("test_*.py")}
    assert (files - named, named - files) == (set(), set())
