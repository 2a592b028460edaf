"""Planted bugs: deliberate mistakes a cell can switch on, so the lab proves it can see them.

A bug is a name here plus one ``if cell.bug == ...`` at the line of the trainer where the mistake
would be made. Adding one is a registry entry and that line.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlantedBug:
    name: str
    trainers: tuple[str, ...]
    """Trainers that implement the bug (the line where the mistake happens exists only there)."""
    description: str


BUGS: dict[str, PlantedBug] = {
    bug.name: bug
    for bug in (
        PlantedBug(
            name="no_loss_division",
            trainers=("torch",),
            description=(
                "the manual loop forgets ÷ GA: every micro-step backpropagates its micro-batch mean, "
                "so the accumulated gradient is GA times the global-batch mean gradient"
            ),
        ),
    )
}
