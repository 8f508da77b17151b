"""Every `<page>.md#<anchor>` reference in the code and the docs lands on a heading.

So does every `](#anchor)` link within a Markdown page.

Comments link to the docs by anchor (docs/performance.md#context-cost); a heading renamed
or moved away breaks such a link silently. This collects each reference from the sources,
the protos, the benchmarks and the docs, resolves the page as a relative link would (from
the referring file's folder, else from the repository root) and checks that the anchor is
the GitHub slug of one of the page's headings. docs/history/ is left out: it is an
append-only log whose old text may name headings that have since changed.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("specdec", "benchmarks", "docs", "protos", "tests", "deploy")
TOP_FILES = ("README.md", "pyproject.toml", "Makefile")
SUFFIXES = {".py", ".md", ".proto", ".toml", ".cpp", ".h", ".yaml", ".yml", ".sh", ".txt"}
SKIPPED = (REPO / "docs" / "history",)

REFERENCE = re.compile(r"([A-Za-z0-9_./-]*\.md)#([A-Za-z0-9_-]+)")
SAME_PAGE = re.compile(r"\]\(#([A-Za-z0-9_-]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    in_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def sources() -> list[Path]:
    files = [REPO / name for name in TOP_FILES if (REPO / name).is_file()]
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file():
                continue
            if any(path.is_relative_to(skipped) for skipped in SKIPPED) or ".venv" in path.parts:
                continue
            files.append(path)
    return files


def references() -> list[tuple[str, Path, str]]:
    """(where, page, anchor) for every reference to a page in this repository.

    A path resolves from the referring file's folder, else from the repository root; a bare
    page name also from docs/ (comments say "performance.md#..."), and one found nowhere is
    another project's page and left alone. A path with a folder that resolves nowhere is kept,
    so the test reports it."""
    found = []
    for source in sources():
        text = source.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            where = f"{source.relative_to(REPO)}:{number}"
            for match in REFERENCE.finditer(line):
                name, anchor = match.groups()
                candidates = [source.parent / name, REPO / name]
                if "/" not in name:
                    candidates.append(REPO / "docs" / name)
                page = next((p.resolve() for p in candidates if p.is_file()), None)
                if page is None and "/" not in name:
                    continue
                found.append((where, page or (source.parent / name).resolve(), anchor))
            if source.suffix == ".md":
                found.extend((where, source, anchor) for anchor in SAME_PAGE.findall(line))
    return found


def test_slug_matches_github():
    assert slug("A long prompt's catch-up") == "a-long-prompts-catch-up"
    assert slug("Drafting methods in `specdec bench`") == "drafting-methods-in-specdec-bench"
    assert slug("The draft's cache from the target") == "the-drafts-cache-from-the-target"
    assert slug("Why lookups are rejected, and what a lookup round yields") == (
        "why-lookups-are-rejected-and-what-a-lookup-round-yields"
    )


def test_references_are_found():
    pages = {page.name for _, page, _ in references()}
    assert {"performance.md", "architecture.md"} <= pages


def test_every_anchor_resolves():
    cache: dict[Path, set[str]] = {}
    broken = []
    for where, page, anchor in references():
        if not page.is_file():
            broken.append(f"{where}: no page at {page}")
        elif anchor not in cache.setdefault(page, anchors(page)):
            broken.append(f"{where}: {page.relative_to(REPO)}#{anchor}")
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)
