"""The Markdown a newcomer reads: every relative link resolves, every page under docs/ is linked
from somewhere, and no page grows past what a person reads (a scripted edit once repeated one
paragraph of docs/request-path.md 13,622 times, and nothing noticed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), ROOT / "bench" / "README.md"],
)
MAX_PAGE_BYTES = 100_000
# [text](target) outside code spans; a target with a scheme or only an anchor is not a file.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # fenced code is not prose
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_is_of_readable_size_and_its_relative_links_resolve(page: Path) -> None:
    assert page.stat().st_size <= MAX_PAGE_BYTES, f"{page.relative_to(ROOT)}: {page.stat().st_size} bytes"
    broken = [t for t in _links(page) if not (page.parent / t.split("#", 1)[0]).exists()]
    assert broken == [], f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_every_docs_page_is_linked_from_another_page() -> None:
    linked = {
        (page.parent / target.split("#", 1)[0]).resolve()
        for page in PAGES
        for target in _links(page)
        if (page.parent / target.split("#", 1)[0]).resolve() != page.resolve()
    }
    orphans = [str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md") if p.resolve() not in linked]
    assert orphans == [], f"docs pages no other page links to: {orphans}"
