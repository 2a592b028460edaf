"""A reference that fits (gaeq/results/reference.py, the matrix's `baseline: auto`, `gaeq check --baseline`): chosen
from what ran, never from sizes; what would fit where it ran out of memory; the plan and the time left (no
process: outcomes are written as a run would leave them)."""

from __future__ import annotations

import shlex

import pytest
from rich.console import Console

from gaeq.matrix import MatrixError, Reference, Role, matrix_from_dict, with_references
from gaeq.matrix.check import Instruments, check_command, check_matrix
from gaeq.problem.script import Launcher
from gaeq.progress import RunProgress, plan_line
from gaeq.results.outcome import CellOutcome
from gaeq.results.reference import choose, what_fits
from gaeq.runtime.events import Event, EventKind
from tests.conftest import REPO

SCRIPT = REPO / "experiments" / "scripts" / "ddp_manual.py"
DONE = CellOutcome(status="done", seconds=1.0)
OOM = CellOutcome(
    status="error", seconds=1.0, reason="out of memory at micro batch 16 (world 1): …", out_of_memory=True
)
FAILED = CellOutcome(status="error", seconds=1.0, reason="the script exited with code 1")


def check(baseline=None, *, auto=False, instruments=Instruments.ALL) -> dict:
    return check_matrix(
        SCRIPT, script_args=["--batch_size", "{micro_batch_size}"], batch=16, splits=[(1, 4), (1, 8), (2, 4)],
        steps=3, launcher=Launcher.TORCHRUN, baseline="auto" if auto else baseline, instruments=instruments,
    )  # fmt: skip


def test_auto_takes_the_whole_batch_where_it_ran_and_else_ga_1_at_the_largest_micro_batch_that_ran():
    m = matrix_from_dict(check(auto=True))
    assert m.auto and m.baselines == {"fp32": "script-w1-mb16-ga1"}
    assert {c.role for c in m.cells} == {Role.BASELINE, Role.CELL}  # no instrument before its reference is chosen
    ran = {"script-w1-mb4-ga4": DONE, "script-w1-mb8-ga2": DONE, "script-w2-mb4-ga2": DONE}
    assert choose(m, ran | {"script-w1-mb16-ga1": DONE})["fp32"].world_size == 1  # it fits: nothing changes
    chosen = choose(m, ran | {"script-w1-mb16-ga1": OOM})["fp32"]
    assert (chosen.world_size, chosen.micro_batch_size) == (2, 8)
    assert "world 1 × micro 16, GA 1 ran out of memory; micro 8 is the largest" in chosen.why
    # micro 8 did not run either: the largest that did is 4, on 4 ranks
    smaller = choose(m, ran | {"script-w1-mb8-ga2": OOM, "script-w1-mb16-ga1": OOM})["fp32"]
    assert (smaller.world_size, smaller.micro_batch_size) == (4, 4)
    # controls: a reference that failed otherwise is not replaced, nor one whose splits all ran out of memory
    assert choose(m, ran | {"script-w1-mb16-ga1": FAILED}) == {}
    assert choose(m, {c: OOM for c in [*ran, "script-w1-mb16-ga1"]}) == {}

    rebased = with_references(m, {"fp32": chosen})
    assert rebased.baselines == {"fp32": "script-w2-mb8-ga1"} and rebased.references == {"fp32": chosen}
    assert rebased.floors["fp32"] == ("script-w2-mb8-ga1-floor0", "script-w2-mb8-ga1-floor1")
    assert rebased.sensitivities["fp32"] == "script-w2-mb8-ga1-weight1e-02"  # instruments on the chosen reference


def test_without_auto_the_reference_that_ran_out_of_memory_says_what_fits_and_the_command_that_asks_for_it():
    spec = check()
    m = matrix_from_dict(spec)
    outcomes = {"script-w1-mb16-ga1": OOM, "script-w1-mb8-ga2": DONE, "script-w1-mb4-ga4": DONE}
    words, fits = what_fits(m, outcomes, "fp32")
    assert (
        fits == (2, 8) and "`--baseline w2:mb8`" in words and "baseline: {world_size: 2, micro_batch_size: 8}" in words
    )
    assert what_fits(m, outcomes | {"script-w1-mb16-ga1": DONE}, "fp32") is None  # it fit: nothing to say
    words, fits = what_fits(m, {"script-w1-mb16-ga1": OOM, "script-w1-mb8-ga2": OOM}, "fp32")
    assert fits is None and "none fits" in words
    command = shlex.split(check_command(spec, baseline="w2:mb8"))
    assert command[:3] == ["gaeq", "check", str(SCRIPT)]
    assert command[command.index("--baseline") + 1] == "w2:mb8"
    assert command[command.index("--") + 1 :] == ["--batch_size", "{micro_batch_size}"]
    assert [command[i + 1] for i, w in enumerate(command) if w == "--split"] == ["w1:mb4", "w1:mb8", "w2:mb4"]
    assert "--instruments" not in command
    limited = shlex.split(check_command(check(instruments=Instruments.LIMIT), baseline="w2:mb8"))
    assert limited[limited.index("--instruments") + 1] == "limit"
    # the command it prints asks for the same matrix with that reference
    again = check(baseline=(2, 8))
    assert matrix_from_dict(again).baselines == {"fp32": "script-w2-mb8-ga1"}


def test_auto_and_a_split_are_not_both_given():
    with pytest.raises(MatrixError, match="auto chooses world_size and micro_batch_size"):
        matrix_from_dict(check() | {"baseline": {"auto": True, "world_size": 2}})
    assert matrix_from_dict(check() | {"baseline": {"auto": True}}).auto


def test_the_plan_says_the_runs_before_any_and_the_time_left_after_the_first():
    plain = plan_line(matrix_from_dict(check()))
    assert plain == "Plan: 7 runs of 3 steps each — 3 splits, 1 reference, 2 noise-floor twins, 1 detection limit"
    auto = plan_line(matrix_from_dict(check(auto=True, instruments=Instruments.NONE)))
    assert auto.startswith("Plan: 4 runs of 3 steps each — 3 splits, 1 reference (auto: world 1 with the whole batch")
    assert auto.endswith("0 noise-floor twins, 0 detection limits")
    one = check_matrix(SCRIPT, script_args=[], batch=16, splits=[(1, 16)], steps=1, launcher=Launcher.TORCHRUN,
                       baseline="none")  # fmt: skip
    assert plan_line(matrix_from_dict(one)) == (
        "Plan: 1 run of 1 step each — 1 split, 0 references, 0 noise-floor twins, 0 detection limits"
    )

    now = [0.0]
    bar = RunProgress(Console(file=open("/dev/null", "w")), cells=4, steps=3, clock=lambda: now[0])  # noqa: SIM115
    with bar:
        assert bar.left() == "cells"  # nothing ended: no guess
        now[0] = 10.0
        bar(Event(kind=EventKind.END, world_size=1, cell_id="a", outcome=DONE))
        assert bar.left() == "cells, about 30 s left"
        bar(Event(kind=EventKind.MORE, world_size=0, cells=3))  # auto's reference and its instruments
        assert bar.left() == "cells, about 60 s left"


def test_reference_words_in_the_report():
    from gaeq.results.report import references

    m = matrix_from_dict(check())
    said = references(m, {"script-w1-mb16-ga1": OOM, "script-w1-mb8-ga2": DONE})
    assert said["references"] == {"fp32": "world 1 × micro 16, GA 1"} and said["fits"] == {"fp32": (2, 8)}
    auto = with_references(
        matrix_from_dict(check(auto=True)),
        {"fp32": Reference(world_size=2, micro_batch_size=8, why="world 1 × micro 16 … ran")},
    )
    said = references(auto, {"script-w2-mb8-ga1": DONE})
    assert said["references"] == {"fp32": "world 2 × micro 8, GA 1"} and said["fits"] == {}
    assert said["reference_notes"] == {"fp32": "baseline auto: world 1 × micro 16 … ran"}


def test_a_float32_run_that_does_not_fit_is_skipped_beside_the_split_as_trained_and_only_there():
    """A bf16 script's float32 run (gaeq's, for fp32's sharpness) holds up to twice the bytes: where it ran out of
    memory and the same split as trained was judged, it is skipped, saying so. Controls: the float32 run of a split
    with no bf16 verdict, and a float32 cell that failed otherwise, stay errors."""
    from gaeq.results.cell_report import CellReport
    from gaeq.results.compare import Verdict
    from gaeq.results.reference import float32_that_does_not_fit

    spec = check() | {"axes": {"dtype": ["fp32", "bf16"], "world_size": [1], "micro_batch_size": [8, 4, 2]}}
    m = matrix_from_dict(spec)
    by_id = {c.id: c for c in m.cells}

    def judged(cell_id, verdict, outcome):
        return CellReport(cell=by_id[cell_id], verdict=verdict, reason=outcome.reason, outcome=outcome)

    cells = float32_that_does_not_fit([
        judged("script-w1-mb8-ga2", Verdict.ERROR, OOM),
        judged("script-w1-mb8-ga2-bf16", Verdict.MATCH, DONE),
        judged("script-w1-mb4-ga4", Verdict.ERROR, OOM),  # its bf16 split failed too: nothing stands
        judged("script-w1-mb4-ga4-bf16", Verdict.ERROR, OOM),
        judged("script-w1-mb2-ga8", Verdict.ERROR, FAILED),  # not out of memory
        judged("script-w1-mb2-ga8-bf16", Verdict.MATCH, DONE),
    ])  # fmt: skip
    said = {c.id: (c.verdict, c.reason) for c in cells}
    verdict, reason = said["script-w1-mb8-ga2"]
    assert verdict == Verdict.SKIPPED and reason.startswith(
        "the float32 run does not fit (out of memory at micro batch"
    )
    assert reason.endswith("twice a bf16 run's bytes — the split as trained stands: script-w1-mb8-ga2-bf16 match")
    assert said["script-w1-mb4-ga4"][0] == said["script-w1-mb2-ga8"][0] == Verdict.ERROR


def test_check_offers_a_reference_and_the_instruments_and_refuses_a_reference_written_otherwise():
    from typer.testing import CliRunner

    from gaeq.cli import app

    shown = CliRunner().invoke(app, ["check", "--help"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "--baseline" in shown.output and "--instruments" in shown.output
    refused = CliRunner().invoke(app, ["check", str(SCRIPT), "--batch", "16", "--split", "w1:mb8", "--baseline", "2x8"])
    assert refused.exit_code == 2 and "--baseline 2x8: write it as w<world size>:mb<micro batch>" in refused.output


def test_check_runs_each_dtype_asked_and_says_when_it_ran_a_script_made_float32():
    from gaeq.results.cell_report import CellReport
    from gaeq.results.compare import Verdict
    from gaeq.results.lines import precision_lines
    from gaeq.results.report import Report

    both = check_matrix(
        SCRIPT, script_args=[], batch=16, splits=[(1, 8)], steps=3, launcher=Launcher.TORCHRUN, dtypes=["fp32", "bf16"]
    )
    m = matrix_from_dict(both)
    assert sorted(m.baselines) == ["bf16", "fp32"] and "script-w1-mb8-ga2-bf16" in {c.id for c in m.cells}
    assert "--dtype fp32,bf16 --baseline w2:mb8" in check_command(both, baseline="w2:mb8")

    made_float32 = {"precision": {"dtype": "fp32", "switched_off": ["autocast bf16 (cpu)"]}}
    split = next(c for c in matrix_from_dict(check()).cells if c.id == "script-w1-mb8-ga2")
    cell = CellReport(
        cell=split,
        verdict=Verdict.MATCH,
        reason="",
        outcome=DONE.__class__(status="done", seconds=1.0, ran=made_float32),
    )
    said = precision_lines(Report(baselines={}, tolerances={}, cells=[cell]))
    assert said == [
        "Precision: the float32 run — gaeq switched off your script's autocast bf16 (cpu): the sharpest verdict; "
        "`--dtype fp32,bf16` (a matrix: `axes: {dtype: [fp32, bf16]}`) judges it as it trains too"
    ]
    as_it_is = CellReport(cell=split, verdict=Verdict.MATCH, reason="", outcome=DONE)  # control: nothing switched off
    assert precision_lines(Report(baselines={}, tolerances={}, cells=[as_it_is])) == []
