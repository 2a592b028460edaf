"""One way to write a file others may read: under a `.partial` name, then renamed into place.

A reader (the judge, `gaeq report`, `--resume`, TensorBoard, another rank) sees either the old
file or the whole new one — never half of it, whatever interrupts the writer. A `.partial` file
left behind is an interrupted write and is never read.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

PARTIAL = ".partial"


def partial_path(path: str | Path) -> Path:
    """Where `path` is written before it is published."""
    path = Path(path)
    return path.with_name(path.name + PARTIAL)


def publish(path: str | Path) -> None:
    """Rename `path`'s finished partial file into place (atomic on one filesystem)."""
    os.replace(partial_path(path), path)


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield the partial path to write `path` through; published when the block ends normally,
    removed when it raises."""
    partial = partial_path(path)
    try:
        yield partial
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    publish(path)


def atomic_write(path: str | Path, data: str | bytes, *, shared: bool = False) -> None:
    """Write `data` (text or bytes) to `path` through its partial file — with `shared`, through a partial
    of this process's own (`NAME.<pid>.partial`): several processes write the same file at once (every rank
    of a script cell under a real launcher writes the cell's config files), the last rename wins."""
    if not shared:
        with replacing(path) as partial:
            partial.write_bytes(data) if isinstance(data, bytes) else partial.write_text(data)
        return
    path = Path(path)
    own = path.with_name(f"{path.name}.{os.getpid()}{PARTIAL}")
    try:
        own.write_bytes(data) if isinstance(data, bytes) else own.write_text(data)
        os.replace(own, path)
    finally:
        own.unlink(missing_ok=True)
