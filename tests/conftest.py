from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.workers import group_sharing_files, is_controller, pin_to_a_core, scheduler

REPO = Path(__file__).resolve().parents[1]
TRAINING_TESTS = (REPO / "tests" / "integration", REPO / "tests" / "notebooks")


def busy_ticks() -> tuple[int, int] | None:
    """(all, idle) clock ticks of every core since boot, from /proc/stat (benchmarks/suite_time.py reads them per
    test); None where there is none."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(t) for t in stat.readline().split()[1:]]
    except OSError:
        return None
    return sum(ticks), ticks[3] + ticks[4]  # idle and iowait


def busy_seconds(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Busy core-seconds between two :func:`busy_ticks` readings (None where either is missing)."""
    if before is None or after is None:
        return None
    return ((after[0] - before[0]) - (after[1] - before[1])) / os.sysconf("SC_CLK_TCK")


STARTED: list[tuple[int, int] | None] = []


def pytest_terminal_summary(terminalreporter):
    """Every run ends with the machine's busy core-seconds over it: the suite's work, its budget (README, Tests) —
    measured on a machine doing nothing else."""
    busy = busy_seconds(STARTED[0], busy_ticks()) if STARTED else None
    if busy is not None:
        terminalreporter.write_line(f"busy core-seconds: {busy:.0f} (the suite's work; README, Tests)")


def pytest_configure(config):
    """`-n 2` (pytest-xdist): each worker runs on a core of its own, with everything it starts; the files that share
    a session's run go to one worker together (tests/workers.py). A worker names each test's group in its node id,
    as xdist's `--dist loadgroup` has it do, whatever `--dist`."""
    if hasattr(config, "workerinput"):
        config.option.loadgroup = True
        pin_to_a_core(config.workerinput)


def pytest_collection_finish(session):
    """An xdist worker computes on one thread (torch's intra-op pool; the processes it starts keep theirs): it runs on
    one core (tests/workers.py). torch sizes its pool from the affinity it finds when imported after the pinning; a
    plugin that imported it first would leave a pool of every core's threads waiting on one core. (Set once the tests
    are collected: torch is imported by then, and the session's fork server started first.)"""
    if hasattr(session.config, "workerinput"):
        import torch

        torch.set_num_threads(1)


def pytest_sessionstart(session):
    """A session that will train starts its fork server now (tests/processes.py): its imports of
    torch, DeepSpeed and transformers overlap the collection of the tests. One that will not — its
    paths hold no training test, or its marks leave the integration tests out (the edit loop, `-m "not
    integration"`) — starts none: those imports would take a core from the tests that run."""
    STARTED.append(busy_ticks())
    config = session.config
    if is_controller(config):  # xdist's controller trains nothing: each worker starts its own server
        return
    paths = [Path(config.invocation_params.dir, arg.split("::")[0]).resolve() for arg in config.args]
    if not any(p == d or p in d.parents or d in p.parents for p in paths for d in TRAINING_TESTS):
        return
    if config.option.markexpr:
        from _pytest.mark.expression import Expression  # how pytest's -m reads its expression

        if not Expression.compile(config.option.markexpr).evaluate(lambda name, **_: name == "integration"):
            return
    from tests.processes import start_session_fork_server

    start_session_fork_server()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups it marks
def pytest_collection_modifyitems(items):
    """The test of a DeepSpeed op's first build goes first: on a fresh machine the build it makes is the
    one every later DeepSpeed cell of the suite would otherwise pay (tests/integration/test_first_use_builds.py).
    The files that share a session's run are grouped for one worker (tests/workers.py)."""
    items.sort(key=lambda item: item.get_closest_marker("first_use_build") is None)
    group_sharing_files(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The suite's units of work for xdist: a file, or the files that share a run (tests/workers.py)."""
    return scheduler(config, log)


@pytest.fixture(scope="session", autouse=True)
def cli_built_once():
    """typer builds the click command from gaeq's app anew on every `CliRunner().invoke` (~20 ms, most
    of an in-process call): the app does not change during a session, so it is built once."""
    import functools

    import typer.testing

    build = typer.testing._get_command
    typer.testing._get_command = functools.cache(build)
    yield
    typer.testing._get_command = build


@pytest.fixture
def write_matrix(tmp_path):
    """Write a matrix dict as YAML; return its path."""

    def write(spec: dict, name: str = "matrix.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path

    return write


@pytest.fixture(scope="session")
def notebooks_run(tmp_path_factory):
    """Every notebook executed once for the session as a user runs it (tests/kernels.py): {stem: Executed},
    and the folder their runs went to."""
    from tests.kernels import execute_all

    tmpdir = tmp_path_factory.mktemp("kernels")
    return execute_all(tmpdir), tmpdir


@pytest.fixture(scope="session")
def pitfalls_run(notebooks_run):
    """`experiments/pitfalls.yaml` as notebook 4 runs it (`gaeq.run` of the file as it is, in its own kernel):
    tests/integration/test_pitfalls.py checks that run — the same run a reader of the notebook gets, not a
    second one (so test_pitfalls.py alone executes the five notebooks). (report.json, the run directory)."""
    import json

    from tests.kernels import run_of

    executed, tmpdir = notebooks_run
    out = run_of(tmpdir, "04_pitfalls")
    if not (out / "report.json").exists():
        pytest.fail(f"notebook 04 left no judged run in {out}: {executed['04_pitfalls'].error}")
    return json.loads((out / "report.json").read_text()), out


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """`gaeq run --matrix experiments/ga.yaml` (the README's), its cells as they are at the suite's size
    (tests/helpers.py: ga_at_test_size), once per session, through the CLI on the session's fork server. Its
    traces are the reference of the tests that run some of its cells another way (--isolate and external
    launchers, in child processes of their own): a cell's trace depends only on its problem and split, so
    theirs must be bitwise these."""
    from tests.helpers import ga_at_test_size, gaeq_run_here

    folder = tmp_path_factory.mktemp("default")
    (folder / "ga.yaml").write_text(yaml.safe_dump(ga_at_test_size(), sort_keys=False))
    proc, report, tag = gaeq_run_here(folder / "ga.yaml", folder / "run")
    return proc, report, tag, folder / "run"


@pytest.fixture(scope="session")
def your_script_run(tmp_path_factory):
    """experiments/your_script.yaml's corners, once per session: its script at world 2 against the
    baseline, and one mistake per level (data, events, numbers) — tests/integration/test_your_script.py
    checks it (notebook 5 runs the whole file, as its reader does)."""
    import yaml

    from tests.helpers import gaeq_run_here

    spec = yaml.safe_load((REPO / "experiments" / "your_script.yaml").read_text())
    spec["script"]["path"] = str(REPO / "experiments" / "scripts" / "ddp_manual.py")
    spec |= {"steps": 3, "train_batch_size": 16, "noise_floor": False, "detection_limit": False}
    spec["axes"] = {"world_size": [2], "micro_batch_size": [4]}
    spec["cells"] = [
        {"world_size": 2, "micro_batch_size": 4, "args": ["--bug", bug], "expect": "diverge"}
        for bug in ("sampler_seeded_by_rank", "clip_every_micro_step", "token_count_averaged_twice")
    ]
    folder = tmp_path_factory.mktemp("your_script")
    (folder / "your_script.yaml").write_text(yaml.safe_dump(spec))
    proc, report, tag = gaeq_run_here(folder / "your_script.yaml", folder / "run")
    return proc, report, tag, folder / "run"


@pytest.fixture(scope="session")
def universal_run(tmp_path_factory):
    """`gaeq run experiments/universal.yaml`, once per session: tests/integration/test_universal.py checks it
    (notebook 3 trains its own resize experiment, a part of it at 24 steps, as its reader does)."""
    from tests.helpers import gaeq_run_here

    out = tmp_path_factory.mktemp("universal") / "run"
    proc, report, tag = gaeq_run_here(REPO / "experiments" / "universal.yaml", out)
    return proc, report, tag, out
