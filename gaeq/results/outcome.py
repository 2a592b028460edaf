"""How running a cell ended, as the runtime saw it (before any judging)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from gaeq.files import atomic_write

OUTCOME_FILE = "outcome.json"


@dataclass(frozen=True, kw_only=True)
class CellOutcome:
    status: Literal["done", "error"]
    seconds: float
    reason: str = ""
    out_of_memory: bool = False
    """An error because a rank ran out of memory (gaeq.oom): its split does not fit, which the run says."""
    ran: dict | None = None
    """What really ran, read back from the live objects by rank 0 (gaeq.trainers.provenance);
    None where the cell never finished its first optimizer step."""


def write_outcome(cell_dir: Path, outcome: CellOutcome) -> None:
    cell_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(cell_dir / OUTCOME_FILE, json.dumps(asdict(outcome), indent=1))


def read_outcome(cell_dir: Path) -> CellOutcome | None:
    path = cell_dir / OUTCOME_FILE
    return CellOutcome(**json.loads(path.read_text())) if path.is_file() else None
