"""The README and the pages under docs/ link each other and the code: every relative link must land on a
file or folder that exists, and every `#anchor` on a heading of the page it names."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)[ \t]*#*[ \t]*$")
# [text](target) and ![alt](target); the text may span lines and hold `code`; a "title" after the target is ignored.
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)  # http:, https:, mailto:, ...


def prose(text: str) -> str:
    """The text outside fenced code blocks (whose brackets and `#` lines are code, not links or headings)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        kept.append("" if fenced else line)
    return "\n".join(kept)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, without characters other than letters
    (unicode ones too), digits, spaces, hyphens and underscores; spaces become hyphens."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor the headings of a Markdown text define (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(text).splitlines():
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, text: str) -> list[str]:
    """The relative links of `text` (the content of `page`) that do not resolve, one line each. Only files
    the links name are read; `page` itself need not exist (its own anchors come from `text`)."""
    broken = []
    for match in LINK.finditer(prose(text)):
        target = match.group(2)
        if not target or EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        where = f"{page.name}: [{' '.join(match.group(1).split())}]({target})"
        if path_part:
            dest = (page.parent / unquote(path_part)).resolve()
            if not dest.exists():
                broken.append(f"{where}: {path_part} does not exist")
                continue
        else:
            dest = None
        if not anchor:
            continue
        if dest is not None and (dest.is_dir() or dest.suffix.lower() != ".md"):
            broken.append(f"{where}: #{anchor} in a file that is not Markdown")
            continue
        headings = anchors(text if dest is None else dest.read_text(encoding="utf-8"))
        if unquote(anchor).lower() not in headings:
            broken.append(f"{where}: no heading with anchor #{anchor}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert broken_links(page, page.read_text(encoding="utf-8")) == []


def test_the_checker_reports_a_broken_link_and_a_broken_anchor():
    """The control: a page that is never written, with one good and one bad link of each kind."""
    page = REPO / "docs" / "control-page-never-written.md"
    text = "\n".join(
        [
            "# Control page",
            "",
            "## Résumé: ×2, `code` & more_stuff",
            "",
            "[fine](architecture.md) [fine](../README.md#quick-start) [fine](#control-page) [fine](../gaeq)",
            "[fine](#résumé-2-code--more_stuff) [fine](https://example.com/nowhere) [fine](mailto:a@b.c)",
            "[missing file](no-such-page.md) [missing anchor](../README.md#no-such-heading)",
            "![missing image](no-such-figure.png) [missing local](#nowhere-on-this-page)",
            "```",
            "[inside a fence](not-checked.md)",
            "```",
        ]
    )
    broken = broken_links(page, text)
    assert [line.split(": ", 1)[1].split("(")[0] for line in broken] == [
        "[missing file]",
        "[missing anchor]",
        "[missing image]",
        "[missing local]",
    ], broken
    assert "no-such-page.md does not exist" in broken[0]
    assert "no heading with anchor #no-such-heading" in broken[1]
    assert "#nowhere-on-this-page" in broken[3]


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Deep comparison: parameters and gradients", "deep-comparison-parameters-and-gradients"),
        ("Strategies: DDP, ZeRO, FSDP2, tensor parallelism", "strategies-ddp-zero-fsdp2-tensor-parallelism"),
        ("Plugins: bring your own model, data and loss", "plugins-bring-your-own-model-data-and-loss"),
        ("gaeq — gradient-accumulation equivalence lab", "gaeq--gradient-accumulation-equivalence-lab"),
        ("`tests/unit` and [links](x.md)", "testsunit-and-links"),
        ("Été déjà vu", "été-déjà-vu"),
    ],
)
def test_slug_is_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < 250, f"README.md has {lines} lines: move a section to docs/ and link it"
