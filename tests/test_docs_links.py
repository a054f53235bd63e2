"""Every relative link in the documentation resolves, and the README stays short (issue 42).

Checked: README.md, docs/**/*.md, configs/README.md, benchmarks/RESULTS.md and HISTORY.md. A
relative link must name a file or directory that exists; a `#fragment` must match a heading of the
target (or of the same file) by GitHub's anchor rule. Links inside code blocks and code
spans are not links; `http(s):` and `mailto:` links are not checked (no network).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
# Pages another branch is adding: a link to one is accepted while it is absent, and checked
# like any other (anchors included) once it exists. Remove an entry when its page lands.
PENDING: set[Path] = set()

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "configs" / "README.md",
             REPO / "benchmarks" / "RESULTS.md", REPO / "benchmarks" / "HISTORY.md",
             *sorted((REPO / "docs").rglob("*.md"))]
    return [f for f in files if f.is_file()]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with code spans blanked."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"`[^`]*`", "``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's heading anchor: markup dropped, lower case, punctuation removed, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # keeps letters, digits, _, - and spaces
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    result = set()
    for _, line in prose_lines_raw(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        name = base if seen[base] == 0 else f"{base}-{seen[base]}"
        seen[base] += 1
        result.add(name)
    return result


def prose_lines_raw(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, code spans kept (headings need them)."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(line):
            found.append((number, m.group(1)))
    return found


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:, ...
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}:{number}: {target}"
        if not dest.exists():
            if dest in PENDING:
                continue
            problems.append(f"{where}: no such file")
            continue
        if fragment and dest.is_file() and dest.suffix == ".md":
            if unquote(fragment).lower() not in anchors(dest):
                problems.append(f"{where}: no heading with anchor #{fragment} in "
                                f"{dest.relative_to(REPO)}")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_the_docs_have_links_to_check():
    """The checker sees the README's links (a regex that matched nothing would pass)."""
    targets = [t for _, t in links(REPO / "README.md")]
    assert any(t.startswith("docs/") for t in targets), targets


def test_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


@pytest.mark.parametrize("heading, anchor", [
    ("Two commands", "two-commands"),
    ("GPUs and vLLM", "gpus-and-vllm"),
    ("Deep search: read the pages, summarise into the result",
     "deep-search-read-the-pages-summarise-into-the-result"),
    ("Search cache (SQLite, WAL)", "search-cache-sqlite-wal"),
    ("`make demo`: 3.68 GiB", "make-demo-368-gib"),
    ("(a) decode throughput: engine vs `model.generate`, same batch and settings",
     "a-decode-throughput-engine-vs-modelgenerate-same-batch-and-settings"),
    ("4.3 future_kl (APPO, after FIPO)", "43-future_kl-appo-after-fipo"),
])
def test_slug_follows_github(heading, anchor):
    assert slug(heading) == anchor


def test_a_broken_link_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "a.md").write_text("# Top\n\n[ok](b.md#part-one) [bad](b.md#nope) "
                                   "[gone](c.md) [self](#top) `[code](x.md)`\n")
    (tmp_path / "b.md").write_text("## Part one\n")
    problems = broken_links(tmp_path / "a.md")
    assert len(problems) == 2 and "#nope" in problems[0] and "c.md" in problems[1]
