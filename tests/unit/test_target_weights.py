"""The weight every target gets, read from one run of one split (gaeq.script.targets), and what the weights say
(gaeq.objective.weighting): each weighting mistake of the catalogue named from its weights alone, with its fix, and
tied to the split; every correct style of the step's rows alone, with no fix; what cannot be read, or not finely
enough, said so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gaeq.objective.shapes import Kind
from gaeq.objective.weighting import weighting
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


def step_of(labels, loss_of, *, world: int, keys: bool = False) -> dict:
    """One training step: every rank's micro-batches through logits and `loss_of(logits, y, rank, k)`, read (each
    row keyed by its rank, micro-batch and place where `keys`)."""
    ranks = []
    for r, micro_batches in enumerate(labels):
        reader = TargetWeights()
        for k, y in enumerate(micro_batches):
            logits = torch.randn(*y.shape, V, requires_grad=True)
            reader.watch({"loss": None, "logits": logits})
            loss_of(logits, y, r, k).backward()
        ranks.append(reader.take([[f"{r}.{k}.{i}" for i in range(len(y))] for k, y in enumerate(micro_batches)]))
    return {"step": 0, "world_size": world, "targets": ranks}


def ce(logits, y, reduction="sum", **kw):
    return F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-100, reduction=reduction, **kw)


def read_one(loss, logits) -> tuple:
    """A weighting of one forward whose `loss(logits)` is backpropagated; and the reader's `unread`. The logits are
    made a model's output (no leaf: an op made them), of their dtype."""
    logits = torch.randn(logits.shape).requires_grad_().to(logits.dtype) * 1
    reader = TargetWeights()
    reader.watch(logits)
    out = loss(logits)
    reader.before_backward(out)
    out.backward()
    return weighting([{"step": 0, "world_size": 1, "targets": [reader.take()]}], unread=reader.unread), reader.unread


# micro-batches of different target counts: a mean of means differs from the step's mean
LENGTHS = [[[3, 8], [5, 6]], [[8, 8], [2, 4]]]  # 2 ranks × GA 2: 11, 11 | 16, 6 targets
N = sum(sum(sum(b) for b in r) for r in LENGTHS)
GA, WORLD = 2, 2


@pytest.mark.parametrize(
    ("name", "loss_of", "shape", "kind", "words"),
    [
        ("the step's mean", lambda lo, y, r, k: ce(lo, y) / N * WORLD, "mean", "step", "the step's target mean"),
        ("a mean of micro-batch means", lambda lo, y, r, k: ce(lo, y, "mean") / GA, "micro_batch_means", "split",
         "a mean of micro-batch means"),
        ("× GA", lambda lo, y, r, k: ce(lo, y) / N * WORLD * GA, "scaled", "split", "× GA (2)"),
        ("÷ world", lambda lo, y, r, k: ce(lo, y) / N, "scaled", "split", "÷ world (2)"),
        ("a summed loss", lambda lo, y, r, k: ce(lo, y) * WORLD, "scaled", "step", "every target weighs 1"),
    ],
)  # fmt: skip
def test_a_weighting_is_named_from_one_run_of_one_split_and_said_tied_to_the_split_or_not(
    name, loss_of, shape, kind, words
):
    found = weighting([step_of(batches(LENGTHS), loss_of, world=WORLD)])
    assert (found.shape, found.kind) == (shape, kind), (name, found)
    assert words in found.line
    assert "(read to ±8e-06 of each weight: float32 gradients at the model's output)" in found.line
    assert (found.fix is not None) == (kind == Kind.SPLIT), found  # a fix only where the split changes the weights
    if shape == "micro_batch_means":
        assert found.fix == "divide each micro-batch's summed loss by the step's target count, not by its own"


def test_a_token_count_per_rank_is_a_mean_of_rank_means_and_one_from_a_micro_batch_is_named():
    """Fabric's per-rank token count, TRL with `average_tokens_across_devices False`: each rank ÷ its own count; a
    count estimated as GA × the first micro-batch's (Megatron-LM's style with an estimate): alike, but tied."""
    lengths = [[[3, 8], [5, 6]], [[8, 8], [8, 4]]]  # 22 and 28 targets
    counts = [22, 28]
    found = weighting([step_of(batches(lengths), lambda lo, y, r, k: ce(lo, y) / counts[r], world=2)])
    assert found.shape == "rank_means" and "a mean of rank means" in found.line, found
    assert found.fix == "count the step's targets over every rank (an all-reduce) before dividing"  # no Trainer name
    first = 3 + 8 + 8 + 8  # micro-step 0's targets over both ranks
    found = weighting([step_of(batches(lengths), lambda lo, y, r, k: ce(lo, y) / (GA * first) * 2, world=2)])
    assert (found.shape, found.kind) == ("scaled", "split"), found
    assert f"every target ÷ {GA * first}, micro-step 0's targets × GA (2) — a count from one part" in found.line


def test_a_short_window_still_divided_by_ga_is_tied_where_the_split_is_known():
    """Lightning#19987: the epoch's last window of 3 micro-batches still ÷ GA 4 — its weights sum to 3/4: a factor
    of the step alone, unless the split says GA 4."""
    lengths = [[[4, 4], [4, 4], [4, 4]]]
    step = step_of(batches(lengths), lambda lo, y, r, k: ce(lo, y, "mean") / 4, world=1)
    alone = weighting([step])
    assert (alone.shape, alone.kind) == ("scaled", "step") and "summing to 0.75" in alone.line, alone
    tied = weighting([step], grad_accum=4)
    assert (tied.shape, tied.kind) == ("scaled", "split"), tied
    assert "sum to 0.75 at step 0, not 1: the loss × 0.75 — a step of 3 micro-batches still ÷ GA (4)" in tied.line


def test_per_sequence_means_are_of_the_step_and_their_mistake_by_micro_batch_is_tied():
    """GRPO's normalisation: each row's mean over its targets, averaged over the step's rows — of the step alone;
    each micro-batch's own mean of row means ÷ GA, where micro-batches hold 3 and 1 rows — tied."""
    lengths = [[[3, 8, 5], [6]]]

    def per_row(lo, y):
        return ce(lo, y, "none").view(y.shape).sum(1) / (y != -100).sum(1)

    right = weighting([step_of(batches(lengths), lambda lo, y, r, k: per_row(lo, y).sum() / 4, world=1)])
    assert (right.shape, right.kind, right.fix) == ("sequence_means", "step", None), right
    assert "a mean of per-row means over the step's rows — a per-sequence objective" in right.line
    wrong = weighting([step_of(batches(lengths), lambda lo, y, r, k: per_row(lo, y).mean() / 2, world=1)])
    assert (wrong.shape, wrong.kind) == ("row_means_by_group", "split"), wrong
    assert "per-row means averaged within each micro-batch — a micro-batch of fewer rows weighs each more" in wrong.line


def test_label_smoothing_is_read_with_its_epsilon_and_a_z_loss_or_a_regression_is_said_not_read():
    y = batches([[[8, 5]]])[0][0]
    smoothed, _ = read_one(lambda lo: ce(lo, y, "sum", label_smoothing=0.1) / 13, torch.randn(2, 8, V).requires_grad_())
    assert (smoothed.shape, smoothed.kind) == ("mean", "step") and "label smoothing ε = 0.1" in smoothed.line, smoothed

    def z_loss(lo):
        return ce(lo, y, "sum") / 13 + 1e-4 * lo.logsumexp(-1)[y != -100].square().sum() / 13

    found, why = read_one(z_loss, torch.randn(2, 8, V).requires_grad_())
    assert found.shape == "unread" and "at the label not: another term on the logits beside it (a z-loss is one" in why
    found, why = read_one(lambda out: (out - 1).square().mean(), torch.randn(4, 1).requires_grad_())
    assert found.shape == "unread" and why == "its output has no class dimension (a regression, or another loss)"
    fused = TargetWeights()
    fused.watch(torch.zeros((), requires_grad=True))  # a model that returns its loss alone
    assert weighting([], unread=fused.unread).line.startswith("not read: the model's output holds no logits")


@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_logits_are_read_at_the_float32_cast_the_loss_takes_them_through(autocast):
    """A bf16 model, its loss in float32 (`logits.float()`, or autocast's cast inside the loss on a view): read at
    the cast, as sharp as a float32 run — a mean of micro-batch means over micro-batches of 15 and 16 targets is
    named. Read at the bf16 logits themselves it could not be, and is said so."""
    y = batches([[[8, 7]]])[0][0]  # 15 targets: each weighs 1/15 = 1/16 × (1 + 7 %)
    logits = torch.randn(2, 8, V, dtype=torch.bfloat16).requires_grad_()
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            found, _ = read_one(lambda lo: F.cross_entropy(lo.view(-1, V), y.view(-1), ignore_index=-100) / 2, logits)
    else:
        found, _ = read_one(lambda lo: ce(lo.float(), y, "mean") / 2, logits)
    assert found.kind == "step" and found.resolution == pytest.approx(64 * 2.0**-23), found
    assert "float32 at the loss's cast" in found.line
    coarse, _ = read_one(lambda lo: ce(lo, y, "mean") / 2, torch.randn(2, 8, V, dtype=torch.bfloat16).requires_grad_())
    assert (coarse.shape, coarse.kind) == ("unresolved", "unread") and 1e-3 < coarse.resolution < 0.05, coarse
    assert coarse.line.startswith("not read finely enough: each weight is known to ±")
    assert "% of itself (bfloat16 gradients at the model's output)" in coarse.line

    def beside_the_loss(lo):  # a second term on the bf16 logits: the cast's gradient is not all they get
        return ce(lo.float(), y, "mean") + lo.square().sum() * 1e-3

    other, why = read_one(beside_the_loss, torch.randn(2, 8, V, dtype=torch.bfloat16).requires_grad_())
    assert other.shape == "unread" and "another term than the float32 loss reaches its logits" in why


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


def test_a_rescale_after_the_last_backward_is_counted_and_a_clip_is_not_a_weighting():
    """Megatron-LM's calculate_per_token_loss, fairseq's sample_size: the summed loss at backward, every gradient ÷
    the step's token count after it — the step's mean, the factor said; gradients multiplied unevenly (each tensor
    clipped by its own norm) are said, not read."""
    from gaeq.script.weights import AsLeft

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, V))
    y = batches([[[8, 5]]])[0][0]
    reader, left = TargetWeights(), AsLeft()
    out = model(torch.randn(2, 8, 8))
    reader.watch(out)
    ce(out, y).backward()
    left.take(model)
    for p in model.parameters():
        p.grad.div_(13)
    rescale = [left.factor() | {"before_clip": left.factor()}]
    assert rescale[0]["factor"] == pytest.approx(1 / 13, rel=1e-6)
    step = {"step": 0, "world_size": 1, "targets": [reader.take()], "rescale": [rescale]}
    found = weighting([step])
    assert found.shape == "mean" and "with the gradients ÷ 13 after the last backward (at step 0: a rescale)" in (
        found.line
    )
    first = next(model.parameters())
    first.grad.mul_(0.5)  # one tensor scaled apart
    uneven = left.factor()
    assert uneven["factor"] is None and uneven["range"] == pytest.approx([1 / 26, 1 / 13], rel=1e-6)
    step["rescale"] = [[uneven | {"before_clip": None}]]
    said = weighting([step])
    assert said.shape == "unread" and "multiplied unevenly after the last backward" in said.line


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


def test_gradients_changed_through_data_are_seen_as_changed_where_no_version_moves():
    """Megatron-LM's fused clip and fairseq's `p.grad.data.mul_` move no version counter: the entries read after
    the last backward still tell the change (and a clip that did not act changed nothing to tell)."""
    from gaeq.script.weights import AsLeft

    model = torch.nn.Linear(8, 4)
    model(torch.randn(3, 8)).square().sum().backward()
    left = AsLeft()
    left.take(model)
    for p in model.parameters():
        p.grad.data.mul_(1.0)  # a clip that did not act
    assert not left.changed()
    for p in model.parameters():
        p.grad.data.mul_(0.5)
    versions = [p.grad._version for p in model.parameters()]
    assert left.changed() and versions == [p.grad._version for p in model.parameters()]


def test_signed_weights_are_read_with_their_sign_and_a_normaliser_per_micro_batch_is_named_beside_the_whole_batch():
    """A policy gradient −A log π(token), advantages of both signs: each target's weight is A/N with its sign (its
    label the gradient's entry whose sign is not the weight's), of no shape one run tells; beside the whole batch's
    weights, each micro-batch's own normaliser is named by its window (the control: the same micro-batches of one
    size, where that normaliser is right, differ in nothing)."""
    from gaeq.objective.invariance import compare

    lengths = [[[3, 8], [5, 6]]]  # one rank, GA 2: 11 and 11 targets
    advantages = torch.tensor([[1.2, -0.7], [0.3, -1.5]])
    n = sum(sum(b) for b in lengths[0])

    def step(divide):
        reader = TargetWeights()
        for k, y in enumerate(batches(lengths)[0]):
            logits = torch.randn(*y.shape, V, requires_grad=True)
            reader.watch({"logits": logits})
            logp = logits.log_softmax(-1).gather(-1, y.clamp_min(0)[..., None])[..., 0]
            (torch.where(y != -100, -advantages[k][:, None] * logp, 0).sum() / divide(y)).backward()
        keys = [[f"{k}.{i}" for i in range(2)] for k in range(2)]
        return weighting([{"step": 0, "world_size": 1, "targets": [reader.take(keys)]}]), reader.unread

    whole, unread = step(lambda y: n)
    assert unread is None and (whole.shape, whole.kind) == ("signed", "unknown"), whole
    rows = whole.steps[0].rows
    assert [r.total for r in rows] == pytest.approx([1.2 * 3 / n, -0.7 * 8 / n, 0.3 * 5 / n, -1.5 * 6 / n], rel=1e-5)
    assert "of both signs" in whole.line and "label smoothing" not in whole.line
    per_micro_batch, _ = step(lambda y: int((y != -100).sum()) * 2)  # 11 each: the same weights, nothing to name
    assert compare(per_micro_batch, whole) is None
    lengths[0][1] = [2, 4]  # 11 and 6 targets: each micro-batch's own mean ÷ GA weighs the short one more
    whole, _ = step(lambda y: 17)
    found = compare(step(lambda y: int((y != -100).sum()) * 2)[0], whole)
    assert "one factor per micro-batch (× 0.7727 to × 1.417)" in found.words(), found.words()
    assert compare(step(lambda y: 17 * 2)[0], whole).window == "every target ÷ GA (2) once more"


def test_a_hand_all_reduce_of_the_gradients_is_read_as_a_sum_and_a_rescale_that_differs_by_rank_is_named():
    """torchtune's recipe by hand: each rank's gradients SUMmed over ranks after the last backward, then × 1 ÷ the
    step's tokens — the factor is relative to the combined gradient, the all-reduce no change in place; rank
    factors that differ (each rank's own count) are a shape tied to the split, with its fix."""
    from gaeq.objective.weighting import objective_factor
    from gaeq.script.weights import AsLeft

    model = torch.nn.Linear(8, 4)
    model(torch.randn(3, 8)).square().sum().backward()
    left, other = AsLeft(), [torch.randn_like(p) for p in model.parameters()]
    left.take(model)
    for p, g in zip(model.parameters(), other):
        assert left.holds(p.grad)
        p.grad.add_(g)  # the peer's gradient summed in, as all_reduce(SUM) leaves it
        left.all_reduced(p.grad, "sum")
    assert left.combined == "sum" and not left.changed()
    for p in model.parameters():
        p.grad.mul_(1 / 40)
    rescale = [left.rescale(1.0)]
    assert rescale[0]["factor"] == pytest.approx(1 / 40, rel=1e-6) and left.combined == "sum"
    ranks = [{"losses": [3.0], "combined": "sum", "rescale": rescale}, {"losses": [5.0], "combined": "sum"}]
    assert objective_factor(ranks) == pytest.approx((1 / 40, 1 / 40), rel=1e-6)  # Σ losses ÷ N, no ÷ world
    ranks[1]["combined"] = None  # DDP's mean
    assert objective_factor(ranks)[1] == pytest.approx(1 / 80, rel=1e-6)
    labels = batches([[[8, 8]], [[5, 3]]])
    step = step_of(labels, lambda lo, y, r, k: ce(lo, y), world=2)
    step["rescale"] = [[{"factor": 1 / 24}], [{"factor": 1 / 16}]]  # each rank's own count
    said = weighting([step])
    assert (said.shape, said.kind) == ("rank_rescale", "split") and "rank 0 ÷ 24, rank 1 ÷ 16" in said.line
    step["rescale"] = [[{"factor": 1 / 24}], [{"factor": 1 / 24}]]
    step["combined"] = ["sum", "sum"]
    assert weighting([step]).shape == "mean"  # summed over the ranks, ÷ the step's 24 targets


def test_the_float32_run_keeps_a_models_own_cast_to_bf16_float32_and_says_so():
    """`model.to(torch.bfloat16)`, `.half()` and transformers' `dtype=` (torch.set_default_dtype) in a script made
    float32 — the control, the same calls without it, casts. In a child: the patches are process-wide."""
    import subprocess
    import sys

    code = (
        "import torch\nfrom gaeq.script.float32 import Float32\nimport sys\nf = Float32()\n"
        "if sys.argv[1] == 'on': f.install()\n"
        "m = torch.nn.Linear(2, 2).to(torch.bfloat16)\nh = torch.nn.Linear(2, 2).half()\n"
        "torch.set_default_dtype(torch.bfloat16)\nn = torch.nn.Linear(2, 2)\n"
        "print(m.weight.dtype, h.weight.dtype, n.weight.dtype, f.switched_off)"
    )
    said = [subprocess.run([sys.executable, "-c", code, on], capture_output=True, text=True, check=True).stdout
            for on in ("on", "off")]  # fmt: skip
    assert said[0].split(" ", 3)[:3] == ["torch.float32"] * 3 and "Linear.to(bfloat16)" in said[0], said
    assert "Linear.half()" in said[0] and "torch.set_default_dtype(bfloat16)" in said[0]
    assert said[1].split(" ", 3)[:3] == ["torch.bfloat16", "torch.float16", "torch.bfloat16"], said


def test_an_entropy_bonus_beside_a_policy_gradient_is_said_not_read_as_a_weighting():
    """−A log π − β H(π): the entropy's gradient reaches every logit, not as a weighted log-probability's — not read,
    the cause said (a KL's k3 estimate through log π(token) is a weighted log-probability: read, in the other tests)."""
    y = batches([[[8, 5]]])[0][0]

    def loss(logits):
        logp = logits.float().log_softmax(-1)
        picked = logp.gather(-1, y.clamp_min(0)[..., None])[..., 0]
        entropy = -(logp.exp() * logp).sum(-1)
        return torch.where(y != -100, -torch.tensor([[0.7], [-1.1]]) * picked - 0.01 * entropy, 0).sum() / 13

    found, unread = read_one(loss, torch.zeros(2, 8, V))
    assert found.shape == "unread" and "an entropy bonus" in unread, unread
