"""Per-step records of a cell, one JSON object per line, floats at full float64 precision.

A trace is written to ``trace.jsonl.partial`` and renamed to ``trace.jsonl`` only when the cell
finished, so a ``trace.jsonl`` on disk is always complete.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gaeq.files import partial_path, publish

TRACE_FILE = "trace.jsonl"


def cell_dir(run_dir: str | Path, cell_id: str) -> Path:
    """Where everything of one cell lives in a run directory."""
    return Path(run_dir) / "cells" / cell_id


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    step: int
    loss: float
    """Mean loss over the global batch of this step (before its update), accumulated in float64."""
    grad_norm: float
    """Global L2 norm of the accumulated gradient at the boundary, before clipping."""
    lr: float
    """Learning rate used by this step's update."""
    samples: int
    """Samples consumed after this step, over all ranks."""
    seconds: float
    """Wall time of this optimizer step (all its micro-steps)."""
    skipped: bool = False
    """The update was skipped: an fp16 gradient overflowed (the loss scale is lowered instead)."""
    loss_resolution: float = 0.0
    """How far `loss` may be from the exact sum by the rounding of the values it was summed from: a script's
    losses handed to backward in bf16 or fp16 are each known to half a unit of their dtype (0: float32 or
    better, whose rounding the tolerance's constants cover). Two runs' losses are compared within it too."""
    comm_bytes: int | None = 0
    """Bytes rank 0 put through collectives during this step (nccl-tests sizes, gaeq.trainers.cost);
    None: not measured (a script whose training wrapper gaeq does not know)."""
    peak_mem_bytes: int | None = 0
    """Rank 0's peak memory so far in this cell (RSS on CPU, max allocated on CUDA); None: not measured."""
    model_state_bytes: int = 0
    """Rank 0's parameters, gradients and optimizer state, in bytes, while accumulating (measured at
    one step of the cell, gaeq.trainers.base.StepRecorder.measure_model_state; 0 at the others)."""
    p2p_bytes: int = 0
    """Pipeline cells: bytes rank 0 (the first stage) sent to and received from its neighbouring
    stages during this step — activations and their gradients (gaeq.trainers.cost.PipelineCost)."""
    a2a_bytes: int = 0
    """Sequence-parallel cells: of comm_bytes, those rank 0 put through all-to-alls during this step
    (Ulysses' attention: q, k, v and the output, each way)."""
    bubble: float | None = None
    """Pipeline cells: the share of this step's schedule (from its start to the last backward of any
    rank) a rank spent not computing its forwards and backwards, mean over ranks."""


class TraceWriter:
    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / TRACE_FILE
        self._file: IO[str] | None = partial_path(self.path).open("w")

    def write(self, record: StepRecord) -> None:
        assert self._file is not None, "trace already closed"
        self._file.write(json.dumps(vars(record)) + "\n")  # vars(): asdict() deep-copies

    def close(self) -> None:
        """Complete the trace: flush, sync and atomically publish it as ``trace.jsonl``."""
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        publish(self.path)


def read_trace(directory: Path) -> list[StepRecord]:
    path = Path(directory) / TRACE_FILE
    with path.open() as f:
        return [StepRecord(**json.loads(line)) for line in f if line.strip()]


class TraceStore:
    """The traces of a run directory, each read once and shared by the judge, TensorBoard and the figure."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._cache: dict[str, list[StepRecord]] = {}

    def get(self, cell_id: str) -> list[StepRecord]:
        """Raises OSError (missing) or ValueError/TypeError (malformed) for a trace that cannot be used."""
        if cell_id not in self._cache:
            self._cache[cell_id] = read_trace(cell_dir(self.run_dir, cell_id))
        return self._cache[cell_id]

    def usable(self, cell_id: str) -> list[StepRecord] | None:
        """The trace, or None where there is none to show (an error or skipped cell)."""
        try:
            return self.get(cell_id)
        except (OSError, ValueError, TypeError):
            return None
