"""Full parameter and gradient snapshots at optimizer boundaries, and their comparison.

With ``track: [params, grads]`` a cell saves, every ``track_every`` steps, the accumulated gradients
*before* the update (before clipping: what every split must agree on) and the parameters *after*
it, gathered whole from every ZeRO partition, as float32 in one ``snapshots.safetensors`` per cell.
Tensors are compared against the baseline's, one named tensor at a time; the first divergence is
reported as step, kind, parameter name, max abs and norm-relative difference, and the tolerance.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gaeq.files import replacing

if TYPE_CHECKING:  # torch is imported where tensors are made: `gaeq run` starts the ranks' fork
    import torch  # server before its own process pays for torch

SNAPSHOT_FILE = "snapshots.safetensors"
KINDS = ("grads", "params")
"""In step order: a step's gradients exist before its update, its parameters after."""


def wanted(step: int, *, every: int, steps: int) -> bool:
    return step % every == 0 or step == steps - 1


class SnapshotWriter:
    """Collects tensors in memory (CPU, float32) and writes them once, atomically, at close()."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / SNAPSHOT_FILE
        self._tensors: dict[str, torch.Tensor] = {}
        self._order: list[str] = []

    def add(self, *, step: int, kind: str, named: Mapping[str, torch.Tensor]) -> None:
        import torch

        for name, tensor in named.items():
            if tensor is None:
                raise ValueError(f"no {kind} for {name} at step {step}")
            key = f"{kind}/{step}/{name}"
            self._tensors[key] = tensor.detach().to("cpu", torch.float32).clone().contiguous()
            if name not in self._order:
                self._order.append(name)

    def close(self) -> None:
        from safetensors.torch import save_file

        with replacing(self.path) as partial:
            save_file(self._tensors, str(partial), metadata={"order": json.dumps(self._order)})


@dataclass(frozen=True)
class Snapshots:
    tensors: dict[tuple[str, int, str], torch.Tensor]
    """(kind, step, parameter name) → tensor"""
    order: list[str]
    """Parameter names in model order."""

    @property
    def steps(self) -> list[int]:
        return sorted({step for _, step, _ in self.tensors})


def read_snapshots(directory: Path) -> Snapshots:
    from safetensors import safe_open

    path = Path(directory) / SNAPSHOT_FILE
    with safe_open(str(path), framework="pt") as f:
        order = json.loads((f.metadata() or {}).get("order", "[]"))
        tensors = {}
        for key in f.keys():
            kind, step, name = key.split("/", 2)
            tensors[(kind, int(step), name)] = f.get_tensor(key)
    return Snapshots(tensors=tensors, order=order)


@dataclass(frozen=True, kw_only=True)
class TensorDivergence:
    step: int
    kind: str
    name: str
    abs_diff: float
    rel_diff: float
    """max|Δ| / max|baseline tensor|"""
    tol: float
    """The relative threshold it exceeded: rtol + atol / max|baseline tensor|."""

    def describe(self) -> str:
        return (
            f"diverged at step {self.step}: {self.kind} of {self.name}, abs {self.abs_diff:.1e}, "
            f"rel {self.rel_diff:.1e} > tol {self.tol:.0e}"
        )


@dataclass(frozen=True, kw_only=True)
class TensorComparison:
    max_abs: dict[str, float]
    """kind → max |Δ| over every step and tensor"""
    max_rel: dict[str, float]
    """kind → max |Δ| / max |baseline| over every step and tensor"""
    first: dict[str, TensorDivergence]
    """kind → its first divergence (absent: none)"""


def compare_snapshots(
    base: Snapshots, other: Snapshots, *, atol: float, rtol: float, first_step: int = 0
) -> TensorComparison:
    """Tensor by tensor, in (step, kind, model order). A tensor diverges when
    max|Δ| > atol + rtol · max|baseline|. Raises ValueError when the snapshots do not line up."""
    max_abs = {kind: 0.0 for kind in KINDS}
    max_rel = {kind: 0.0 for kind in KINDS}
    first: dict[str, TensorDivergence] = {}
    steps = [step for step in base.steps if step >= first_step]
    for key in base.tensors:
        if key[1] >= first_step and key not in other.tensors:
            raise ValueError(f"no {key[0]} of {key[2]} at step {key[1]} in the cell's snapshots")
    for step in steps:
        for kind in KINDS:
            for name in base.order:
                key = (kind, step, name)
                if key not in base.tensors:
                    continue
                b, o = base.tensors[key].double(), other.tensors[key].double()
                if b.shape != o.shape:
                    raise ValueError(f"{kind} of {name}: shape {tuple(o.shape)} vs baseline {tuple(b.shape)}")
                scale = b.abs().max().item() if b.numel() else 0.0
                diff = (o - b).abs().max().item() if b.numel() else 0.0
                if diff != diff:  # NaN
                    diff = float("inf")
                rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
                max_abs[kind], max_rel[kind] = max(max_abs[kind], diff), max(max_rel[kind], rel)
                if kind not in first and diff > atol + rtol * scale:
                    tol = rtol + atol / scale if scale > 0 else float(atol)
                    first[kind] = TensorDivergence(
                        step=step, kind=kind, name=name, abs_diff=diff, rel_diff=rel, tol=tol
                    )
    return TensorComparison(max_abs=max_abs, max_rel=max_rel, first=first)
