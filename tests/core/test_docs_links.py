"""Every relative link of README.md and docs/*.md reaches a page that exists and, with a
``#fragment``, a heading of that page (issue 31 moved architecture.md's sections to topic
pages; a renamed page or heading must not leave a dead link)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^#+ (.+)$", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose(page: Path) -> str:
    """The page without its fenced code blocks (a `# comment` there is not a heading)."""
    return FENCE.sub("", page.read_text())


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(heading) for heading in HEADING.findall(prose(page))}


def dead_links(page: Path) -> list[str]:
    dead = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):
            continue  # https://, mailto: ...
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            dead.append(f"{page.name}: {target} (no such file)")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            dead.append(f"{page.name}: {target} (no such heading)")
    return dead


def test_every_relative_link_of_the_docs_resolves():
    assert len(PAGES) > 10, PAGES
    dead = [d for page in PAGES for d in dead_links(page)]
    assert not dead, "\n".join(dead)


def test_the_check_finds_a_missing_page_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text(
        "# Other\n\n## The `wave` loop\n\n```sh\n# not a heading\n```\n"
    )
    page.write_text(
        "[ok](other.md#the-wave-loop) [gone](gone.md) [bad](other.md#not-a-heading) "
        "[web](https://example.org/x.md)\n"
    )
    assert dead_links(page) == [
        "page.md: gone.md (no such file)",
        "page.md: other.md#not-a-heading (no such heading)",
    ]
