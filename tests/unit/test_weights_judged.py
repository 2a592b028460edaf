"""What the targets' weights say of a verdict (gaeq.objective.invariance, gaeq.results.weighing): with no
reference, each split beside the other splits of its script — the same weights in every split match, a split that
changes them diverges, the whole batch in one micro-batch settles which; with a reference, a split whose own weights
are tied to its split diverges even where it agrees with the reference, and the reference's own weights are said."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gaeq.objective.invariance import Difference, compare
from gaeq.objective.weighting import Weighting, weighting
from gaeq.results.compare import Verdict
from gaeq.results.weighing import check, judged_alone, reference_note
from gaeq.script.targets import TargetWeights

V = 40
LENGTHS = [3, 8, 5, 6, 8, 8, 7, 4]  # the step's 8 rows' targets (of 8 positions): 22 in the first 4, 27 in the rest


def labels(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (len(LENGTHS), 8), generator=g)
    for i, n in enumerate(LENGTHS):
        y[i, n:] = -100
    return y


def ce(logits, y, reduction="sum"):
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=-100, reduction=reduction)


def split_run(world: int, micro: int, loss_of, *, clip: float = 1.0, edited: float = 1.0, steps: int = 2) -> Weighting:
    """`steps` steps of the 8 rows on `world` ranks of micro-batches of `micro` rows (a contiguous share per rank,
    as Megatron-LM's sampler deals them), each row keyed by its index; `loss_of(logits, y, n, rows, world, ga)`;
    each rank's gradients × `clip` by a clip call, × `edited` in place by none (a clip or a rescale by hand)."""
    y, n, ga = labels(), sum(LENGTHS), len(LENGTHS) // (world * micro)
    records = []
    for step in range(steps):
        ranks = []
        for r in range(world):
            reader = TargetWeights()
            mine = list(range(r * micro * ga, (r + 1) * micro * ga))
            keys = []
            for k in range(ga):
                rows = mine[k * micro : (k + 1) * micro]
                logits = torch.randn(len(rows), 8, V, generator=torch.Generator().manual_seed(step * 100 + rows[0]))
                logits = logits.requires_grad_()
                reader.watch(logits)
                loss_of(logits, y[rows], n, len(LENGTHS), world, ga).backward()
                keys.append([str(i) for i in rows])
            ranks.append(reader.take(keys))
        said = {"factor": edited * clip} | ({"before_clip": {"factor": edited}} if clip != 1.0 else {})
        rescale = [[said] for _ in range(world)]
        records.append({"step": step, "world_size": world, "targets": ranks, "rescale": rescale})
    return weighting(records, grad_accum=ga)


def tokens(lo, y, n, rows, world, ga):
    return ce(lo, y) / n * world


def micro_batch_means(lo, y, n, rows, world, ga):
    return ce(lo, y, "mean") / ga


def a_factor_per_split(lo, y, n, rows, world, ga):  # × 1.5 at GA 2: no quantity gaeq names, and of the split
    return ce(lo, y) / n * world * (1.5 if ga == 2 else 1.0)


def cells(*splits: tuple[int, int]):
    from gaeq.matrix import matrix_from_dict
    from gaeq.matrix.check import check_matrix
    from gaeq.problem.script import Launcher
    from tests.conftest import REPO

    script = REPO / "experiments" / "scripts" / "loss_styles.py"
    spec = check_matrix(script, script_args=[], batch=8, splits=list(splits), steps=2, launcher=Launcher.TORCHRUN,
                        baseline="none")  # fmt: skip
    return {(c.world_size, c.micro_batch_size): c for c in matrix_from_dict(spec).cells}


def test_with_no_reference_the_same_weights_in_every_split_match_and_a_split_that_changes_them_diverges():
    split = cells((1, 8), (1, 4), (2, 4), (2, 2))
    right = {s: split_run(*s, tokens) for s in split}
    for s, own in right.items():
        verdict, why = judged_alone(split[s], own, [(split[o], right[o]) for o in split if o != s])
        assert verdict == Verdict.MATCH and "the same weights as" in why and "the step's target mean" in why, why
    wrong = {s: split_run(*s, micro_batch_means) for s in split}
    said = {s: judged_alone(split[s], wrong[s], [(split[o], wrong[o]) for o in split if o != s]) for s in split}
    assert said[1, 8][0] == Verdict.MATCH and "script-w1-mb8-ga1" not in said[1, 8][1]  # the whole batch: no mistake
    for s in ((1, 4), (2, 4), (2, 2)):  # GA > 1 or world > 1: tied to the split, named, with its fix
        assert said[s][0] == Verdict.DIVERGE and "a mean of micro-batch means" in said[s][1], said[s]
    assert "(each rank one micro-batch: a mean of micro-batch means too)" in said[2, 4][1]


def test_splits_whose_weights_differ_in_no_shape_gaeq_ties_to_a_split_are_settled_by_the_whole_batch():
    """× 1.5 at GA 2 alone: each split's weights are alike (a factor per step), yet the splits differ — the split
    that holds the whole batch in one micro-batch matches, the one that differs from it diverges, said by how much;
    without that split, both diverge."""
    split = cells((1, 8), (1, 4), (2, 4))
    runs = {s: split_run(*s, a_factor_per_split) for s in split}
    found = compare(runs[1, 4], runs[1, 8])
    assert isinstance(found, Difference) and found.step == 0 and found.by == pytest.approx(1 / 3, rel=1e-4)
    said = {s: judged_alone(split[s], runs[s], [(split[o], runs[o]) for o in split if o != s]) for s in split}
    assert said[1, 8][0] == said[2, 4][0] == Verdict.MATCH, said
    assert said[1, 4][0] == Verdict.DIVERGE, said
    assert "its weights differ from script-w1-mb8-ga1's by 3.3e-01 in their total" in said[1, 4][1]
    pair = {s: judged_alone(split[s], runs[s], [(split[o], runs[o]) for o in ((1, 4), (2, 4)) if o != s])
            for s in ((1, 4), (2, 4))}  # fmt: skip
    assert {v for v, _ in pair.values()} == {Verdict.DIVERGE}, pair
    alone = judged_alone(split[1, 4], runs[1, 4], [])  # one split: of the step's rows alone, as far as it shows
    assert alone[0] == Verdict.MATCH, alone


def test_a_clip_by_hand_compares_as_clip_grad_norm_does_and_a_scale_apart_is_seen_where_nothing_edits_in_place():
    """A clip written by hand changes the gradients after the last backward by no call gaeq patches: that factor
    may be a clip or a rescale, so where a run has one, its weights' shape is compared and not their total (a clip
    call's factor is never counted). Where neither run has one, a total apart is a weighting (÷ world)."""
    by_call, by_hand = split_run(1, 4, tokens, clip=0.5), split_run(2, 4, tokens, edited=0.5)
    assert compare(by_call, by_hand) is None and compare(by_hand, by_call) is None
    halved = split_run(2, 4, lambda lo, y, n, rows, world, ga: ce(lo, y) / n)  # ÷ world: DDP averages once more
    found = compare(halved, by_call)
    assert isinstance(found, Difference) and found.scale and found.by == pytest.approx(0.5, rel=1e-5), found
    assert "in their total (every target × another factor) at step 0" in found.words()
    assert compare(split_run(2, 4, tokens, edited=0.5), halved) is None  # edited: its total is not compared


def test_with_a_reference_a_split_tied_to_its_split_diverges_even_where_it_agrees_and_the_reference_is_judged():
    """The reference at world 2 × micro 4, GA 1 and the split at world 1, GA 2 hold the same micro-batches: a mean of
    micro-batch means gives both the same weights — the numbers agree — yet the split's are tied to it (and so are
    the reference's, said on its line); a correct split against a correct reference: no finding."""
    reference, split = split_run(2, 4, micro_batch_means), split_run(1, 4, micro_batch_means)
    assert compare(split, reference) is None  # the same weights: the comparison of numbers would match
    found = check(split, reference)["weights"]
    assert found[0] == 0 and found[1].startswith("its targets' weights are tied to its split: targets weigh 1/(GA")
    assert "the reference's too (a mean of rank means (tied to its split)): it shares the mistake" in found[1]
    note = reference_note(reference)
    assert note.startswith("its own targets' weights are tied to its split: a mean of rank means (its `Weights:`")
    assert check(split_run(1, 4, tokens), split_run(1, 8, tokens)) == {"weights": None}
    assert reference_note(split_run(1, 8, tokens)) is None
    apart = check(split_run(1, 4, a_factor_per_split), split_run(1, 8, a_factor_per_split))["weights"]
    assert apart[1].startswith(
        "its targets' weights differ from the reference's by 3.3e-01 in their total (every target × another"
    )


def test_no_reference_is_a_script_matrixs_splits_alone_and_what_is_not_read_is_no_verdict():
    """`baseline: none` (`gaeq check --baseline none`): no reference cell, no instruments; a split whose weights were
    not read is an error, said why."""
    from gaeq.matrix import MatrixError, matrix_from_dict
    from gaeq.matrix.check import check_matrix
    from gaeq.problem.script import Launcher
    from tests.conftest import REPO
    from tests.helpers import small_spec

    script = REPO / "experiments" / "scripts" / "ddp_manual.py"
    spec = check_matrix(
        script, script_args=[], batch=16, splits=[(1, 4), (2, 4)], steps=2, launcher=Launcher.TORCHRUN, baseline="none"
    )
    m = matrix_from_dict(spec)
    assert m.baselines == {} and m.unreferenced == ("fp32",)
    assert [c.id for c in m.cells] == ["script-w1-mb4-ga4", "script-w2-mb4-ga2"]  # the splits alone
    with pytest.raises(MatrixError, match="baseline: none judges a script's splits"):
        matrix_from_dict(small_spec() | {"baseline": "none"})
    with pytest.raises(MatrixError, match="none is no reference"):
        matrix_from_dict(spec | {"baseline": {"none": True, "world_size": 2}})
    unread = judged_alone(m.cells[0], weighting([], unread="its logits are sharded"), [])
    assert unread[0] == Verdict.UNJUDGED and "not read (its logits are sharded): nothing judges it" in unread[1]
