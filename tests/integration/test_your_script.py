"""experiments/your_script.yaml's corners: a user's script, unchanged, launched by torchrun in every
cell with gaeq's probe — a world-2 split matches the baseline, and a mistake of each level is caught
at that level (data, events, numbers). (The whole
file, 10 cells, runs in docs/your-setup.md's "Check your own script".)"""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path

import pytest

from gaeq.accelerator import fp16_answer_record
from gaeq.runtime.dist import free_port
from tests.conftest import REPO
from tests.helpers import cells_by_id, not_ok
from tests.processes import leftovers, run

pytestmark = pytest.mark.integration


def test_a_users_script_matches_across_world_sizes_and_its_mistakes_are_caught_where_they_are_made(
    your_script_run,
):
    proc, report, _, _ = your_script_run
    assert proc.returncode == 0, not_ok(proc, report)
    cells = cells_by_id(report)
    clean = cells["script-w2-mb4-ga2"]
    assert clean["verdict"] == "match" and 0 < clean["max_abs_loss_diff"] < 1e-5
    # what ran, as the probe saw it in the first optimizer step (never copied from the label)
    assert {k: clean["ran"][k] for k in ("world_size", "micro_batch_rows", "micro_steps")} == {
        "world_size": 2,
        "micro_batch_rows": [4],
        "micro_steps": [2],
    }
    assert clean["divergence_steps"] == dict.fromkeys(
        ("split", "data", "init", "events", "skipped", "loss", "grad_norm", "lr", "update", "weights")
    )
    caught = {c["id"].rsplit("args_bug_", 1)[1]: (c["caught_by"], c["first_divergent_step"]) for c in cells.values()
              if "args_bug_" in c["id"]}  # fmt: skip
    assert caught == {
        "sampler_seeded_by_rank": ("data", 0),  # each rank shuffled its own way: other samples
        "clip_every_micro_step": ("events", 0),  # clip_grad_norm_ 3× in a step, the baseline once
        "token_count_averaged_twice": ("loss", 0),  # the objective halved: DDP averaged again
    }
    assert "samples missing" in cells["script-w2-mb4-ga2-args_bug_sampler_seeded_by_rank"]["reason"]
    # the objective halved, named from the split's own targets' weights: they sum to 0.5
    halved = cells["script-w2-mb4-ga2-args_bug_token_count_averaged_twice"]["weights"]
    assert halved["shape"] == "scaled" and "sum to 0.5 at step 0" in halved["line"]
    assert cells["script-w2-mb4-ga2"]["weights"]["shape"] == "mean"


def corner(tmp_path, experiment: str, bug: str) -> dict:
    """An example experiment's corner: its script at world 2, micro-batch 4 against the baseline, and
    that split with one of its mistakes — 3 steps at B = 16, its launcher and config as they are."""
    import yaml

    from tests.conftest import REPO
    from tests.helpers import gaeq_run_here

    spec = yaml.safe_load((REPO / "experiments" / experiment).read_text())
    for key in ("path", "deepspeed_config"):
        if key in spec["script"]:
            spec["script"][key] = str(REPO / "experiments" / spec["script"][key])
    spec |= {"steps": 3, "train_batch_size": 16, "noise_floor": False, "detection_limit": False}
    spec["axes"] = {"world_size": [2], "micro_batch_size": [4]}
    spec["cells"] = [{"world_size": 2, "micro_batch_size": 4, "args": ["--bug", bug], "expect": "diverge"}]
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(tmp_path / "mine.yaml", tmp_path / "run")
    assert proc.returncode == 0, not_ok(proc, report)
    return cells_by_id(report)


def test_a_users_accelerate_script_matches_and_its_scheduler_stepped_per_process_moves_the_lr(tmp_path):
    """experiments/your_accelerate_script.yaml's corner: accelerate's own loop and sharding at world 2
    against the baseline, and a prepared scheduler left to accelerate's default: the script calls it
    once per step, as the baseline does (not an event), and accelerate steps it once per process — the
    lr runs ahead, and the reason says what advanced it."""
    cells = corner(tmp_path, "your_accelerate_script.yaml", "scheduler_per_process")
    assert cells["script-w2-mb4-ga2"]["verdict"] == "match"
    assert cells["script-w2-mb4-ga2"]["ran"]["command"].startswith("accelerate launch --multi_gpu --num_processes 2")
    control = cells["script-w2-mb4-ga2-args_bug_scheduler_per_process"]
    assert (control["caught_by"], control["first_divergent_step"]) == ("lr", 1), control["reason"]
    assert control["divergence_steps"]["events"] is None
    assert (
        "the schedule advanced 2× between optimizer steps 0 and 1, the baseline's 1×: your scheduler.step() went "
        "through accelerate.scheduler.AcceleratedScheduler, which stepped the scheduler it wraps 2×"
    ) in control["reason"]


@pytest.fixture(scope="module")
def deepspeed_corner(tmp_path_factory):
    """experiments/your_deepspeed_script.yaml's corner, forked by gaeq (its cells and run directory):
    the reference of the same cells under DeepSpeed's real launcher."""
    folder = tmp_path_factory.mktemp("deepspeed_corner")
    return corner(folder, "your_deepspeed_script.yaml", "ga_one_in_config"), folder / "run"


def test_a_users_deepspeed_script_matches_and_manual_accumulation_against_ga_1_is_another_split(deepspeed_corner):
    """experiments/your_deepspeed_script.yaml's corner, under DeepSpeed's launcher (its --local_rank):
    the engine's own accumulation at world 2 against the baseline, and the script accumulating by hand
    against a config that says GA 1 (open-instruct#1498) — every engine.backward a boundary, caught as
    the split it really ran before any number is compared."""
    cells, _ = deepspeed_corner
    clean = cells["script-w2-mb4-ga2"]
    assert clean["verdict"] == "match" and clean["ran"]["command"].startswith("deepspeed --num_gpus 2")
    assert (clean["ran"]["world_size"], clean["ran"]["micro_steps"]) == (2, [2])
    # what DeepSpeed's accelerator answered to fp16 in the script's ranks (forced or not, as in this process)
    assert clean["ran"]["accelerator_fp16"] == fp16_answer_record(ask=True)
    control = cells["script-w2-mb4-ga2-args_bug_ga_one_in_config"]
    assert (control["caught_by"], control["first_divergent_step"]) == ("split", 0), control["reason"]
    assert control["reason"].startswith("AdamW stepped after every micro-batch (one backward call per step")


def without_bugs(run_dir, to, *, relative: bool = False) -> None:
    """`run_dir`'s matrix, its controls left out, written to `to`: the same cell ids (`relative`: its
    script's path relative to `to`'s folder, as a user writes it)."""
    import yaml

    spec = yaml.safe_load((run_dir / "matrix.yaml").read_text())
    spec["cells"] = [c for c in spec.get("cells") or [] if "--bug" not in c.get("args", [])]
    if relative:  # as its user writes it: `script:` at the top, its path relative to the matrix file
        problem = spec.pop("problem")
        script = problem.pop("script")
        spec |= problem | {"script": {k: v for k, v in script.items() if k != "cwd"}}
        spec["script"]["path"] = os.path.relpath(script["path"], to.parent)
    to.write_text(yaml.safe_dump(spec))


def test_a_scripts_cells_under_deepspeeds_real_launcher_leave_the_forked_traces_bitwise(deepspeed_corner, tmp_path):
    """`gaeq run --launcher deepspeed`: DeepSpeed's launcher starts each world size on `gaeq worker`, and
    each rank starts the script's rank of each cell (world 1, the baseline; world 2) — traces bitwise
    those of the ranks gaeq forked, the same verdicts, the same ran. A launcher that cannot start the
    script as its user does is bad input, before any process starts."""
    from tests.helpers import gaeq_run
    from tests.integration.test_launchers import training_traces, verdicts

    _, forked = deepspeed_corner
    without_bugs(forked, tmp_path / "m.yaml")
    proc, report, tag = gaeq_run(tmp_path / "m.yaml", tmp_path / "run", extra=["--launcher", "deepspeed"])
    assert proc.returncode == 0, not_ok(proc, report)
    assert leftovers(tag) == []
    launched, reference = training_traces(tmp_path / "run"), training_traces(forked)
    assert sorted(launched) == ["script-w1-mb16-ga1", "script-w2-mb4-ga2"]
    assert launched == {k: reference[k] for k in launched}
    assert verdicts(tmp_path / "run") == {k: verdicts(forked)[k] for k in launched}
    ran = {c["id"]: c["ran"] for c in report["cells"]}["script-w2-mb4-ga2"]
    assert (ran["world_size"], ran["micro_steps"]) == (2, [2]) and ran["launched_by"].startswith("deepspeed")
    assert "deepspeed-w2.log" in os.listdir(tmp_path / "run" / "logs")
    from typer.testing import CliRunner

    from gaeq.cli import app

    refused = CliRunner().invoke(app, ["run", "--matrix", str(tmp_path / "m.yaml"), "--launcher", "torchrun"])
    assert refused.exit_code == 2 and "--launcher torchrun: your script is started by deepspeed" in refused.output


SRUN = """#!/usr/bin/env python3
# srun, as Slurm runs a step on --nodes N with one task a node: here N "nodes" on this machine, side by side,
# each its task's command with the variables Slurm gives it; fails where one of them fails.
import os, subprocess, sys
args, nodes = sys.argv[1:], 1
while args[0].startswith("--"):
    option, value, args = args[0], args[1], args[2:]
    nodes = int(value) if option == "--nodes" else nodes
env = lambda n: os.environ | {"SLURM_NODEID": str(n), "SLURM_PROCID": str(n), "SLURM_STEP_NUM_NODES": str(nodes)}
steps = [subprocess.Popen(args, env=env(n)) for n in range(nodes)]
sys.exit(max(step.wait() for step in steps))
"""
SCONTROL = """#!/bin/sh
echo 127.0.0.1
"""


def test_the_slurm_recipe_runs_a_scripts_world_size_as_two_nodes(your_script_run, tmp_path):
    """experiments/slurm/gaeq.sbatch (docs/where-it-runs.md, "On a Slurm cluster"), run by bash as Slurm runs a
    batch script, its `srun` steps on two "nodes" of this machine (one rank each, c10d on 127.0.0.1): the
    reference at world 1, then world 2 as two torchrun agents on `gaeq worker` into one shared directory, then
    `gaeq report`, the job's exit code. Traces bitwise those of gaeq's forked ranks, the same verdicts."""
    import yaml

    from tests.integration.test_launchers import training_traces, verdicts

    *_, forked = your_script_run
    shared, bin_dir = tmp_path / "shared", tmp_path / "bin"
    without_bugs(forked, tmp_path / "m.yaml", relative=True)  # the run directory's copy must not keep it so
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text.replace("/usr/bin/env python3", sys.executable))
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "DS_ACCELERATOR": "cpu",
        "MATRIX": str(tmp_path / "m.yaml"), "OUT": str(shared), "WORLDS": "1 2", "GPUS_PER_NODE": "1",
        "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "7", "MASTER_PORT": str(free_port()),
    }  # fmt: skip
    job = run(["bash", str(REPO / "experiments" / "slurm" / "gaeq.sbatch")], timeout=600, env=env)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "OK: 1 match, 0 diverge, 0 error, 0 skipped split, relative to world 1 × micro 16, GA 1" in job.stdout
    assert os.path.isabs(yaml.safe_load((shared / "matrix.yaml").read_text())["problem"]["script"]["path"])
    ours, reference = training_traces(shared), training_traces(forked)
    assert sorted(ours) == ["script-w1-mb16-ga1", "script-w2-mb4-ga2"] and ours == {k: reference[k] for k in ours}
    assert verdicts(shared) == {k: verdicts(forked)[k] for k in ours}


def one_node(ranks: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"localhost": list(range(ranks))}).encode()).decode()


LAUNCHERS = {
    "torchrun": lambda ranks: ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)],
    # what `deepspeed --num_gpus N` runs on one node, with the environment it was given: its node launcher
    "deepspeed": lambda ranks: [
        *("-m", "deepspeed.launcher.launch"),
        *(f"--world_info={one_node(ranks)}", "--master_port=0"),
    ],
}
DUMP = """import json, os, random, signal, sys
import torch
facts = {
    "threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
    "torch_draw": torch.rand(1).item(), "random_draw": random.random(),
    "grad": torch.is_grad_enabled(), "dtype": str(torch.get_default_dtype()),
    "deterministic": torch.are_deterministic_algorithms_enabled(),
    "cwd": os.getcwd(), "path0": sys.path[0], "argv0": sys.argv[0], "umask": os.umask(0o22),
    "signals": {s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)},
}
dump = {"argv": sys.argv[1:], "env": dict(os.environ), "facts": facts}
name = f"{os.environ.get('DUMP', 'real')}-w{os.environ['WORLD_SIZE']}-{os.environ['RANK']}.json"
json.dump(dump, open(name, "w"))
"""
"""What a rank was given: its arguments and environment, and what it finds in its interpreter."""
HOW = ("real", "gaeq")
WORLDS = (1, 2)


def as_inherited() -> dict:
    """The dispositions a process started from this one inherits (what gaeq, run in it, has; what its
    user's shell would give the launcher): a signal ignored here — the suite under `nohup`, or with
    SIGINT ignored — stays ignored, every other is the default."""
    import signal

    from tests.processes import RELIED_ON

    return {s: signal.SIG_IGN if signal.getsignal(s) == signal.SIG_IGN else signal.SIG_DFL for s in RELIED_ON}


@pytest.fixture(scope="module")
def ranks_given(tmp_path_factory):
    """Each launcher's ranks at world 1 and 2 as the real launcher starts them (its own variables and
    OMP_NUM_THREADS unset from the test's environment, so that the launcher's show) and as gaeq forks them
    for a script matrix naming that launcher: launcher → {"real": {world: [rank 0, …]}, "gaeq": …}."""
    import sys
    from functools import partial

    import yaml

    from gaeq.problem.script import Launcher
    from gaeq.script.launchers import worker_env
    from tests.helpers import gaeq_run_here
    from tests.processes import new_tag, owned, side_by_side, spawn

    seen = {}
    threads = os.environ.pop("OMP_NUM_THREADS", None)  # gaeq's own environment, for its forked ranks
    folders = {launcher: tmp_path_factory.mktemp(launcher) for launcher in LAUNCHERS}

    def launch(launcher: str, world: int, tag: str):
        here = folders[launcher]
        ours = worker_env(Launcher(launcher), rank=1, world_size=2, port=0, given={})
        unset = [arg for key in [*ours, "OMP_NUM_THREADS"] if key in os.environ for arg in ("-u", key)]
        cmd = ["env", *unset, sys.executable, *LAUNCHERS[launcher](world), str(here / "dump.py"), "--mine"]
        proc = spawn(cmd, tag=tag, cwd=here, signals=as_inherited())  # as gaeq is started: by this process
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-2000:] + err[-2000:]

    try:
        for here in folders.values():
            (here / "dump.py").write_text(DUMP)
        with owned(new_tag()) as tag:  # the four launches side by side: each mostly interpreters starting
            jobs = {f"{name}-w{w}": partial(launch, name, w, tag) for name in LAUNCHERS for w in WORLDS}
            side_by_side(jobs, lanes=len(jobs))
        for launcher in LAUNCHERS:
            here = folders[launcher]
            script = {"path": "dump.py", "launcher": launcher, "args": ["--mine"], "env": {"DUMP": "gaeq"}}
            spec = {
                "name": "dump",
                "steps": 1,
                "train_batch_size": 2,
                "noise_floor": False,
                "detection_limit": False,
                "baseline": {"world_size": 1, "micro_batch_size": 2},
                "axes": {"world_size": [2], "micro_batch_size": [1]},
                "script": script,
            }
            (here / "dump.yaml").write_text(yaml.safe_dump(spec))
            gaeq_run_here(here / "dump.yaml", here / "run")  # the script steps no optimizer: its cells are errors
            seen[launcher] = {
                how: {w: [json.loads((here / f"{how}-w{w}-{r}.json").read_text()) for r in range(w)] for w in WORLDS}
                for how in HOW
            }
            seen[launcher]["before"] = dict(os.environ)
    finally:
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = threads
    return seen


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_rank_gets_what_the_real_launcher_gives_its_worker(ranks_given, launcher):
    """The real launcher starts a script that writes down its environment and arguments: gaeq's rank of
    the same world has the same variables (values apart from where they meet) and the same arguments —
    the script cannot tell gaeq's start from the launcher's. (accelerate launch on a CPU-only machine
    starts one process: its multi-process start is torchrun's, in the unit test.)"""
    from gaeq.problem.script import Launcher
    from gaeq.script.launchers import worker_args, worker_env

    for world in WORLDS:
        ours = worker_env(Launcher(launcher), rank=world - 1, world_size=world, port=0, given={})
        seen = ranks_given[launcher]["real"][world][world - 1]
        before = {k: v for k, v in ranks_given[launcher]["before"].items() if k not in ours}
        added = {k: v for k, v in seen["env"].items() if before.get(k) != v and k not in ("GAEQ_TEST_TAG", "PWD")}
        agent_only = {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE"}  # torchrun's agent, not gaeq
        assert set(added) - agent_only == set(ours), world
        where = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
        assert {k: added[k] for k in set(added) - agent_only - where} == {
            k: ours[k] for k in set(added) - agent_only - where
        }
        assert seen["argv"] == [*worker_args(Launcher(launcher), rank=world - 1), "--mine"]
        forked = ranks_given[launcher]["gaeq"][world][world - 1]
        assert forked["argv"] == seen["argv"] and {k: forked["env"][k] for k in set(ours) - where} == {
            k: seen["env"][k] for k in set(ours) - where
        }
        assert forked["env"].get("OMP_NUM_THREADS") == seen["env"].get("OMP_NUM_THREADS"), (world, ours)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_forked_rank_is_the_launchers_rank(ranks_given, launcher):
    """What a script finds in its rank — threads (torchrun: 1 for two workers on a node, a thread per
    core for one; DeepSpeed's launcher: a thread per core), its generators' first draws, torch's global
    modes, its folder and argv[0], umask, signal handlers — under the real launcher and in gaeq's forked
    ranks at world 1 and 2: the same, but for the draws, which differ between ranks and between launches as
    each fresh interpreter seeds its own (forked as they were, every rank drew the fork server's numbers)."""
    draws = ("torch_draw", "random_draw")
    given = ranks_given[launcher]
    cores = len(os.sched_getaffinity(0))
    for world in WORLDS:
        expected = 1 if launcher == "torchrun" and world > 1 else cores
        for how in HOW:
            facts = [r["facts"] for r in given[how][world]]
            assert facts[0]["threads"] == expected, (how, world, facts[0])
            if world > 1:
                assert all(facts[0][draw] != facts[1][draw] for draw in draws), how  # each rank its own seed
            real = [{k: v for k, v in r["facts"].items() if k not in draws} for r in given["real"][world]]
            assert [{k: v for k, v in f.items() if k not in draws} for f in facts] == real, (how, world)
        assert given["real"][world][0]["facts"]["torch_draw"] != given["gaeq"][world][0]["facts"]["torch_draw"]


HANGS = """import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a helper process of the script's own
open(f"started-{os.environ['RANK']}", "w").close()
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["ctrl-c", "kill -9"])
def test_stopping_gaeq_takes_every_rank_of_the_script_and_what_they_started_with_it(tmp_path, how):
    """A world-2 script that starts a helper process of its own and hangs: Ctrl-C (gaeq stops the cell)
    or kill -9 of gaeq (nothing of gaeq's cleans up: each rank watches gaeq and takes its own session
    with it) leaves nothing running."""
    import signal
    import subprocess
    import time

    import yaml

    from tests.processes import gaeq_command, leftovers, running

    (tmp_path / "hangs.py").write_text(HANGS)
    split = {"world_size": 2, "micro_batch_size": 2}
    spec = {
        "name": "hangs",
        "script": {"path": "hangs.py"},
        "steps": 2,
        "train_batch_size": 4,
        "noise_floor": False,
        "detection_limit": False,
    }
    (tmp_path / "hangs.yaml").write_text(
        yaml.safe_dump(spec | {"axes": {k: [v] for k, v in split.items()}, "baseline": split})
    )
    cmd = gaeq_command("run", "--matrix", str(tmp_path / "hangs.yaml"), "--out", str(tmp_path / "run"))
    with running(cmd, stderr=subprocess.STDOUT) as proc:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"started-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        helpers = [p for p in leftovers(proc.tag, grace=0) if b"sleep(600)" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(helpers) == 2  # the script's own processes are there to be stopped
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
            output, _ = proc.communicate(timeout=60)
            assert proc.returncode == 130, output
        else:
            proc.kill()
            proc.wait(timeout=10)
        assert leftovers(proc.tag, grace=10) == []


def test_a_mistake_in_every_split_of_your_script_is_caught_and_the_floor_never_runs_it(tmp_path):
    """experiments/your_script_every_split.yaml's corner: ddp_manual.py with its mean of micro-batch means
    ON for the whole matrix (the script's own arguments, as a user has it), sequences differing by one token
    — the baseline's split (GA 1, one rank) is clean by nature and so are the noise-floor twins, which train
    it; every other split diverges. The same splits with the mistake off (`--bug none` after it) match. Each
    group's report states its detection limit."""
    import yaml

    from tests.conftest import REPO
    from tests.helpers import gaeq_run_here

    spec = yaml.safe_load((REPO / "experiments" / "your_script_every_split.yaml").read_text())
    spec["script"]["path"] = str(REPO / "experiments" / "scripts" / "ddp_manual.py")
    spec |= {"steps": 3, "train_batch_size": 16}
    splits = [(1, 2), (1, 8), (2, 8)]  # GA 8, 2, and 1 at world 2 (a mean of the ranks' means)
    spec["cells"] = [{"world_size": w, "micro_batch_size": mb, "expect": "diverge"} for w, mb in splits]
    spec["cells"] += [{"world_size": w, "micro_batch_size": mb, "args": ["--bug", "none"]} for w, mb in splits]
    (tmp_path / "every.yaml").write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(tmp_path / "every.yaml", tmp_path / "run")
    assert proc.returncode == 0, not_ok(proc, report)
    cells = cells_by_id(report)
    for w, mb in splits:
        ga = 16 // (w * mb)
        planted, clean = cells[f"script-w{w}-mb{mb}-ga{ga}"], cells[f"script-w{w}-mb{mb}-ga{ga}-args_bug_none"]
        assert planted["verdict"] == "diverge" and planted["margin"] > 10, planted
        assert clean["verdict"] == "match" and clean["margin"] < 0.5, clean
    twins = report["noise_floors"]["fp32"]
    assert twins["twins"] == ["script-w1-mb16-ga1-floor0", "script-w1-mb16-ga1-floor1"]
    assert twins["max_abs_loss_diff"] < 1e-6  # rounding only: the mistake is not in the baseline's split
    limit = report["detection_limits"]["fp32"]
    assert limit["cell"] == "script-w1-mb16-ga1-weight1e-02" and 0 < limit["limit"] < 1e-3
    assert "Detection limit fp32: detects rows reweighed 1 ± δ (the batch's total weight unchanged) for δ ≥" in (
        proc.stdout
    )


@pytest.mark.parametrize("capacity", ["1.0", "0"])
def test_a_model_whose_output_depends_on_its_rows_order_gets_no_floor_of_it_and_says_why(tmp_path, capacity):
    """experiments/your_moe_capacity_script.yaml: a capacity-limited MoE drops other tokens when a forward
    holds other rows, so every split diverges — and so would the twins, reordering the baseline's rows:
    their order check names the cause, the floor of it sets no tolerance (it would hide what the splits
    change), and each diverging split says why. Without capacity (0) the same model matches everywhere,
    on a floor of rounding alone."""
    import yaml

    from tests.conftest import REPO
    from tests.helpers import gaeq_run_here

    spec = yaml.safe_load((REPO / "experiments" / "your_moe_capacity_script.yaml").read_text())
    spec["script"]["path"] = str(REPO / "experiments" / "scripts" / "moe_capacity.py")
    spec["script"]["args"] += ["--capacity_factor", capacity]
    verdict = "diverge" if capacity != "0" else "match"
    spec |= {"steps": 3, "cells": [{"world_size": 1, "micro_batch_size": 4, "expect": verdict}]}
    spec["cells"].append({"world_size": 2, "micro_batch_size": 16, "expect": verdict})  # each rank: half the rows
    (tmp_path / "moe.yaml").write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(tmp_path / "moe.yaml", tmp_path / "run")
    assert proc.returncode == 0, not_ok(proc, report)
    splits = [c for c in report["cells"] if c["role"] == "cell" and c["grad_accum_steps"] * c["world_size"] > 1]
    assert [c["verdict"] for c in splits] == [verdict, verdict]
    checks = [c["ran"]["order_check"] for c in report["cells"] if c["role"] == "floor"]
    assert len(checks) == 2
    if capacity == "0":
        assert all(c["row_order"] == 0.0 and c["random_draws"] == 0.0 for c in checks)  # bitwise: rounding at most
        assert report["noise_floors"]["fp32"]["causes"] == []
        return
    assert all(c["row_order"] > 1e5 and c["random_draws"] == 0.0 for c in checks), checks
    assert "fp32" not in report["noise_floors"]  # no tolerance from a drift that is the splits' own change
    assert "not by rounding: the model's output depends on the order of its rows" in proc.stdout
    for c in splits:
        assert c["margin"] > 10 and "the model's output depends on the order of its rows" in c["reason"], c
