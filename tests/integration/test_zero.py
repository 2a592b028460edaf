"""experiments/zero.yaml: ZeRO 0-3 × offload × dtype, parameters and gradients compared tensor by tensor.

One run of the experiment for the module; one test per claim. What the cells are comes from the
experiment file (its expansion on this machine), never from counts written here; a capability this
machine lacks (fp16, libaio for nvme) is a skip with DeepSpeed's reason, never a passing assertion.
"""

from __future__ import annotations

import math

import pytest

from gaeq.accelerator import fp16_unsupported_reason, nvme_unsupported_reason
from gaeq.matrix import load_matrix
from gaeq.problem.build import build_problem
from gaeq.results.compare import DEFAULT_TOLERANCES
from gaeq.results.snapshots import compare_snapshots, read_snapshots
from tests.conftest import REPO
from tests.helpers import cells_by_id, experiment_at, gaeq_run_here
from tests.processes import leftovers

pytestmark = pytest.mark.integration

MATRIX = load_matrix(REPO / "experiments" / "zero.yaml")
STEPS = 8
"""The experiment's 20 steps cut to 8 (past its warm-up of 3): every claim here holds from step 0."""


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero")
    proc, report, tag = gaeq_run_here(experiment_at("zero", folder, steps=STEPS), folder / "run")
    out = folder / "run"
    return proc, report, cells_by_id(report), out, tag


def expanded(**fields) -> list:
    """The experiment's cells (as expanded on this machine) whose fields have these values."""
    return [c for c in MATRIX.cells if all(getattr(c, k) == v for k, v in fields.items())]


def runnable(cells: dict, **fields) -> list[dict]:
    """The report's cells, of the expansion's runnable ones with these fields."""
    return [cells[c.id] for c in expanded(**fields) if c.skip_reason is None]


def test_the_run_exits_0_and_leaves_nothing_behind(zero_run):
    proc, report, cells, out, tag = zero_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(cells) == sorted(c.id for c in MATRIX.cells)
    assert "max |Δparam|" in proc.stdout
    assert leftovers(tag) == []


def test_every_cell_this_machine_can_run_matches(zero_run):
    _, _, cells, _, _ = zero_run
    ran = [cells[c.id] for c in MATRIX.runnable() if c.bug is None and c.expect == "match"]
    assert len(ran) >= 40
    assert {c["id"]: c["verdict"] for c in ran if c["verdict"] != "match"} == {}
    assert {c.id for c in MATRIX.cells if c.skip_reason} == {i for i, c in cells.items() if c["verdict"] == "skipped"}


def test_every_label_is_what_ran(zero_run):
    """Read back from the live objects: dtype, ZeRO stage and offload, FSDP2's sharding."""
    _, _, cells, _, _ = zero_run
    for c in (cells[c.id] for c in MATRIX.runnable()):
        assert c["ran"]["compute_dtype"] == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[c["dtype"]], c
        if c["trainer"] == "deepspeed":
            assert (c["ran"]["zero_stage"], c["ran"]["cpu_offload"]) == (c["zero_stage"], c["offload"] == "cpu"), c
        if c["trainer"] == "fsdp":  # FSDP2 really sharded: DTensor parameters under an FSDPModule
            assert (c["ran"]["fsdp"], c["ran"]["sharded_parameters"]) == (True, True), c


def test_fp32_deepspeed_ran_every_stage_and_offload(zero_run):
    _, _, cells, _, _ = zero_run
    ran = {(c["zero_stage"], c["offload"]) for c in runnable(cells, trainer="deepspeed", dtype="fp32")}
    expected = {(0, "none"), (1, "none"), (1, "cpu"), (2, "none"), (2, "cpu"), (3, "none"), (3, "cpu")}
    assert ran - {(3, "nvme")} == expected


def test_fp32_cells_equal_full_batch_tensor_by_tensor(zero_run):
    """torch's AdamW on both sides: only float summation order differs (not bitwise, far inside)."""
    _, report, cells, _, _ = zero_run
    fp32 = [c for c in runnable(cells, dtype="fp32", bug=None) if c["role"] == "cell"]
    for c in fp32:
        assert 0 < c["max_abs_param_diff"] < 1e-6 and 0 < c["max_abs_grad_diff"] < 1e-6, c


def test_offload_at_zero_0_is_skipped_with_the_reason(zero_run):
    """A rule of the matrix, not of the machine: ZeRO-0 has no partitioned optimizer to offload."""
    _, _, cells, _, _ = zero_run
    offload_z0 = expanded(zero_stage=0, offload="cpu")
    assert len(offload_z0) == 6  # world 1 and 2 × fp32, bf16, fp16
    for c in offload_z0:
        assert cells[c.id]["verdict"] == "skipped" and "offload needs ZeRO ≥ 1" in cells[c.id]["reason"]


def test_fp16_cells_match_where_the_accelerator_has_fp16(zero_run):
    if (reason := fp16_unsupported_reason()) is not None:
        pytest.skip(reason)
    _, _, cells, _, _ = zero_run
    judged = [c for c in expanded(dtype="fp16") if c.role.value in ("baseline", "cell")]  # not the instruments
    fp16 = [c for c in runnable(cells, dtype="fp16") if c["role"] in ("baseline", "cell")]
    assert len(fp16) == len([c for c in judged if not (c.zero_stage == 0 and c.offload == "cpu")])
    assert all(c["verdict"] == "match" and c["ran"]["compute_dtype"] == "float16" for c in fp16), fp16


def test_nvme_cells_swap_to_files_and_match(zero_run):
    """ZeRO-3 offloading to files (a model wide enough for DeepSpeed to swap, 1 MiB+ tensors): every
    cell matches, really wrote its swap files, and removed them when it ended."""
    if (reason := nvme_unsupported_reason()) is not None:
        pytest.skip(reason)
    _, _, cells, out, _ = zero_run
    nvme = runnable(cells, offload="nvme")
    assert len(nvme) == len(expanded(offload="nvme")) == 4
    for c in nvme:
        assert c["verdict"] == "match", c["reason"]
        ran = c["ran"]
        assert (ran["nvme_offload_optimizer"], ran["swapped_to_nvme"], ran["cpu_offload"]) == (True, True, False), ran
        assert ran["nvme_swap_bytes"] > 2**20
        assert not (out / "cells" / c["id"] / "nvme_swap").exists()


def test_zero_3_gathered_tensors_equal_zero_0s_directly(zero_run):
    """At world 2, compared with each other, not through the baseline."""
    *_, out, _ = zero_run
    z0 = read_snapshots(out / "cells" / "deepspeed-z0-w2-mb2-ga4")
    z3 = read_snapshots(out / "cells" / "deepspeed-z3-w2-mb2-ga4")
    tol = DEFAULT_TOLERANCES["fp32"]
    direct = compare_snapshots(z0, z3, atol=tol.tensor_atol, rtol=tol.tensor_rtol)
    assert direct.first == {}
    assert max(direct.max_rel.values()) < 1e-6
    assert z3.steps == list(range(STEPS)) and len(z3.order) == len(parameter_shapes())


@pytest.mark.parametrize(
    ("cell_id", "caught_by", "reason"),
    [
        ("torch-w1-mb2-ga8-bug_one_grad_scaled", "grads", "diverged at step 0: grads of head.bias"),
        ("torch-w1-mb2-ga8-bug_lr_zero", "params", "diverged at step 0: params of hidden.0.weight"),
        # a sharded gradient 4×: the comparison gathers the shards and localises it
        ("fsdp-w2-mb2-ga4-bug_one_grad_scaled", "grads", "diverged at step 0: grads of head.bias"),
    ],
)
def test_a_control_is_localised_to_its_tensor(zero_run, cell_id, caught_by, reason):
    _, _, cells, _, _ = zero_run
    c = cells[cell_id]
    assert (c["verdict"], c["caught_by"], c["first_divergent_step"]) == ("diverge", caught_by, 0), c
    assert c["reason"].startswith(reason), c["reason"]


def parameter_shapes() -> list[tuple[int, ...]]:
    """The experiment's model, built from its problem: each parameter's shape, in order."""
    return [tuple(p.shape) for p in build_problem(MATRIX.problem).model.parameters()]


def test_fsdp2_matches_and_moves_what_its_schedule_says(zero_run):
    """FSDP2, ZeRO-3's counterpart in PyTorch: tensor by tensor equal to full-batch training, and its
    traffic per step = one all-gather of the parameters per micro-step (the root stays gathered
    between forward and backward) + one reduce-scatter of the gradients (GA 4: 5 P), P with each
    tensor's dim 0 padded to a multiple of the world size (the head's 3 rows → 4)."""
    _, _, cells, _, _ = zero_run
    fsdp = cells["fsdp-w2-mb2-ga4"]
    assert 0 < fsdp["max_abs_param_diff"] < 1e-6 and 0 < fsdp["max_abs_grad_diff"] < 1e-6, fsdp
    world, ga = fsdp["world_size"], fsdp["grad_accum_steps"]
    padded = [(math.ceil(s[0] / world) * world, *s[1:]) for s in parameter_shapes()]
    assert fsdp["comm_bytes_per_step"] == (ga + 1) * 4 * sum(math.prod(shape) for shape in padded)
    assert cells["fsdp-w2-mb2-ga4-bf16"]["verdict"] == "match"


def model_state_formula() -> dict[str, float]:
    """The model state rank 0 holds mid-accumulation (fp32, AdamW, N = 2 ranks) by the ZeRO paper —
    parameters 4Ψ, gradients 4Ψ, Adam's moments 8Ψ, partitioned per stage — plus what DeepSpeed
    adds: at ZeRO ≥ 1 an fp32 master copy of the partition (4Ψ/N, even for an fp32 model); at ZeRO-2
    the gradients of every whole tensor its partition overlaps. FSDP2 between no-sync micro-steps
    holds whole gradients: 4Ψ + (4Ψ + 8Ψ) / N, Ψ with dim 0 padded to a multiple of N."""
    n, shapes = 2, parameter_shapes()
    sizes = [math.prod(s) for s in shapes]
    psi = sum(sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    overlapped = sum(size for start, size in zip(starts, sizes) if start < math.ceil(psi / n))  # rank 0's half
    padded = sum(math.prod((math.ceil(s[0] / n) * n, *s[1:])) for s in shapes)
    return {
        "torch-w2-mb2-ga4": 16 * psi,  # DDP: everything on every rank
        "deepspeed-z0-w2-mb2-ga4": 16 * psi,
        "deepspeed-z1-w2-mb2-ga4": 8 * psi + 8 * psi / n + 4 * psi / n,
        "deepspeed-z2-w2-mb2-ga4": 4 * psi + 4 * overlapped + 8 * psi / n + 4 * psi / n,
        "deepspeed-z3-w2-mb2-ga4": 16 * psi / n + 4 * psi / n,
        "fsdp-w2-mb2-ga4": 4 * psi + 12 * padded / n,
    }


@pytest.mark.parametrize("cell_id", list(model_state_formula()))
def test_model_state_per_rank_is_the_zero_papers_formula(zero_run, cell_id):
    """Counted from rank 0's tensors, within 0.5 %."""
    _, _, cells, _, _ = zero_run
    expected = model_state_formula()[cell_id]
    assert abs(cells[cell_id]["model_state_bytes"] / expected - 1) < 0.005, (
        cells[cell_id]["model_state_bytes"],
        expected,
    )
