"""What a report says in lines, beside its tables: the versions it certifies, each group's reference, noise
floor and detection limit, the instruments a matrix turned off, and a mixed-precision run beside its float32 run
(the terminal and report.md print the same lines)."""

from __future__ import annotations

from collections import Counter

from gaeq.matrix import BASE, Role, group_key
from gaeq.objective.shapes import Shape
from gaeq.registry import TRAINERS
from gaeq.results.compare import Verdict
from gaeq.results.reference import MIXED, same_split
from gaeq.results.report import CellReport, Report


def caught(c: CellReport) -> str:
    """Every metric that diverged, first one first: `grad_norm@0 loss@1`."""
    steps = {m: s for m, s in (c.divergence_steps or {}).items() if s is not None}
    return " ".join(f"{m}@{s}" for m, s in sorted(steps.items(), key=lambda kv: (kv[1], kv[0] != c.caught_by))) or "-"


def versions_line(report: Report) -> str:
    """The libraries the verdicts certify, e.g. `Versions: torch 2.13.0, deepspeed 0.19.8`."""
    return "Versions: " + ", ".join(f"{name} {version}" for name, version in report.versions.items())


def weights_lines(report: Report) -> list[str]:
    """Each split's targets' weights in words (gaeq.objective.weighting): `Weights: <cell>: every target weighs 1/N
    ± 3e-07 …: the step's target mean` — where they were read, and for a script's also why not (a cell of gaeq's
    own trainers on a regression has none to read); the instruments' left out (they plant or nudge)."""
    said = [
        c
        for c in report.cells
        if c.weights
        and c.cell.role in (Role.CELL, Role.BASELINE)
        and (c.weights["shape"] != Shape.UNREAD or TRAINERS[c.trainer].script)
    ]
    means = [c.id for c in said if c.weights["shape"] == Shape.MEAN]
    alike: dict[str, list[str]] = {}  # splits whose weights read the same in words: one line, their ids in it
    for c in said:
        if c.weights["shape"] != Shape.MEAN or len(means) < 2:
            alike.setdefault(c.weights["line"], []).append(c.id)
    lines = [f"Weights: {', '.join(ids)}: {line}" for line, ids in alike.items()]
    if len(means) > 1:  # one line for the splits that are right, their ids in it
        return [f"Weights: every target weighs 1/N, the step's target mean, in {', '.join(means)}", *lines]
    return lines


def reference_lines(report: Report) -> list[str]:
    """What each group's verdicts are relative to (gaeq.results.reference): its reference in words, how
    `baseline: auto` chose it, or the reference that would fit where it ran out of memory."""
    notes = report.reference_notes
    return [
        f"Reference {group}: {words}" + (f" — {notes[group]}" if group in notes else "")
        for group, words in report.references.items()
    ]


def floor_lines(report: Report) -> list[str]:
    """What each group's noise floor was (gaeq.results.floor): the twins, how far rounding alone moved
    them, what that allowed — and the smallest error the run would have caught. `margin` in the tables
    is each cell's share of its tolerance."""
    lines = []
    for group, floor in report.floors.items():
        f = floor.summary()
        if f["max_abs_loss_diff"] == 0 and f["max_rel_grad_norm_diff"] == 0:  # nothing measured, said as such
            lines.append(
                f"Noise floor {group}: its {len(f['twins'])} twin(s) did not move (0 in every step): no floor was "
                "measured — the tolerances are the dtype's constants"
            )
            continue
        lines.append(
            f"Noise floor {group}: {len(f['twins'])} nudged twin(s) of the baseline drifted max |Δloss| "
            f"{f['max_abs_loss_diff']:.1e}, max rel Δ‖g‖ {f['max_rel_grad_norm_diff']:.1e} by rounding alone; "
            f"tolerances are {f['factor']:g}× that where it is larger than the constants "
            f"(at most {f['ceiling']:g}× them)"
        )
    lines += [
        f"Noise floor {group}: {'warning' if group in report.floors else 'none'} — {why}"
        for group, why in report.floor_notes.items()
    ]
    lines += [f"Detection limit {group}: {limit.describe()}" for group, limit in report.detection_limits.items()]
    lines += [f"{instrument.capitalize()}: {why}" for instrument, why in report.instruments_off.items()]
    return lines + report.untested + precision_lines(report)


def precision_lines(report: Report) -> list[str]:
    """Where a matrix runs the same splits in fp32 and in a mixed precision — a script as it trains beside
    the script made float32, or gaeq's own bf16 cells beside fp32 ones —: each run's verdicts and detection
    limit side by side (the accumulation is the same arithmetic; only its rounding differs), the cells
    one run caught and the other did not, and those only the weights caught as trained."""
    groups: dict[tuple[str, str], list[CellReport]] = {}
    for c in report.cells:
        if c.cell.role is Role.CELL:
            groups.setdefault((c.variant, c.dtype), []).append(c)
    lines = []
    for (variant, dtype), cells in groups.items():  # a script made float32, with no run as it trains beside it
        switched = sorted({s for c in cells for s in ((c.ran or {}).get("precision") or {}).get("switched_off", [])})
        if dtype == "fp32" and switched and not any(v == variant and d in MIXED for v, d in groups):
            lines.append(
                f"Precision{'' if variant == BASE else f' @{variant}'}: the float32 run — gaeq switched off your "
                f"script's {', '.join(switched)}: the sharpest verdict; `--dtype fp32,bf16` (a matrix: `axes: "
                "{dtype: [fp32, bf16]}`) judges it as it trains too"
            )
    for (variant, dtype), mixed in groups.items():
        exact = groups.get((variant, "fp32"))
        if dtype not in MIXED or not exact:
            continue

        def said(label: str, group: str, cells: list[CellReport]) -> str:
            counts = Counter(c.verdict for c in cells)
            limit = report.detection_limits.get(group)
            detects = f", detects δ ≥ {limit.limit:.1e}" if limit else ""
            return f"{label}: " + ", ".join(f"{counts[v]} {v}" for v in Verdict if counts[v]) + detects

        fp32_group, mixed_group = (group_key(dtype=d, variant=variant) for d in ("fp32", dtype))
        lines.append(
            f"Precision{'' if variant == BASE else f' @{variant}'}: "
            + said("accumulation (float32)", fp32_group, exact)
            + "; "
            + said(f"as trained ({dtype})", mixed_group, mixed)
        )
        as_trained = {same_split(c): c for c in mixed}
        for c in exact:
            other = as_trained.get(same_split(c))
            if other is not None and c.verdict == Verdict.DIVERGE and other.verdict == Verdict.MATCH:
                lines.append(
                    f"  {c.id}: caught by the float32 run ({caught(c)}), not as trained in {dtype} "
                    f"({other.id}: match, margin {other.margin:.2f})"
                )
            elif other is not None and c.verdict == Verdict.MATCH and other.verdict == Verdict.DIVERGE:
                lines.append(f"  {other.id}: diverges as trained in {dtype} ({caught(other)}), not in float32")
            elif other is not None and other.caught_by == "weights" != c.caught_by and c.verdict == Verdict.DIVERGE:
                lines.append(
                    f"  {c.id}: caught by the float32 run ({caught(c)}); as trained in {dtype} by its targets' weights "
                    f"alone ({other.id}: {caught(other)}, its numbers within tolerance, margin {other.margin:.2f})"
                )
    return lines
