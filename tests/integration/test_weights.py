"""A verdict without a reference (#68): `baseline: none` judges each split of a user's script by the weight its
targets got in one run of it (gaeq.script.targets, gaeq.objective.weighting). experiments/scripts/ddp_manual.py,
correct at world 1 and 2 and with a weighting mistake in each split: the correct ones `match`, the planted ones
`diverge` with the mistake named and its fix — no reference, no twins, nothing run twice."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run_here, not_ok

pytestmark = pytest.mark.integration


def test_with_no_reference_each_split_is_judged_by_its_targets_weights_and_a_mistake_is_named(tmp_path):
    spec = yaml.safe_load((REPO / "experiments" / "your_script.yaml").read_text())
    spec["script"]["path"] = str(REPO / "experiments" / "scripts" / "ddp_manual.py")
    spec |= {
        "steps": 2,
        "train_batch_size": 16,
        "baseline": "none",
        "axes": {"world_size": [1, 2], "micro_batch_size": [4]},
    }
    planted = [("mean_of_means", 1), ("mean_of_means", 2), ("no_loss_division", 1), ("token_count_averaged_twice", 2)]
    spec["cells"] = [
        {"world_size": w, "micro_batch_size": 4, "args": ["--bug", bug], "expect": "diverge"} for bug, w in planted
    ]
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(tmp_path / "m.yaml", tmp_path / "run")
    assert proc.returncode == 0, proc.stdout[-4000:]
    cells = cells_by_id(report)
    assert set(cells) == {"script-w1-mb4-ga4", "script-w2-mb4-ga2"} | {
        f"script-w{w}-mb4-ga{4 // w}-args_bug_{bug}" for bug, w in planted
    }  # no reference, no instrument: only the splits ran
    assert report["baseline"] is None and report["references"] == {
        "fp32": "no reference (each split judged by its targets' weights alone)"
    }
    for clean in ("script-w1-mb4-ga4", "script-w2-mb4-ga2"):
        assert cells[clean]["verdict"] == "match" and cells[clean]["weights"]["shape"] == "mean", cells[clean]
        assert cells[clean]["reason"].startswith("judged by its targets' weights alone (no reference")
    named = {i: (c["verdict"], c["weights"]["shape"]) for i, c in cells.items() if "args_bug" in i}
    assert named == {
        "script-w1-mb4-ga4-args_bug_mean_of_means": ("diverge", "micro_batch_means"),
        "script-w2-mb4-ga2-args_bug_mean_of_means": ("diverge", "micro_batch_means"),
        "script-w1-mb4-ga4-args_bug_no_loss_division": ("diverge", "micro_batch_means"),
        "script-w2-mb4-ga2-args_bug_token_count_averaged_twice": ("diverge", "scaled"),
    }
    said = cells["script-w1-mb4-ga4-args_bug_mean_of_means"]["reason"]
    assert "a mean of micro-batch means (read to ±8e-06 of each weight" in said
    assert said.endswith("— divide each micro-batch's summed loss by the step's target count, not by its own")
    assert "not ÷ GA" in cells["script-w1-mb4-ga4-args_bug_no_loss_division"]["weights"]["line"]
    both = "Weights: every target weighs 1/N, the step's target mean, in script-w1-mb4-ga4, script-w2-mb4-ga2"
    assert both in proc.stdout and both in (tmp_path / "run" / "report.md").read_text()


# experiments/loss_styles.yaml: losses that weigh their targets on purpose, and their mistakes (#73)
STYLES = REPO / "experiments" / "loss_styles.yaml"


def loss_styles(out, spec: dict | None = None) -> tuple:
    """A run of the experiment, or of `spec` (its matrix changed)."""
    spec = spec or yaml.safe_load(STYLES.read_text())
    spec["script"]["path"] = str(REPO / "experiments" / spec["script"]["path"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "m.yaml").write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(out / "m.yaml", out / "run")
    return proc, report


@pytest.fixture(scope="module")
def unreferenced(tmp_path_factory):
    """The experiment as it is: no reference, every split beside the other splits of its style."""
    return loss_styles(tmp_path_factory.mktemp("loss_styles"))


SHAPES = {"sequences": "sequence_means", "rescale": "mean", "sum": "scaled", "smoothing": "mean"}
SAID = {
    "sequences": "a mean of per-row means over the step's rows — a per-sequence objective",
    "rescale": "the step's target mean, in every step read — with the gradients ÷ ",
    "sum": "every target weighs 1 in every step read: a summed loss — its size is the learning rate's",
    "smoothing": "— a cross-entropy with label smoothing ε = 0.1",
}


def test_every_style_that_weighs_on_purpose_matches_in_every_split_with_no_reference_its_shape_said(unreferenced):
    """A per-sequence mean, Megatron-LM's ÷ the step's tokens after the backward, a summed loss, label smoothing: at
    world 1 and 2, GA 1 to 8, each split's weights are the other splits' — match, the shape said, no fix offered."""
    proc, report = unreferenced
    assert proc.returncode == 0, not_ok(proc, report)
    assert "(each cell's curves: with no reference, there is no difference to draw)" in proc.stdout
    cells = cells_by_id(report)
    for style, shape in SHAPES.items():
        mine = [c for i, c in cells.items() if i.endswith(f"args_loss_{style}")]
        assert len(mine) >= 2, style
        for c in mine:
            assert (c["verdict"], c["weights"]["shape"], c["weights"]["kind"]) == ("match", shape, "step"), c
            assert c["weights"]["fix"] is None and SAID[style] in c["weights"]["line"], c["weights"]
            assert c["reason"].startswith(
                "judged by its targets' weights alone (no reference: a check of the objective's weighting, not of the "
                "optimizer, the data or the schedule): the same weights as script-"
            ), c["reason"]


MISTAKES = {
    "count_from_one_micro_batch": ("scaled", "— a count from one part of the step"),
    "sequences_per_micro_batch": ("row_means_by_group", "per-row means averaged within each micro-batch"),
    "mean_of_means": ("micro_batch_means", "a mean of micro-batch means"),
}


def test_each_mistake_in_every_split_diverges_beyond_the_whole_batch_named_in_float32_and_in_bf16(unreferenced):
    """GA × one micro-batch's count, per-row means ÷ GA with a micro-batch the short step leaves unfilled, a mean of
    micro-batch means over micro-batches of nearly one size: right where the whole batch is one micro-batch (or, for
    the per-row means, where every micro-batch is full), tied to the split everywhere else — in fp32 and as trained
    in bf16, whose weights are read at the loss's float32 cast."""
    _, report = unreferenced
    cells = cells_by_id(report)
    for bug, (shape, words) in MISTAKES.items():
        mine = {i: c for i, c in cells.items() if f"bug_{bug}" in i}
        assert {c["dtype"] for c in mine.values()} == {"fp32", "bf16"}, bug
        for i, c in mine.items():
            whole = c["grad_accum_steps"] == 1 and (c["world_size"] == 1 or bug == "sequences_per_micro_batch")
            if whole:
                assert c["verdict"] == "match", c
                continue
            assert (c["verdict"], c["weights"]["shape"], c["weights"]["kind"]) == ("diverge", shape, "split"), c
            assert words in c["weights"]["line"] and c["weights"]["fix"], c["weights"]
            read = "float32 at the loss's cast" if c["dtype"] == "bf16" else "float32 gradients at the model's output"
            assert f"(read to ±8e-06 of each weight: {read})" in c["weights"]["line"], c["weights"]


@pytest.mark.parametrize(
    ("style", "args", "cells"),
    [
        ("rescale", ["--loss", "rescale"], [[], ["--bug", "count_from_one_micro_batch"]]),
        ("sequences", ["--loss", "sequences"], [[], ["--bug", "sequences_per_micro_batch"]]),
        ("sum", ["--loss", "sum"], [[]]),
        ("smoothing", ["--loss", "smoothing"], [[]]),
        ("bf16", ["--amp", "bf16", "--min_len", "20"], [["--bug", "mean_of_means"]]),
    ],
)
def test_against_the_whole_batch_each_style_matches_with_no_fix_and_each_mistake_diverges_named(
    tmp_path, style, args, cells
):
    """The reference at world 1 × micro 16 runs the same style: the split at world 2 × micro 4 matches it, and its
    `Weights:` line offers no fix (a correct script is never asked to change); the mistake diverges, its shape and fix
    named beside the numbers."""
    spec = yaml.safe_load(STYLES.read_text())
    del spec["baseline"]  # the default: world 1, the whole batch in one micro-batch
    spec["script"]["args"] += args
    split = {"world_size": 2, "micro_batch_size": 4, "dtype": "bf16" if style == "bf16" else "fp32"}
    spec |= {"noise_floor": False, "detection_limit": False}
    spec["cells"] = [split | ({"args": a, "expect": "diverge"} if a else {}) for a in cells]
    proc, report = loss_styles(tmp_path, spec)
    assert proc.returncode == 0, not_ok(proc, report)
    said = cells_by_id(report)
    for c in said.values():
        bug = next((b for b in MISTAKES if f"bug_{b}" in c["id"]), None)
        if bug is None:
            assert c["verdict"] == "match" and c["weights"]["kind"] == "step" and c["weights"]["fix"] is None, c
            continue
        assert c["verdict"] == "diverge" and c["weights"]["shape"] == MISTAKES[bug][0], c
        assert c["divergence_steps"]["weights"] is not None and MISTAKES[bug][1] in c["weights"]["line"], c


def test_a_split_that_agrees_with_a_reference_tied_to_its_own_split_is_no_match(tmp_path):
    """A mean of micro-batch means in every split, the reference named: world 2 × micro 4, GA 1 — each rank one
    micro-batch, itself a mean of rank means. The split at world 1 × micro 4, GA 2 holds the very micro-batches the
    reference's ranks hold, so its numbers agree with the reference's; its own weights are tied to its split: it
    diverges, caught by its weights, the loss still matching — and the Reference line says the reference's own."""
    spec = yaml.safe_load(STYLES.read_text())
    del spec["baseline"]
    spec["script"]["args"] += ["--bug", "mean_of_means"]
    spec |= {"train_batch_size": 8, "steps": 2, "noise_floor": False, "detection_limit": False}
    spec |= {"baseline": {"world_size": 2, "micro_batch_size": 4}}
    expect = {"verdict": "diverge", "caught_by": "weights", "step": 0, "holds": ["loss", "grad_norm"]}
    spec["cells"] = [{"world_size": 1, "micro_batch_size": 4, "expect": expect}]
    proc, report = loss_styles(tmp_path, spec)
    assert proc.returncode == 0, not_ok(proc, report)
    split = cells_by_id(report)["script-w1-mb4-ga2"]
    assert split["as_expected"] and split["reason"].startswith("its targets' weights are tied to its split"), split
    assert "the reference's too (a mean of rank means (tied to its split)): it shares the mistake" in split["reason"]
    assert split["reason"].endswith("(the loss still matches)") and split["margin"] < 1, split
    note = report["reference_notes"]["fp32"]
    assert note == (
        "its own targets' weights are tied to its split: a mean of rank means (its `Weights:` line) — a split that "
        "agrees with it is judged by its own weights too"
    )
