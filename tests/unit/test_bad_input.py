"""Bad input, thrown by hypothesis at `gaeq validate` and `gaeq run`: always exit 2 with one line
naming the problem, never a traceback, never a started process."""

from __future__ import annotations

import copy
import multiprocessing.process
import subprocess

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gaeq.cli import app
from tests.helpers import small_spec

BASE = small_spec(
    axes={"trainer": ["torch", "deepspeed"], "world_size": [1, 2], "micro_batch_size": [4], "zero_stage": [1]}
)

INT_FIELDS = [
    ("problem", "train_batch_size"), ("problem", "steps"), ("problem", "seed"),
    ("problem", "model", "hidden"), ("problem", "model", "depth"),
    ("problem", "data", "in_features"), ("problem", "data", "out_features"),
    ("axes", "world_size", 0), ("axes", "micro_batch_size", 0), ("axes", "zero_stage", 0),
]  # fmt: skip
POSITIVE_FLOATS = [("problem", "optimizer", "lr"), ("timeout_s",)]
CHOICES = [
    ("axes", "trainer", 0),
    ("problem", "optimizer", "name"),
    ("problem", "schedule", "name"),
    ("problem", "model", "kind"),
    ("problem", "dtype"),
]
REQUIRED = [("problem",), ("problem", "train_batch_size"), ("axes", "micro_batch_size"), ("name",)]
MAPPINGS = [(), ("problem",), ("problem", "model"), ("problem", "data"), ("problem", "optimizer"), ("axes",)]

junk_text = st.text(alphabet="abcxyz_-!? ", min_size=1, max_size=12)
not_a_number = st.one_of(
    junk_text, st.lists(st.integers(), max_size=3), st.dictionaries(junk_text, st.integers(), max_size=2)
)
bad_int = st.one_of(
    st.integers(max_value=0),  # zero and negative sizes (seed: negative)
    st.integers(min_value=10**7),  # above every bound: world 4096, batch 2**20, steps 1e6, widths 4096
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f != int(f)),
    not_a_number,
)
bad_float = st.one_of(st.floats(max_value=0.0), st.just(float("nan")), st.just(float("inf")), not_a_number)


def put(spec: dict, path: tuple, value) -> dict:
    spec = copy.deepcopy(spec)
    node = spec
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
    node[path[-1]] = value
    return spec


def drop(spec: dict, path: tuple) -> dict:
    spec = copy.deepcopy(spec)
    node = spec
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return spec


@st.composite
def bad_matrices(draw) -> dict:
    kind = draw(st.sampled_from(["int", "float", "choice", "missing", "unknown_key", "indivisible", "wrong_shape"]))
    if kind == "int":
        path = draw(st.sampled_from(INT_FIELDS))
        value = draw(bad_int)
        if path[-1] == "seed" and isinstance(value, int):
            value = -1 - abs(value)  # seeds may be any non-negative size
        if path[1] == "zero_stage" and isinstance(value, int):
            value = -1 - abs(value)  # 0 is a stage
        return put(BASE, path, value)
    if kind == "float":
        return put(BASE, draw(st.sampled_from(POSITIVE_FLOATS)), draw(bad_float))
    if kind == "choice":
        return put(BASE, draw(st.sampled_from(CHOICES)), draw(junk_text))
    if kind == "missing":
        return drop(BASE, draw(st.sampled_from(REQUIRED)))
    if kind == "unknown_key":
        return put(BASE, (*draw(st.sampled_from(MAPPINGS)), "zz_" + draw(junk_text)), 1)
    if kind == "indivisible":  # B = 16 on 1 or 2 ranks: micro sizes that leave a remainder
        return put(BASE, ("axes", "micro_batch_size"), [draw(st.sampled_from([3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15]))])
    return put(
        BASE,
        draw(st.sampled_from([("problem",), ("axes",), ("cells",), ("problem", "model")])),
        draw(st.one_of(junk_text, st.integers())),
    )


@pytest.fixture
def no_processes(monkeypatch):
    """Any attempt to start a process (multiprocessing, a fork server, a subprocess) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("bad input started a process")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr("multiprocessing.forkserver.ensure_running", refuse)
    monkeypatch.setattr("gaeq.runtime.launch.run_all", refuse)


def assert_bad_input(result) -> None:
    out = result.stderr.strip()
    assert result.exit_code == 2, (result.exit_code, result.stdout, out)
    assert "Traceback" not in out + result.stdout
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert len(out.splitlines()) == 1 and out.startswith("error: "), out


HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@HYPOTHESIS
@given(spec=bad_matrices())
def test_malformed_matrices_exit_2_in_one_line(spec, tmp_path, no_processes):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    runner = CliRunner()
    assert_bad_input(runner.invoke(app, ["validate", str(path)]))
    assert_bad_input(runner.invoke(app, ["run", "--matrix", str(path), "--out", str(tmp_path / "run")]))
    assert not (tmp_path / "run").exists()


@HYPOTHESIS
@given(
    blob=st.one_of(
        st.binary(min_size=1, max_size=300),
        st.builds(
            lambda v: yaml.safe_dump(v).encode(),
            st.one_of(st.lists(st.integers()), st.integers(), st.text(), st.none()),
        ),
    )
)
def test_files_that_are_not_matrices_exit_2_in_one_line(blob, tmp_path, no_processes):
    path = tmp_path / "junk.yaml"
    path.write_bytes(blob)
    for args in (["validate", str(path)], ["run", "--matrix", str(path), "--out", str(tmp_path / "run")]):
        assert_bad_input(CliRunner().invoke(app, args))


def test_a_directory_or_a_missing_file_exits_2(tmp_path, no_processes):
    for target in (tmp_path, tmp_path / "nope.yaml"):
        for args in (["validate", str(target)], ["run", "--matrix", str(target)]):
            assert_bad_input(CliRunner().invoke(app, args))


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--lanes", "0"], "--lanes 0: at least 1"),
        (["--lanes", "2", "--isolate"], "--lanes works with the local launcher only, without isolate"),
        (["--lanes", "2", "--launcher", "torchrun"], "--lanes works with the local launcher only"),
    ],
)
def test_lanes_out_of_place_are_refused_before_any_process(flags, says, tmp_path, no_processes):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(BASE))
    result = CliRunner().invoke(app, ["run", "--matrix", str(path), "--out", str(tmp_path / "run"), *flags])
    assert_bad_input(result)
    assert says in result.stderr


def test_a_world_size_this_machine_cannot_run_is_refused_before_any_process(tmp_path, no_processes):
    path = tmp_path / "big.yaml"
    path.write_text(
        yaml.safe_dump(put(put(BASE, ("axes", "world_size"), [1, 1024]), ("problem", "train_batch_size"), 4096))
    )
    result = CliRunner().invoke(app, ["run", "--matrix", str(path), "--out", str(tmp_path / "run")])
    assert_bad_input(result)
    assert "world size 1024 needs 1024 ranks on this machine" in result.stderr


def test_validate_takes_the_matrix_as_run_takes_it_too(tmp_path):
    """`gaeq run --matrix FILE`, so `gaeq validate --matrix FILE` as well as `gaeq validate FILE`; neither or
    both is bad input, in one line."""
    from typer.testing import CliRunner

    from gaeq.cli import app
    from tests.conftest import REPO

    ga = str(REPO / "experiments" / "ga.yaml")
    for args in (["validate", ga], ["validate", "--matrix", ga]):
        result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
        assert result.exit_code == 0 and "torch-w1-mb4-ga8-bug_no_loss_division" in result.output, result.output
    for args in (["validate"], ["validate", ga, "--matrix", ga]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and "give the matrix file once" in result.output, result.output
