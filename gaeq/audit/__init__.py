"""`gaeq audit`: what a DeepSpeed config does to gradient-accumulation equivalence, one finding per key.

Each finding says the key, its value (or what DeepSpeed does when it is absent — read from
DeepSpeed), its effect (`breaks` / `risk` / `fine`) and why, in a sentence. The lab states nothing
it has not shown: every `breaks` and `risk` names the experiment cell that demonstrates it (a
control that diverges, or a measured difference); tests/unit/test_audit.py checks that each named
cell exists and is expected to show what the finding says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from gaeq.audit.checks import (
    batch_keys,
    clipping,
    communication,
    grad_accum_dtype,
    loss_scale,
    optimizer,
    unmirrorable,
    untested_optimizer,
    zero,
)
from gaeq.audit.finding import Finding
from gaeq.audit.training import optimizer_settings, precision, schedule
from gaeq.problem.dsconfig import ConfigError, Mirror, mirror, split_config

if TYPE_CHECKING:
    from gaeq.matrix import Matrix

__all__ = ["CHECKS", "Finding", "audit", "deepspeed_configs", "exit_code", "overrides_of", "trains_with"]


def audit(config: dict[str, Any]) -> list[Finding]:
    """The findings for one DeepSpeed config (a mapping, as read from its file), in CHECKS' order."""
    m, findings = _mirrored(config)
    for check in CHECKS:
        findings += check(config, m)
    return findings


def _mirrored(config: dict[str, Any]) -> tuple[Mirror | None, list[Finding]]:
    """The config's torch mirror, or None and the finding that says why there is none."""
    from gaeq.runtime.dist import set_accelerator_env

    set_accelerator_env()  # before DeepSpeed's first import: say cpu rather than let it guess (and warn)
    try:
        return mirror(config), []
    except ConfigError as exc:
        return None, [unmirrorable(exc)]


CHECKS: tuple[Callable[[dict[str, Any], Mirror | None], Iterable[Finding]], ...] = (
    clipping,
    batch_keys,
    optimizer,
    optimizer_settings,
    schedule,
    precision,
    loss_scale,
    grad_accum_dtype,
    communication,
    untested_optimizer,
    zero,
)
"""What `audit` asks of a config, in the order its findings are listed. A new finding: a check here,
with the experiment cell that shows it (tests/unit/test_audit.py checks the cell exists)."""


def overrides_of(config: dict[str, Any], cells) -> list[str]:
    """One line per file value that gaeq replaces in some of `cells` (the split, ZeRO stage, offload): the values
    the splits run, then the reference's (its instruments run the reference's split)."""
    from gaeq.matrix import Role

    seen: dict[tuple, tuple[set, set, list]] = {}
    n_splits = 0
    for cell in cells:
        if cell.trainer != "deepspeed" or cell.skip_reason or cell.role not in (Role.CELL, Role.BASELINE):
            continue
        n_splits += cell.role is Role.CELL
        _, changed = split_config(config, cell)
        for o in changed:
            splits, reference, ids = seen.setdefault((o.key, repr(o.file_value), o.why), (set(), set(), []))
            (splits if cell.role is Role.CELL else reference).add(o.cell_value)
            ids += [cell.id] if cell.role is Role.CELL else []
    lines = []
    for (key, value, why), (splits, reference, ids) in seen.items():
        some = f"{len(ids)} of the {n_splits} splits (the others keep {value})" if len(ids) < n_splits else "the splits"
        said = [f"{_values(splits)} in {some}"] if splits else []
        said += [f"{_values(reference)} in the reference"] if reference else []
        lines.append(f"{key}: the file's {value} → {'; '.join(said)} ({why})")
    return lines


def _values(values: set) -> str:
    return ", ".join(map(str, sorted(values, key=lambda v: (isinstance(v, str), v))))


def trains_with(config: dict[str, Any]) -> list[Finding]:
    """What a config trains with that it does not seem to say: its schedule's and precision's risks (a run says
    them before it starts)."""
    m, _ = _mirrored(config)
    return [f for check in (schedule, precision) for f in check(config, m) if f.effect != "fine"]


def exit_code(findings: list[Finding]) -> int:
    return 1 if any(f.effect == "breaks" for f in findings) else 0


def deepspeed_configs(m: Matrix) -> list[tuple[str, dict, list]]:
    """(variant names, config, their cells) per distinct deepspeed_config of the matrix's problems."""
    distinct: list[tuple[list[str], dict, list]] = []
    for name, problem in m.problems.items():
        if problem.deepspeed_config is None:
            continue
        cells = [c for c in m.cells if c.variant == name]
        for names, config, group in distinct:
            if config == problem.deepspeed_config:
                names.append(name)
                group.extend(cells)
                break
        else:
            distinct.append(([name], problem.deepspeed_config, cells))
    return [(", ".join(names), config, cells) for names, config, cells in distinct]
