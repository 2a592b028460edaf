"""Names the code compares by member, not by spelling: planted bugs, verdicts, event kinds."""

from __future__ import annotations

from enum import Enum


class Name(str, Enum):
    """A name that is its string: it compares, hashes, prints and serialises (JSON) as its value, so
    matrix files, cells and report.json keep plain words, while code names it `Kind.X` — a misspelt
    member fails where it is read instead of silently never matching."""

    def __str__(self) -> str:
        return self.value
