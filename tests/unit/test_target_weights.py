"""The weight every target gets, read from one run of one split (gaeq.script.targets), and what the weights say
(gaeq.script.objective): each weighting mistake of the catalogue named from its weights alone, with its fix;
every correct twin the step's target mean; what cannot be read said so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gaeq.script.objective import weighting
from gaeq.script.targets import TargetWeights

V = 40


def batches(lengths_per_rank: list[list[list[int]]], seed: int = 0) -> list[list[torch.Tensor]]:
    """Labels per rank and micro-batch: rows of 8 positions, the first `length` of each a target, the rest -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for micro_batches in lengths_per_rank:
        rank = []
        for lengths in micro_batches:
            y = torch.randint(0, V, (len(lengths), 8), generator=g)
            for i, n in enumerate(lengths):
                y[i, n:] = -100
            rank.append(y)
        out.append(rank)
    return out


def step_of(labels, loss_of, *, world: int) -> dict:
    """One training step: every rank's micro-batches through logits and `loss_of(logits, y, rank, k)`, read."""
    ranks = []
    for r, micro_batches in enumerate(labels):
        reader = TargetWeights()
        for k, y in enumerate(micro_batches):
            logits = torch.randn(*y.shape, V, requires_grad=True)
            reader.watch({"loss": None, "logits": logits})
            loss_of(logits, y, r, k).backward()
        ranks.append(reader.take())
    return {"step": 0, "world_size": world, "targets": ranks}


def ce(logits, y, reduction="sum", **kw):
    return F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-100, reduction=reduction, **kw)


# micro-batches of different target counts: a mean of means differs from the step's mean
LENGTHS = [[[3, 8], [5, 6]], [[8, 8], [2, 4]]]  # 2 ranks × GA 2: 11, 11 | 16, 6 targets
N = sum(sum(sum(b) for b in r) for r in LENGTHS)
GA, WORLD = 2, 2


@pytest.mark.parametrize(
    ("name", "loss_of", "shape", "words"),
    [
        ("the step's mean", lambda lo, y, r, k: ce(lo, y) / N * WORLD, "mean", "the step's target mean"),
        ("a mean of micro-batch means", lambda lo, y, r, k: ce(lo, y, "mean") / GA, "micro_batch_means",
         "a mean of micro-batch means — divide each micro-batch's summed loss by the step's target count"),
        ("× GA", lambda lo, y, r, k: ce(lo, y) / N * WORLD * GA, "scaled", "× GA (2)"),
    ],
)  # fmt: skip
def test_a_weighting_is_named_from_one_run_of_one_split(name, loss_of, shape, words):
    found = weighting([step_of(batches(LENGTHS), loss_of, world=WORLD)])
    assert found.shape == shape, (name, found)
    assert words in found.line, found.line


def test_a_token_count_per_rank_is_a_mean_of_rank_means():
    """Fabric's per-rank token count, TRL with `average_tokens_across_devices False`: each rank ÷ its own count."""
    lengths = [[[3, 8], [5, 6]], [[8, 8], [8, 4]]]  # 22 and 28 targets
    counts = [22, 28]
    found = weighting([step_of(batches(lengths), lambda lo, y, r, k: ce(lo, y) / counts[r], world=2)])
    assert found.shape == "rank_means" and "a mean of rank means" in found.line, found
    assert "average_tokens_across_devices" in found.fix


def test_a_short_window_still_divided_by_ga_sums_to_its_share():
    """Lightning#19987: the epoch's last window of 3 micro-batches still ÷ GA 4 — its weights sum to 3/4."""
    lengths = [[[4, 4], [4, 4], [4, 4]]]
    found = weighting([step_of(batches(lengths), lambda lo, y, r, k: ce(lo, y, "mean") / 4, world=1)])
    assert found.shape == "scaled" and "sum to 0.75" in found.line, found


def test_a_mean_of_per_sequence_means_is_said_as_one_and_a_loss_that_is_not_read_is_said_why():
    lengths = [[[3, 8, 5]]]
    per_sequence = weighting(
        [step_of(batches(lengths), lambda lo, y, r, k: sum(ce(lo[i], y[i], "mean") for i in range(3)) / 3, world=1)]
    )
    assert per_sequence.shape == "sequence_means" and "a mean of per-row means" in per_sequence.line
    reader = TargetWeights()
    logits = torch.randn(2, 8, V, requires_grad=True)
    reader.watch(logits)
    ce(logits, batches([[[8, 8]]])[0][0], "mean", label_smoothing=0.1).backward()
    smoothed = weighting([{"step": 0, "world_size": 1, "targets": [reader.take()]}], unread=reader.unread)
    assert smoothed.shape == "unread" and "label smoothing" in smoothed.line
    fused = TargetWeights()
    fused.watch(torch.zeros((), requires_grad=True))  # a model that returns its loss alone
    assert weighting([], unread=fused.unread).line.startswith("not read: the model's output holds no logits")


def test_a_loss_scale_is_taken_out_and_confident_targets_read_exactly():
    """GradScaler's scale divides out; targets predicted with p ≈ 1 still read to rounding (no 1 − p cancels)."""
    y = batches([[[8, 8]]])[0][0]
    reader = TargetWeights()
    reader.scale = 1024.0
    logits = torch.randn(2, 8, V)
    logits.scatter_(-1, y.unsqueeze(-1), 12.0)  # p[label] ≈ 0.9999
    logits.requires_grad_(True)
    reader.watch(logits)
    (ce(logits, y, "mean") * 1024.0).backward()
    found = weighting([{"step": 0, "world_size": 1, "targets": [reader.take()]}])
    assert found.shape == "mean", found


def test_no_reference_is_a_script_matrixs_splits_alone_each_judged_by_its_weights():
    """`baseline: none` (`gaeq check --baseline none`): no reference cell, no instruments; a split's verdict from its
    weights — match for the step's mean, diverge with the shape, error where nothing was read; with a reference,
    the weights stand beside the comparison, said against the reference's where they differ."""
    from gaeq.matrix import MatrixError, matrix_from_dict
    from gaeq.matrix.check import check_matrix
    from gaeq.results.compare import Verdict
    from gaeq.results.weighing import beside, judged_alone
    from gaeq.script.objective import Weighting
    from gaeq.script.spec import Launcher
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
    mean = Weighting(shape="mean", line="every target weighs 1/N")
    means = Weighting(shape="micro_batch_means", line="a mean of micro-batch means", step=0)
    assert judged_alone(mean)[0] == Verdict.MATCH and judged_alone(means)[0] == Verdict.DIVERGE
    unread = judged_alone(Weighting(shape="unread", line="not read: its logits are sharded"))
    assert unread[0] == Verdict.ERROR and "not read (its logits are sharded): nothing judges it" in unread[1]
    assert beside(means, mean).line.endswith("where the reference's weights read: every target weighs 1/N")
    assert beside(mean, mean) == mean
    per_row = Weighting(shape="sequence_means", line="a mean of per-row means", step=0)
    assert beside(per_row, per_row) == per_row  # weighed so on purpose, as its reference: not called wrong
    assert beside(Weighting(shape="unread", line="not read: x"), mean).line.endswith(
        "the comparison with the reference judges it"
    )


def test_trls_fused_forward_hands_per_token_log_probabilities_whose_gradient_is_the_weight():
    """TRL 1.16's SFT (`fused_lm_head=True`): the model returns `log_probs` [rows, positions], zero where ignored; its
    loss −Σ log p / N. Each target's weight is −the gradient there: the step's mean, or — per device — not."""
    lengths = [[[3, 8], [5, 2]]]  # 11 and 7 targets
    n = sum(sum(b) for b in lengths[0])

    def step(divide):
        reader = TargetWeights()
        for k, y in enumerate(batches(lengths)[0]):
            logits = torch.randn(*y.shape, V, requires_grad=True)
            log_probs = torch.where(y != -100, logits.log_softmax(-1).gather(-1, y.clamp_min(0)[..., None])[..., 0], 0)
            reader.watch({"log_probs": log_probs, "label_mask": y != -100})
            (-log_probs.sum() / divide(y)).backward()
        return weighting([{"step": 0, "world_size": 1, "targets": [reader.take()]}])

    assert step(lambda y: n).shape == "mean"
    assert step(lambda y: 2 * int((y != -100).sum())).shape == "micro_batch_means"
