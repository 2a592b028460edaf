"""A script matrix: the user's script as the problem, its cells and command lines per split, what
its probe saw compared with the baseline's — all without launching it (tests/integration launches)."""

from __future__ import annotations

import os
import signal

import pytest
import yaml

from gaeq.matrix import MatrixError, load_matrix
from gaeq.problem.script import Launcher
from gaeq.results.script_checks import ran_another_split, script_checks
from gaeq.script.launch import command_line, script_args
from gaeq.script.launchers import worker_args, worker_env
from tests.conftest import REPO
from tests.helpers import small_spec

SCRIPT = REPO / "experiments" / "scripts" / "ddp_manual.py"


def script_matrix(tmp_path, **extra):
    spec = {
        "name": "mine",
        "script": {"path": str(SCRIPT), "args": ["--batch_size={micro_batch_size}", "--accum", "{grad_accum_steps}"]},
        "steps": 3,
        "train_batch_size": 16,
        "axes": {"world_size": [1, 2], "micro_batch_size": [4]},
    } | extra
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_matrix(path)


def test_a_script_matrix_runs_the_script_in_every_cell_with_the_split_filled_in(tmp_path):
    m = script_matrix(tmp_path, cells=[{"world_size": 2, "micro_batch_size": 2, "args": ["--bug", "x"]}])
    assert [c.id for c in m.cells] == [
        "script-w1-mb16-ga1",  # the baseline: the whole batch in one micro-batch
        "script-w1-mb16-ga1-floor0",  # its twins (its own split, nudged), which measure the noise floor
        "script-w1-mb16-ga1-floor1",
        "script-w1-mb16-ga1-weight1e-02",  # and the detection limit (its own split, half of each batch × 1.01)
        "script-w1-mb4-ga4",
        "script-w2-mb4-ga2",
        "script-w2-mb2-ga4-args_bug_x",
    ]
    assert m.problem.script.path == str(SCRIPT) and m.problem.script.cwd == str(SCRIPT.parent)
    control = next(c for c in m.cells if c.script_args)
    assert script_args(control, m.problem, out=tmp_path / "c") == ["--batch_size=2", "--accum", "4", "--bug", "x"]
    assert command_line(control, m.problem, out=tmp_path / "c") == (
        f"torchrun --standalone --nproc_per_node 2 {SCRIPT} --batch_size=2 --accum 4 --bug x"
    )
    # the run directory's copy of the matrix runs from anywhere: absolute paths, explicit trainers
    assert m.source["problem"]["script"]["path"] == str(SCRIPT) and m.source["baseline"]["trainer"] == "script"


@pytest.mark.parametrize(
    ("launcher", "adds", "says"),
    [
        (Launcher.TORCHRUN, {"TORCHELASTIC_RUN_ID": "gaeq", "LOCAL_WORLD_SIZE": "2"}, "torchrun --standalone"),
        (Launcher.DEEPSPEED, {"CROSS_RANK": "0", "LOCAL_SIZE": "2"}, "deepspeed --num_gpus 2"),
        (Launcher.ACCELERATE, {"ACCELERATE_MIXED_PRECISION": "no", "TORCHELASTIC_RUN_ID": "gaeq"}, "accelerate launch"),
    ],
)
def test_each_rank_gets_what_the_users_launcher_gives_its_workers(tmp_path, launcher, adds, says):
    m = script_matrix(tmp_path, script={"path": str(SCRIPT), "launcher": launcher.value, "args": ["--x"]})
    env = worker_env(m.problem.script.launcher, rank=1, world_size=2, port=29500)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "1", "2", "29500")
    assert env.items() >= adds.items()
    assert not {"CROSS_RANK", "ACCELERATE_MIXED_PRECISION", "TORCHELASTIC_RUN_ID"} - set(adds) & set(env)
    # only DeepSpeed's launcher adds an argument: --local_rank, before the script's own
    assert worker_args(launcher, rank=1) == (["--local_rank=1"] if launcher is Launcher.DEEPSPEED else [])
    assert command_line(m.cells[-1], m.problem, out=tmp_path).startswith(says)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"script": {"path": "no_such.py"}}, "script.path: no_such.py: no such file"),
        ({"problem": {"train_batch_size": 16}}, "a script matrix has no problem"),
        ({"script": {"path": str(SCRIPT), "args": ["{batch}"]}}, "unknown name 'batch'"),
        ({"script": {"path": str(SCRIPT), "launcher": "mpirun"}}, "'torchrun', 'deepspeed' or 'accelerate'"),
        ({"cells": [{"trainer": "torch", "micro_batch_size": 4}]}, "runs its script in every cell"),
        ({"cells": [{"micro_batch_size": 4, "args": ["{nope}"]}]}, "args: {nope}: unknown name"),
        ({"script": {"path": str(SCRIPT), "imports": ["numpy", "datasetz"]}}, "'datasetz' is not installed here"),
        ({"script": {"path": str(SCRIPT), "imports": ["json.nope"]}}, "'json.nope' is not installed here"),
    ],
)
def test_what_a_script_matrix_cannot_be_is_one_line(tmp_path, change, message):
    with pytest.raises(MatrixError, match=message.replace("{", r"\{").replace("}", r"\}")):
        script_matrix(tmp_path, **change)


def test_the_trainers_json_flags_reach_the_script_as_written(tmp_path):
    args = ["--accelerator_config", '{"split_batches": true}', "--batch_size", "{micro_batch_size}"]
    m = script_matrix(tmp_path, script={"path": str(SCRIPT), "args": args})
    cell = next(c for c in m.cells if c.id == "script-w2-mb4-ga2")
    filled = ["--accelerator_config", '{"split_batches": true}', "--batch_size", "4"]
    assert script_args(cell, m.problem, out=tmp_path / "c") == filled


def test_a_script_lists_any_installed_module_for_the_fork_server_after_gaeqs_own(tmp_path):
    from gaeq.runtime.server import PRELOAD, preload_modules

    script = {"path": str(SCRIPT), "launcher": "accelerate", "imports": ["numpy", "json", "accelerate", "numpy"]}
    m = script_matrix(tmp_path, script=script)
    modules = preload_modules(m.cells, {c.variant: m.problem for c in m.cells})
    assert modules == [PRELOAD, "gaeq.runtime.preload_accelerate", "numpy", "json"]
    # without imports: what the launcher says (accelerate), nothing of the user's
    default = script_matrix(tmp_path, script={"path": str(SCRIPT), "launcher": "accelerate"})
    assert preload_modules(default.cells, {c.variant: default.problem for c in default.cells})[-1] == (
        "gaeq.runtime.preload_accelerate"
    )


def test_script_args_belong_to_script_cells(write_matrix):
    from tests.helpers import small_spec

    spec = small_spec(cells=[{"trainer": "torch", "micro_batch_size": 4, "args": ["--bug"]}])
    with pytest.raises(MatrixError, match="args are a script cell's"):
        load_matrix(write_matrix(spec))


def probe(samples, *, initial="aa", events=None, steps=2, lr=None, lengths=None, exact=True):
    events = events or {"optimizer_step": 1, "clip": 1, "zero_grad": 1, "scheduler": 1, "schedule_advanced": 1}
    lr = lr or [1e-3] * steps
    return {
        "initial": initial,
        "steps": [
            {"step": s, "samples": samples[s], "events": events, "lr": lr[s], "lengths": lengths or [], "exact": exact}
            for s in range(steps)
        ],
    }


def test_the_probes_are_compared_data_then_init_then_events():
    base = probe([["a", "b", "c", "d"], ["e", "f", "g", "h"]])
    same = script_checks(base, probe([["d", "c", "b", "a"][::-1], ["e", "f", "g", "h"]]))
    assert same.first == dict.fromkeys(("split", "data", "init", "events", "update"))  # the multiset, not the order
    other = script_checks(base, probe([["a", "b", "c", "d"], ["e", "e", "g", "x"]], initial="bb")).first
    assert other["data"] == (1, "the data of step 1: 2 of the baseline's 4 samples missing, 2 others in their "
                             "place, 1 sample(s) seen twice — ranks drawing overlapping shards (a sampler seeded per "
                             "rank?)")  # fmt: skip
    assert other["init"][0] == 0 and "initial weights differ" in other["init"][1]
    per_micro_step = {"optimizer_step": 1, "clip": 4, "zero_grad": 1, "scheduler": 1}
    clipped = script_checks(base, probe([["a", "b", "c", "d"], ["e", "f", "g", "h"]], events=per_micro_step)).first
    assert clipped["data"] is None and clipped["events"] == (
        0,
        "clip_grad_norm_ (or a clip by hand) called 4× in optimizer step 0, the baseline 1× (per micro-step or per "
        "process where the baseline calls it once per step?)",
    )


def test_fingerprints_that_padding_could_explain_are_not_a_data_divergence():
    """Inputs whose length changes with the micro-batch and whose padding gaeq could not remove: a
    difference in fingerprints is not checked (and said), never reported as other data. The same
    difference with padding removed (exact), or with one length throughout, is a divergence."""
    samples = [["a", "b"], ["c", "d"]]
    base = probe(samples, lengths=[23], exact=False)
    padded = script_checks(base, probe([["a", "x"], ["c", "d"]], lengths=[17, 23], exact=False))
    assert "data" not in padded.first and "17 to 23 positions" in padded.not_checked["data"]
    assert "gaeq.probe(pad_id=…)" in padded.not_checked["data"]
    exact = script_checks(probe(samples, lengths=[23]), probe([["a", "x"], ["c", "d"]], lengths=[17, 23]))
    assert exact.first["data"][0] == 0 and not exact.not_checked
    one_length = script_checks(base, probe([["a", "x"], ["c", "d"]], lengths=[23], exact=False))
    assert one_length.first["data"][0] == 0  # the same padding for every row: the rows are the samples'


def test_the_same_samples_with_other_labels_are_told_from_other_samples():
    """The first input (the token ids) of every sample is the baseline's, the whole rows are not: the
    samples are there, their labels or masks differ — not "missing"."""
    base = probe([["a", "b"], ["c", "d"]])
    for step in base["steps"]:
        step |= {"keys": ["k1", "k2"], "inputs": ["input_ids", "attention_mask", "labels"]}
    cell = probe([["a", "x"], ["c", "d"]])
    for step in cell["steps"]:
        step |= {"keys": ["k1", "k2"], "inputs": ["input_ids", "labels (targets, shifted)"]}
    assert script_checks(base, cell).first["data"] == (
        0,
        "the data of step 0: the same 2 samples as the baseline's (by their input_ids), but 1 with other values in "
        "labels (targets, shifted) — targets that depend on the split, or on what the cell changed",
    )


def test_another_layout_of_the_same_samples_is_said_and_positions_that_disagree_are_the_data_reason():
    """A cell that packs what its baseline pads: the same fingerprints (gaeq.script.samples reads what is
    trained), a match whose reason says the layout differs; packed inputs that disagree on where sequences
    start give other samples, and the reason says why — not a sampler's guess."""
    padded, packed = probe([["a", "b"], ["c", "d"]]), probe([["a", "b"], ["c", "d"]])
    for step in padded["steps"]:
        step["layouts"] = ["no padding (attention_mask)", "padded right (attention_mask)"]
    for step in packed["steps"]:
        step["layouts"] = ["packed by position_ids"]
    same = script_checks(padded, packed)
    assert same.first["data"] is None and same.remarks == [
        "laid out otherwise than the baseline — packed by position_ids, the baseline padded right (attention_mask) —: "
        "the same samples, each trained on the same targets, in every step"
    ]
    assert script_checks(padded, padded).remarks == []
    run_on = probe([["ab"], ["cd"]])
    for step in run_on["steps"]:
        step["layouts"] = [
            "packed by position_ids, seq_idx (they disagree: position_ids starts 1, seq_idx starts 2 sequences)"
        ]
    cut = probe([["a", "e"], ["c", "f"]])  # a collator that cuts the data into other pieces (TRL's wrapped packing)
    for step in cut["steps"]:
        step["layouts"] = ["packed by position_ids"]
    assert script_checks(padded, cut).first["data"][1] == (
        "the data of step 0: 1 of the baseline's 2 samples missing, 1 others in their place (laid out packed by "
        "position_ids, the baseline padded right (attention_mask))"
    )  # what is known, no sampler guessed at
    why = script_checks(padded, run_on).first["data"][1]
    assert "sampler" not in why and why.startswith(
        "the data of step 0: 2 of the baseline's 2 samples missing, 1 others in their place: your model was given "
        "packed rows by position_ids, seq_idx (they disagree"
    )


def test_a_scheduler_count_is_a_divergence_only_where_the_lr_differs():
    """A schedule stepped per micro-step and sized for it gives the baseline's lr at every step: the
    count differs, the optimisation does not. Stepped more often without that, the lr runs ahead: the
    calls are the cause. A wrapper that advanced the schedule more than the script called it is named
    as what moved the lr."""
    calls = {"optimizer_step": 1, "clip": 1, "zero_grad": 1, "scheduler": 8, "schedule_advanced": 8}
    base = probe([["a"], ["b"]], lr=[1e-3, 2e-3])
    sized = script_checks(base, probe([["a"], ["b"]], events=calls, lr=[1e-3, 2e-3]))
    assert sized.first["events"] is None
    ahead = script_checks(base, probe([["a"], ["b"]], events=calls, lr=[1e-3, 3e-3]))
    assert ahead.first["events"] == (
        0,
        "scheduler.step() called 8× in optimizer step 0, the baseline 1× (per micro-step or per process where the "
        "baseline calls it once per step?)",
    )
    wrapped = calls | {"scheduler": 1, "schedule_advanced": 2, "wrapper:accelerate.scheduler.AcceleratedScheduler": 1}
    through = script_checks(base, probe([["a"], ["b"]], events=wrapped, lr=[1e-3, 3e-3]))
    assert through.first["events"] is None and through.notes["lr"] == (
        " — the schedule advanced 2× before optimizer step 0, the baseline's 1×: your scheduler.step() went through "
        "accelerate.scheduler.AcceleratedScheduler, which stepped the scheduler it wraps 2×"
    )


def test_a_script_that_ignores_the_split_is_told_so(tmp_path):
    """What the split check says names what ran — which optimizer stepped after how many micro-batches,
    read over the first steps — and says "ignored" only where the forwards the probe saw prove it."""
    m = script_matrix(tmp_path)
    cell = next(c for c in m.cells if c.id == "script-w2-mb4-ga2")
    first = {"world_size": 2, "rows": [[4, 4], [4, 4]], "backward": [2, 2], "events": {"stepped:AdamW": 1}}
    assert ran_another_split(cell, [first]) is None
    assert "ignored {micro_batch_size}: it ran micro-batches of 8" in ran_another_split(
        cell, [first | {"rows": [[8], [8]], "backward": [1, 1]}]
    )
    assert "saw no training forward" in ran_another_split(cell, [first | {"rows": [[], []]}])
    # a dataset packed before any sampler (TRL's packing): 4 rows a micro-batch, each a pack of several texts —
    # the split the cell asked for; the same packs with 9 rows a micro-batch is not
    packed = first | {"rows": [[11, 13], [12, 10]], "packs": [[4, 4], [4, 4]]}
    assert ran_another_split(cell, [packed]) is None
    assert (
        "ignored {micro_batch_size}: it ran micro-batches of 20, 22 samples in 9 rows, the cell 4"
        in ran_another_split(cell, [packed | {"rows": [[20], [22]], "packs": [[9], [9]], "backward": [1, 1]}])
    )
    # … and its collator then flattening each micro-batch into one padding-free row (TRL's bfd): how many packs a
    # row held cannot be counted — the data check compares the samples — never "ignored" (TRL 1.16's sft.py)
    assert ran_another_split(cell, [packed | {"rows": [[31, 35], [30, 33]], "packs": [[1, 1], [1, 1]]}]) is None
    per_micro = first | {"rows": [[4], [4]], "backward": [1, 1]}
    assert ran_another_split(cell, [per_micro, per_micro]) == (
        "AdamW stepped after every micro-batch (one backward call per step on each rank), where the cell accumulates "
        "2: {grad_accum_steps} ignored, or a step per micro-batch"
    )
    both = per_micro | {"events": {"stepped:AdamW": 1, "stepped:Muon": 1}}
    assert ran_another_split(cell, [per_micro, both]) == (
        "AdamW stepped after every micro-batch, Muon after 2: each micro-batch's gradient applied on its own"
    )
    four = first | {"rows": [[4] * 4, [4] * 4], "backward": [4, 4]}
    said = ran_another_split(cell, [four])
    assert said.endswith("(4 forward and backward calls on each rank in its first), where the cell accumulates 2: "
                         "{grad_accum_steps} ignored")  # fmt: skip
    unseen = four | {"rows": [[4, 4], [4, 4]]}  # fewer forwards seen than backward calls: nothing proven
    assert not ran_another_split(cell, [unseen]).endswith("ignored")
    gan = first | {"backward": [4, 4], "phases": [[2, 2], [2, 2]]}  # two optimizers, each after its own 2
    assert ran_another_split(cell, [gan]) is None
    assert ran_another_split(cell, [first | {"world_size": 1}]) == "your script ran 1 ranks, the cell 2"


def test_a_script_that_stops_short_is_an_error_that_says_where(tmp_path):
    """What the launch concludes from what the probe left (gaeq.script.launch._why_not_done)."""
    from gaeq.script.launch import _why_not_done

    m = script_matrix(tmp_path)
    out = tmp_path / "cell"
    out.mkdir()

    def why(facts, code, who="the script"):
        return _why_not_done(m.problem, out=out, facts=facts, code=code, who=who, timeout_s=60)

    assert why(None, None) == "timed out: the script ran for 60 s without finishing its 3 steps"
    # rank 0 saved nothing (it was stopped, or crashed itself): said as that, not as a probe that never began
    assert why(None, -11, "the script's rank 1") == (
        "the script's rank 1 was killed by SIGSEGV (signal 11: a crash in native code, its Python stack in its "
        "log) before gaeq's probe saved what it saw"
    )
    assert (
        why({"steps": [], "initial": None}, 1)
        == "the script exited with code 1 before gaeq's probe recorded an optimizer step"
    )
    assert why({"steps": [], "initial": None}, 0).startswith(  # it ended of itself, no step: a hint where to look
        "no optimizer step seen (the script exited with code 0): is its training loop behind an argument"
    )
    first = {"step": 0, "world_size": 1, "rows": [[16]], "backward": [1]}
    assert why({"steps": [first], "initial": "aa"}, 0) == "the script exited with code 0 after 1 of 3 optimizer steps"
    (out / "trace.jsonl").write_text("")
    assert why({"steps": [first], "initial": "aa"}, 0) is None  # a result to judge (its split with the numbers)


def test_active_dropout_is_named_and_a_diverging_script_cell_says_so():
    import torch

    from gaeq.results.notes import dropout_note
    from gaeq.script.probe import active_dropout

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1), torch.nn.Dropout(0.0))
    assert active_dropout(model) == {"1": 0.1}  # p = 0 draws no mask
    assert active_dropout(model.eval()) == {}  # nor does a module in eval mode
    assert dropout_note({"1": 0.1}, script=True).startswith(" — your model has active dropout (1=0.1)")


def test_a_deepspeed_engines_norm_is_its_zero_optimizers_then_its_own():
    """DeepSpeed clips inside its step and keeps no .grad at ZeRO ≥ 1: the probe asks the engine (the
    outermost module) — its ZeRO optimizer's norm of this step, computed before the inner optimizer's
    step hook fires, else the engine's own; a plain module has neither."""
    from types import SimpleNamespace

    from gaeq.script.weights import engine_norm

    assert engine_norm(SimpleNamespace(optimizer=SimpleNamespace(_global_grad_norm=0.5))) == 0.5
    engine = SimpleNamespace(optimizer=SimpleNamespace(), get_global_grad_norm=lambda: 0.25)
    assert engine_norm(engine) == 0.25
    assert engine_norm(SimpleNamespace(get_global_grad_norm=lambda: None)) is None
    assert engine_norm(None) is None


def _rank_exiting(code: int, after: float) -> None:
    """A rank that ends after `after` s: exits with `code`, or — negative — is killed by that signal
    (its disposition set here: the fork inherits pytest's own handlers)."""
    import faulthandler
    import os
    import time

    os.setsid()  # as a script's rank does (attach.forked_rank)
    time.sleep(after)
    if code < 0:
        faulthandler.disable()
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


@pytest.mark.integration  # starts processes of its own
def test_a_failing_rank_stops_its_peers_and_a_silent_one_times_out():
    """How a cell's ranks are waited for (gaeq.script.launch._wait): the rank that exits non-zero is the
    cell's cause, its blocked peers are not waited for — and where one was killed by a signal and another
    exited with an error (the reset connection its peer's crash left it), the killed one is the cause;
    ranks that run past the timeout give no code."""
    import multiprocessing
    import time

    from gaeq.script.launch import _stop, _wait

    fork = multiprocessing.get_context("fork")

    def ranks(*ends):
        procs = [fork.Process(target=_rank_exiting, args=end) for end in ends]
        for p in procs:
            p.start()
        return procs

    procs = []
    try:
        procs = ranks((0, 60), (3, 0))
        started = time.monotonic()
        assert _wait(procs, timeout_s=30, grace_s=1) == (1, 3) and time.monotonic() - started < 10
    finally:
        for p in procs:
            _stop(p)
    assert procs[0].exitcode is not None  # stopped, not left running
    try:
        procs = ranks((1, 0), (-signal.SIGSEGV, 0))
        while any(p.exitcode is None for p in procs):  # both ended before they are looked at
            time.sleep(0.05)
        assert _wait(procs, timeout_s=30) == (1, -signal.SIGSEGV)
        procs = ranks((1, 0), (-signal.SIGSEGV, 0.5))  # the crash seen after its peer's error (a loaded machine)
        assert _wait(procs, timeout_s=30, grace_s=10) == (1, -signal.SIGSEGV)
    finally:
        for p in procs:
            _stop(p)
    try:  # every peer gets the grace, not only the first to end; a rank alone is not waited for at all
        procs = ranks((3, 0), (1, 0.5), (1, 1.0))
        started = time.monotonic()
        assert _wait(procs, timeout_s=30, grace_s=20) == (0, 3) and time.monotonic() - started < 10
        assert all(p.exitcode == code for p, code in zip(procs, (3, 1, 1))), "a peer was stopped, not waited for"
        procs = ranks((3, 0))
        started = time.monotonic()
        assert _wait(procs, timeout_s=30, grace_s=20) == (0, 3) and time.monotonic() - started < 10
    finally:
        for p in procs:
            _stop(p)
    try:
        procs = ranks((0, 60))
        assert _wait(procs, timeout_s=0.3) == (0, None)
    finally:
        _stop(procs[0])
    assert procs[0].exitcode is not None


TINY = """
import argparse
import torch

p = argparse.ArgumentParser()
p.add_argument("--mb", type=int)
p.add_argument("--ga", type=int)
p.add_argument("--steps", type=int)
p.add_argument("--local_rank", type=int, required=True)  # DeepSpeed's launcher passes it
a = p.parse_args()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
batch = a.mb * a.ga
for s in range(a.steps):
    for k in range(a.ga):
        i = s * batch + k * a.mb
        loss = ((model(x[i : i + a.mb]) - y[i : i + a.mb]) ** 2).sum() / batch
        loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.integration  # starts processes of its own
def test_gaeq_check_runs_a_script_under_the_splits_given_on_the_command_line(tmp_path):
    """`gaeq check` writes the script matrix for you and runs it, here under DeepSpeed's launcher, whose
    --local_rank the script requires (the controls of the machinery it runs on:
    tests/integration/test_your_script.py, whose mistakes must diverge)."""
    import json

    from typer.testing import CliRunner

    from gaeq.cli import app

    (tmp_path / "tiny.py").write_text(TINY)
    args = ["check", str(tmp_path / "tiny.py"), "--batch", "8", "--split", "w1:mb4", "--steps", "2"]
    args += ["--launcher", "deepspeed", "--out", str(tmp_path / "run")]
    args += ["--", "--mb", "{micro_batch_size}", "--ga", "{grad_accum_steps}", "--steps", "{steps}"]
    result = CliRunner().invoke(app, args)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    verdicts = {c["id"]: c["verdict"] for c in report["cells"] if c["role"] in ("baseline", "cell")}
    assert verdicts == {"script-w1-mb8-ga1": "match", "script-w1-mb4-ga2": "match"}, result.output
    assert result.exit_code == 0
    # the matrix written for it, beside the run
    assert yaml.safe_load((tmp_path / "run" / "check.yaml").read_text())["script"]["launcher"] == "deepspeed"


def test_gaeq_check_says_how_to_write_a_split(tmp_path):
    from typer.testing import CliRunner

    from gaeq.cli import app

    result = CliRunner().invoke(app, ["check", "train.py", "--batch", "8", "--split", "2x4"])
    assert result.exit_code == 2 and "--split 2x4: write it as w<world size>:mb<micro batch>" in result.output


def test_the_update_sketch_is_judged_against_the_runs_own_noise_floor():
    """The update after each step, projected (relative to the size of the baseline's update so far): within
    the constant, or 10 × the twins' running maximum drift at that step if more — never past 1000 × the
    constant, and twins drifting beyond that set nothing (they are not rounding)."""
    from gaeq.results.script_checks import _update_differs

    def steps(*sketches):
        return [{"sketch": s, "sketch_scale": 1.0} for s in sketches]

    base = steps(0.5, 0.7, 0.8)
    assert _update_differs(base, steps(0.5, 0.7, 0.8 + 1e-9), rtol=1e-5) is None
    off = _update_differs(base, steps(0.5, 0.7, 0.8 + 1e-4), rtol=1e-5)  # 1e-4 of the update's size
    assert off == (2, "the parameters after step 2 differ: update sketch rel 1.00e-04 > tol 1.0e-05")
    twins = [{"steps": steps(0.5, 0.7, 0.8 + 2e-5)}, {"steps": steps(0.5, 0.7 - 1e-6, 0.8)}]  # rounding: 2e-5
    assert _update_differs(base, steps(0.5, 0.7, 0.8 + 1e-4), twins=twins, rtol=1e-5) is None  # tol 2e-4 there
    # the running maximum: before the twins drifted (step 1: 1e-6 × 10 < 1e-5), the constant holds
    early = _update_differs(base, steps(0.5, 0.7 + 5e-5, 0.8), twins=twins, rtol=1e-5)
    assert early == (1, "the parameters after step 1 differ: update sketch rel 5.00e-05 > tol 1.0e-05")
    wild = [{"steps": steps(0.5, 0.7, 0.9)}]  # 0.1 > 1000 × 1e-5: not rounding, rejected, the constant alone
    assert _update_differs(base, steps(0.5, 0.7, 0.8 + 1e-4), twins=wild, rtol=1e-5)[0] == 2


def test_the_update_sketch_measures_the_update_not_the_weights():
    """Its scale is how far the parameters moved, so an lr-sized mistake stands out even where the weights
    are large: weights of 100 moved by 1e-3 against a cell's 1.1e-3 — far beyond the constant 1e-5 relative
    to the update, and 1e5 × less (within it) relative to the weights."""
    import torch

    from gaeq.script.weights import UpdateSketch

    weights = [torch.full((300,), 100.0, dtype=torch.float64)]
    sketch = UpdateSketch()
    sketch.start(weights)
    value, scale = sketch([weights[0] - 1e-3])
    cell = UpdateSketch()
    cell.start(weights)
    moved, _ = cell([weights[0] - 1.1e-3])
    drift = abs(moved - value) / scale  # 0.1 × |Σ w| / Σ |w| of the projection's random weights
    assert drift > 1e-3
    weights_size = scale / 1e-3 * 100.0  # what the sketch's scale was when it projected the weights themselves
    assert abs(moved - value) / weights_size == pytest.approx(drift * 1e-5) and drift * 1e-5 < 1e-5


def test_gaeq_probe_tells_the_probe_which_module_trains_and_is_a_no_op_outside_gaeq(monkeypatch):
    import torch

    import gaeq
    from gaeq.script import probe as probing

    student, teacher = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    monkeypatch.setattr(probing, "ACTIVE", None)
    assert gaeq.probe(model=student) is None  # outside gaeq: nothing happens
    listening = probing.Probe(out=None, steps=1)
    monkeypatch.setattr(probing, "ACTIVE", listening)
    gaeq.probe(model=student)
    listening._before_forward(teacher, ())  # the first training forward is the teacher's...
    listening._after_forward(teacher, (torch.ones(1, 2),), {}, None)
    assert listening.model is student  # ...but the model told is the one probed


def test_a_launch_option_that_cannot_apply_to_a_script_is_bad_input(tmp_path, monkeypatch):
    """`--launcher` names the launcher that starts the script's ranks: the one its user starts it with
    (accelerate's is torchrun's start); `--lanes` is gaeq's own cells' (a script's run one at a time).
    Refused before any process starts, in one line."""
    from typer.testing import CliRunner

    from gaeq.cli import app
    from gaeq.script.launchers import launch_mismatch

    assert (
        launch_mismatch(Launcher.ACCELERATE, "torchrun") is None and launch_mismatch(Launcher.TORCHRUN, "local") is None
    )
    assert "your script is started by torchrun" in launch_mismatch(Launcher.TORCHRUN, "deepspeed")
    script_matrix(tmp_path)
    for option, said in ((["--launcher", "deepspeed"], "(--launcher torchrun)"), (["--lanes", "2"], "one at a time")):
        result = CliRunner().invoke(
            app, ["run", "--matrix", str(tmp_path / "mine.yaml"), "--out", str(tmp_path / "r"), *option]
        )
        assert result.exit_code == 2 and said in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "r").exists()
    # without --out: the directory gaeq named (runs/<name>-<time>) goes with the refusal
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "--matrix", str(tmp_path / "mine.yaml"), "--launcher", "deepspeed"])
    assert result.exit_code == 2 and list((tmp_path / "runs").iterdir()) == [], result.output


def test_a_scripts_muon_orthogonalises_each_matrix_once_a_step_however_its_ranks_share_the_work():
    """The probe counts Newton–Schulz calls per rank and step (gaeq/newton_schulz.py): a split matches the
    one-rank baseline's count when no rank ran more and the ranks together no fewer — DDP and ZeRO-0 (every
    rank every matrix), ZeRO ≥ 1 (a partition each, a matrix across two partitions twice) — and the two
    reported shapes must fail: per micro-batch (DeepSpeed#8443) and never (#8441)."""
    from gaeq.results.script_checks import orthogonalisation_differs

    base = {"step": 0, "newton_schulz": [11]}
    for ranks in ([11], [11, 11], [6, 6], [5, 6]):  # one rank, DDP / ZeRO-0, ZeRO-1/2, ZeRO-3
        assert orthogonalisation_differs([(base, {"step": 0, "newton_schulz": ranks})]) is None, ranks
    for ranks, said in (([24, 20], "more than once a step"), ([0, 0], "never"), ([3, 4], "not every matrix")):
        step, why = orthogonalisation_differs([(base, {"step": 0, "newton_schulz": ranks})])
        assert step == 0 and why.endswith(f"your Muon orthogonalised {said}"), why
    assert orthogonalisation_differs([({"step": 0}, {"step": 0})]) is None  # no Muon, or a probe of before
    # 10 matrices, ZeRO-3, world 2, GA 2, orthogonalised per micro-batch: [10, 10] calls, as many as "once a step"
    # — but 5 on each rank before the step's last backward, where the baseline ran none
    early = {"step": 0, "newton_schulz": [10, 10], "newton_schulz_early": [5, 5]}
    step, why = orthogonalisation_differs([({"step": 0, "newton_schulz": [10], "newton_schulz_early": [0]}, early)])
    assert step == 0 and why.endswith("orthogonalised each micro-batch's gradient, not the accumulated one"), why


def test_a_config_file_the_script_reads_is_filled_per_cell(tmp_path):
    """script.files: picotron's, torchtitan's, axolotl's way — the split lives in a config file, not on the
    command line. Each cell gets its own copy in its folder, placeholders filled as in args (JSON's own
    braces untouched); a name no cell could fill is bad input when the matrix loads."""
    import json

    from gaeq.script.launch import prepare

    m = load_matrix(REPO / "experiments" / "your_config_file_script.yaml")
    assert list(m.problem.script.files) == ["config_driven.json"]
    cell = next(c for c in m.cells if c.id == "script-w2-mb4-ga4")
    out, args, _ = prepare(cell, m.problem, run_dir=tmp_path)
    assert args == ["--config", str(out / "config_driven.json")]
    config = json.loads((out / "config_driven.json").read_text())
    assert config["training"] == {
        "micro_batch_size": 4, "gradient_accumulation_steps": 4, "total_train_steps": 6, "seed": 0
    }  # fmt: skip
    assert config["optimizer"]["learning_rate"] == 0.01
    (tmp_path / "bad.json").write_text('{"micro": {micro_batch}}\n')
    (tmp_path / "bad.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "bad",
                "script": {"path": str(SCRIPT), "files": ["bad.json"]},
                "steps": 2,
                "train_batch_size": 4,
                "axes": {"world_size": [1], "micro_batch_size": [2]},
            }
        )  # fmt: skip
    )
    with pytest.raises(MatrixError, match=r"files: bad.json: .*unknown name 'micro_batch'"):
        load_matrix(tmp_path / "bad.yaml")
    (tmp_path / "missing.yaml").write_text((tmp_path / "bad.yaml").read_text().replace("bad.json", "nope.json"))
    with pytest.raises(MatrixError, match="script.files: nope.json: no such file"):
        load_matrix(tmp_path / "missing.yaml")


def test_the_run_directorys_matrix_holds_what_was_validated_whoever_wrote_it(tmp_path):
    """`gaeq worker` on each node of a cluster wrote the matrix file as it was given — a script path
    relative to the matrix, which `gaeq report RUN` then looked for beside RUN. Every writer now writes
    what was validated (api.write_matrix): the script's absolute path, its config files read in."""
    from gaeq import api

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "train.py").write_text(TINY)
    (tmp_path / "mine" / "cfg.json").write_text('{"mb": {micro_batch_size}}\n')
    spec = {"name": "mine", "script": {"path": "train.py", "files": ["cfg.json"]}, "steps": 2, "train_batch_size": 4,
            "axes": {"world_size": [1], "micro_batch_size": [2]}}  # fmt: skip
    (tmp_path / "mine" / "m.yaml").write_text(yaml.safe_dump(spec))
    m = load_matrix(tmp_path / "mine" / "m.yaml")
    (tmp_path / "run").mkdir()
    api.write_matrix(tmp_path / "run", m)
    again = load_matrix(tmp_path / "run" / "matrix.yaml")  # read from elsewhere, as gaeq report does
    assert again.problem.script.path == str(tmp_path / "mine" / "train.py")
    assert again.problem.script.files == {"cfg.json": '{"mb": {micro_batch_size}}\n'}
    assert [c.id for c in again.cells] == [c.id for c in m.cells]


def test_a_ranks_threads_are_what_its_launcher_gives_at_each_world_size():
    """OMP_NUM_THREADS per launcher (read from torch.distributed.run, accelerate's launch and DeepSpeed's
    launcher; the real torchrun and DeepSpeed launchers in tests/integration/test_your_script.py): a value
    given is kept by all; unset, torchrun 1 only above one worker, accelerate 1, DeepSpeed nothing."""
    from gaeq.problem.script import Launcher
    from gaeq.script.launchers import threads

    given = {"OMP_NUM_THREADS": "3"}
    for launcher in Launcher:
        for world in (1, 2):
            assert threads(launcher, world_size=world, given=given) == {}, (launcher, world)
    unset = {
        (launcher, world): threads(launcher, world_size=world, given={}).get("OMP_NUM_THREADS")
        for launcher in Launcher
        for world in (1, 2)
    }
    assert unset == {
        (Launcher.TORCHRUN, 1): None,
        (Launcher.TORCHRUN, 2): "1",
        (Launcher.ACCELERATE, 1): "1",
        (Launcher.ACCELERATE, 2): "1",
        (Launcher.DEEPSPEED, 1): None,
        (Launcher.DEEPSPEED, 2): None,
    }


def test_a_launched_script_ranks_shared_memory_goes_with_it_and_the_parent_frees_every_cells_port(tmp_path):
    """Under `--launcher deepspeed|torchrun` each script cell meets on a port of its own: a rank frees
    its script's DeepSpeed segment however the script ended (finished, ran past its deadline), and the
    parent frees every such port's — a rank the launcher killed mid-teardown frees nothing."""
    from gaeq.runtime import shm
    from gaeq.runtime.cells import RunOptions
    from gaeq.runtime.dist import free_port
    from gaeq.runtime.external import _ports
    from gaeq.script.launched import _run_rank, cell_port

    port = free_port()
    env = {**os.environ, "MASTER_ADDR": shm.LOCALHOST, "MASTER_PORT": str(port), "RANK": "1"}
    for cmd, timeout_s, code in ([["true"], 10, 0], [["sleep", "30"], 0.2, None]):
        planted = shm.SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_{shm.LOCALHOST}_{port}_1"
        planted.write_bytes(b"")  # what DeepSpeed's comm op makes in the script's rank 1
        ran = _run_rank(cmd, env=env, cwd=str(tmp_path), log=tmp_path / "log", timeout_s=timeout_s)
        assert ran == code and not planted.exists()

    m = script_matrix(tmp_path)
    opts = RunOptions(problems=m.problems, run_dir=tmp_path / "run", timeout_s=60)
    cells = [c for c in m.cells if c.world_size == 2]
    assert _ports(port, cells=cells, opts=opts) == [port] + [cell_port(port, k) for k in range(len(cells))]
    (tmp_path / "own.yaml").write_text(yaml.safe_dump(small_spec()))
    own = load_matrix(tmp_path / "own.yaml")
    mine = RunOptions(problems=own.problems, run_dir=tmp_path, timeout_s=60)
    assert _ports(port, cells=own.cells, opts=mine) == [port]


def test_a_dataset_shorter_than_a_step_is_every_step_a_short_one_not_an_ignored_split(tmp_path):
    """12 samples, a global batch of 16 (Lightning#21808's shape): the reference runs micro-batches of 12, a GA-2
    split 8 + 4 — each the whole dataset, as the reference's step. Not "ignored {micro_batch_size}": said as a
    dataset shorter than a step. Controls: a split that trained fewer samples than the reference's step, and one
    whose steps accumulate another count, are still its split's mistakes."""
    from gaeq.results.script_checks import _short_steps

    m = script_matrix(tmp_path)
    cell = next(c for c in m.cells if c.id == "script-w2-mb4-ga2")
    reference = [{"world_size": 1, "rows": [[12]], "backward": [1]}]
    short = [{"world_size": 2, "rows": [[4, 2], [4, 2]], "backward": [2, 2], "events": {"stepped:AdamW": 1}}]
    assert "ignored {micro_batch_size}" in ran_another_split(cell, short)  # alone, it looks ignored
    assert _short_steps(cell, short, reference) == (
        f"every step trained 12 of {cell.train_batch_size} rows, as the reference's did: a dataset shorter than a "
        "step (each step an epoch's short last step)"
    )
    assert _short_steps(cell, [short[0] | {"rows": [[2, 2], [2, 2]]}], reference) is None  # fewer than the reference's
    assert _short_steps(cell, [short[0] | {"rows": [[6], [6]], "backward": [1, 1]}], reference) is None  # too large
    assert _short_steps(cell, [short[0] | {"backward": [3, 3]}], reference) is None  # more micro-steps than GA


def test_a_norm_read_after_a_hand_clip_is_compared_where_both_runs_read_it_so_and_said_apart_otherwise():
    """A hand clip changes the gradients in place by no call gaeq patches: its run's norm is read after it
    (`edited`). Both runs so: compared, the reason saying whose norm it is; one only: not compared, said why, and
    the losses compared as handed to backward."""
    samples = [["a", "b"], ["c", "d"]]
    base, hand = probe(samples), probe(samples)
    for step in hand["steps"]:
        step["edited"] = True
    apart = script_checks(base, hand)
    assert "changed in place after its last backward" in apart.not_checked["grad_norm"]
    assert apart.loss_as_handed and set(apart.notes) == {"loss"}  # that change may be a clip: no rescale (#79)
    both = script_checks(hand, hand)
    assert not both.not_checked and "the gradient its optimizer received" in both.notes["grad_norm"]
    assert not both.loss_as_handed
