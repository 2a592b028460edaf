"""The docs a user reads: every CLI option and every matrix key is named in them (a feature no page names does
not exist for a reader), and no page is long or written in long sentences (README ≤ 1,500 words, a page ≤ 4,000,
a mean of ≤ 22 words a sentence, as ../shared/tools/docstat.py counts them when it is there)."""

from __future__ import annotations

import re
import typing

import pytest
import typer.main
from pydantic import BaseModel

from gaeq.cli import app
from gaeq.matrix.schema import MatrixSpec
from gaeq.problem.script import ScriptSpec
from gaeq.problem.spec import ProblemSpec
from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def docs() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def options() -> set[str]:
    """Every `--option` of every `gaeq` command."""
    found: set[str] = set()
    group = typer.main.get_command(app)
    for command in group.commands.values():
        for param in command.params:
            if not param.param_type_name == "argument":
                found.update(o for o in param.opts if o.startswith("--") and o != "--help")
    return found


def keys(model: type[BaseModel], seen: set[type] | None = None) -> set[str]:
    """Every key of a matrix file under `model`: its fields (by their alias), and those of the models they hold."""
    seen = seen if seen is not None else set()
    if model in seen:
        return set()
    seen.add(model)
    found = set()
    for name, field in model.model_fields.items():
        found.add(field.alias or name)
        for inner in _models(field.annotation):
            found |= keys(inner, seen)
    return found


def _models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def test_every_cli_option_and_matrix_key_is_named_in_the_docs():
    text = docs()
    assert len(options()) > 15 and "--baseline" in options()
    assert sorted(o for o in options() if o not in text) == []
    every = keys(MatrixSpec) | keys(ProblemSpec) | keys(ScriptSpec)
    assert {"micro_batch_size", "baseline", "deepspeed_config", "floor_twins"} <= every
    assert sorted(k for k in every if not re.search(rf"\b{re.escape(k)}\b", text)) == []


def test_the_control_an_unnamed_option_is_found():
    assert "--no-such-option" not in docs() and "--baseline" in docs()


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_page_is_long_or_written_in_long_sentences(page):
    words, mean = readability(page.read_text())
    assert words <= (1_500 if page.name == "README.md" else 4_000), words
    assert mean <= 22, mean


def test_the_whole_set_reads_in_under_30000_words():
    assert sum(readability(page.read_text())[0] for page in PAGES) < 30_000


def test_the_control_a_long_sentence_is_counted_as_one():
    assert readability(" ".join(["word"] * 30) + ". Short ones are here.\n\n| a table | is left out |")[1] == 17


def readability(raw: str) -> tuple[int, float]:
    """(words, mean words a sentence), counted as ../shared/tools/docstat.py counts them: code blocks, tables and
    headings left out of the sentences, a list item a sentence, inline code one word, pieces of 3 words or fewer
    not sentences; every word of the page in its length."""
    text = re.sub(r"```.*?```", "", raw, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("|", "#", "<!--")))
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"`[^`]*`", "X", text)
    pieces = re.split(r"(?<=[.!?:])\s+(?=[A-Z*(`-])|\n\s*\n|\n\s*[-*] |\n\s*\d+\. ", text)
    lengths = [len(piece.split()) for piece in pieces if len(piece.split()) > 3]
    return len(raw.split()), sum(lengths) / len(lengths) if lengths else 0.0
