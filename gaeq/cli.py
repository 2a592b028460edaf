"""The terminal: parse, call, print, exit code. Library code never prints; this module does.

Exit codes: 0 every verdict as expected, 1 a verdict differs, 2 bad input, 3 a run failed, 4 every run finished
but a split nothing could judge (`unjudged`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer
import yaml
from rich.console import Console
from rich.markup import escape

from gaeq import api
from gaeq.audit import deepspeed_configs
from gaeq.closing import print_overlay_command, print_result
from gaeq.files import atomic_write
from gaeq.matrix import Matrix, MatrixError
from gaeq.matrix.check import Instruments, check_command, check_matrix
from gaeq.problem.script import Launcher
from gaeq.progress import RunProgress, plan_line
from gaeq.results.render import cells_table, problem_line
from gaeq.results.report import EXIT_BAD_INPUT, EXIT_RUN_FAILED
from gaeq.runtime.ops import StaleBuild

app = typer.Typer(
    name="gaeq",
    help="Gradient-accumulation equivalence lab: train a matrix of batch splits and judge them against a baseline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Off a terminal (CI logs, pipes) rich would squeeze the table into 80 columns.
console = Console(width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


def _load(path: Path, *, check: bool = True) -> Matrix:
    """A validated matrix whose problems (plugins included) build and run a forward pass — or exit 2."""
    try:
        return api.load(path, check=check)
    except MatrixError as exc:
        message = str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}"
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None


@app.command()
def validate(
    matrix: Annotated[Path | None, typer.Argument(help="Matrix YAML file.")] = None,
    matrix_option: Annotated[
        Path | None, typer.Option("--matrix", help="The same, spelled as `gaeq run` takes it.")
    ] = None,
) -> None:
    """Validate a matrix and print its expanded cells, without training."""
    if (matrix is None) == (matrix_option is None):
        _bad_input("give the matrix file once: gaeq validate FILE, or gaeq validate --matrix FILE")
    m = _load(matrix or matrix_option)
    console.print(cells_table(m))
    console.print(problem_line(m), highlight=False)
    if m.problem.script is not None:  # what each cell runs (gaeq's probe loaded first: -m gaeq.script.attach)
        from gaeq.script.launch import command_line

        for cell in m.runnable():
            console.print(
                f"  {cell.id}: {command_line(cell, m.problem, out=Path('RUN_DIR', 'cells', cell.id))}", soft_wrap=True
            )
    from gaeq.audit import audit as audit_config
    from gaeq.audit import overrides_of

    shown: set = set()
    for where, config, cells in deepspeed_configs(m):
        findings = [f for f in audit_config(config) if f not in shown]  # variants: what differs from the first
        console.print(
            f"\n[bold]deepspeed_config of {where}[/] (gaeq audit{', what differs' if shown else ''}):", highlight=False
        )
        _print_findings(findings)
        shown.update(findings)
        for line in overrides_of(config, cells):
            console.print(f"  overridden: {line}", highlight=False)


@app.command()
def audit(config: Annotated[Path, typer.Argument(help="A DeepSpeed config file (JSON or YAML).")]) -> None:
    """What a DeepSpeed config does to gradient-accumulation equivalence, one line per finding:
    key, value, effect (breaks / risk / fine), why. Exit 0 when nothing breaks it, 1 otherwise, 2 unreadable."""
    from gaeq.audit import audit as audit_config
    from gaeq.audit import exit_code
    from gaeq.problem.dsconfig import ConfigError, read_config

    try:
        data = read_config(config)
    except ConfigError as exc:
        _bad_input(str(exc))
    findings = audit_config(data)
    _print_findings(findings)
    raise typer.Exit(exit_code(findings))


def _print_findings(findings) -> None:
    colour = {"breaks": "bold red", "risk": "yellow", "fine": "green"}
    for f in findings:
        shown = f" [dim](shown by {escape(f.evidence)})[/]" if f.evidence else ""
        console.print(
            f"  {escape(f.key)} = {escape(f.value)}: [{colour[f.effect]}]{f.effect}[/] — {escape(f.why)}{shown}",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
def run(
    matrix: Annotated[Path, typer.Option("--matrix", "-m", help="Matrix YAML file.")],
    out: Annotated[Path | None, typer.Option("--out", help="Run directory. Default: runs/<name>-<time>.")] = None,
    isolate: Annotated[
        bool,
        typer.Option(
            "--isolate", help="A fresh process group per cell (one launch per config), not one per world size."
        ),
    ] = False,
    launcher: Annotated[
        str,
        typer.Option(
            "--launcher",
            help="Who starts the ranks: local (gaeq itself), torchrun or deepspeed (that launcher, once per world "
            "size, on `gaeq worker` — the code path of a cluster).",
        ),
    ] = "local",
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="--out holds an interrupted run of this matrix: train only the cells it did not finish."
        ),
    ] = False,
    lanes: Annotated[
        int | None,
        typer.Option(
            "--lanes",
            help="At most this many process groups of one world size side by side, each on cores of its own "
            "(default: as many as the cores hold; 1: one after another).",
        ),
    ] = None,
) -> None:
    """Train every cell of a matrix, compare each with its baseline, print the verdicts."""
    from gaeq.runtime.cells import check_launch

    try:
        check_launch(launcher=launcher, isolate=isolate, lanes=lanes)
    except ValueError as exc:
        _bad_input(f"--{exc}")  # the rule names the option first: `--lanes 0: at least 1`
    if resume and out is None:
        _bad_input("--resume needs --out: the run directory to resume")
    m = _load(matrix, check=False)  # the problems are checked by api.run, once the ranks' fork server is starting
    _stop_on_signals()
    _print_overrides(m)  # a user's DeepSpeed config is never overridden silently
    console.print(plan_line(m), highlight=False)  # the cost before it is spent
    with RunProgress(console, cells=len(m.runnable()), steps=m.problem.steps, tried=m.candidates) as on_event:
        named = out is None
        try:
            out = out or api.new_run_dir(m.spec.name)  # named here, so that an interruption can say where
            result = api.run(
                m, out=out, isolate=isolate, launcher=launcher, lanes=lanes, resume=resume, on_event=on_event
            )
        except FileExistsError as exc:
            _bad_input(str(exc))
        except MatrixError as exc:
            if named:  # the directory named above, empty: a refused run leaves none behind
                api.discard_unused(out)
            _bad_input(f"{matrix}: {exc}")
        except StaleBuild as exc:  # a killed build's lock: named with the command that clears it, never waited on
            if named:  # the directory named above, empty: a refused run leaves none behind
                api.discard_unused(out)
            err_console.print(f"[bold red]error[/]: {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_RUN_FAILED) from None
        except KeyboardInterrupt:
            err_console.print(
                "[bold red]interrupted[/]: every rank was stopped; finished cells are kept, no report written "
                f"— continue with: gaeq run --matrix {matrix} --out {out} --resume",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(130) from None

    code = print_result(console, result)
    print_overlay_command(console, result)
    raise typer.Exit(code)


SPLIT = re.compile(r"^w(\d+):mb(\d+)$")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def check(
    ctx: typer.Context,
    script: Annotated[Path, typer.Argument(help="Your training script.")],
    split: Annotated[
        list[str], typer.Option("--split", help="A split to check, e.g. w2:mb4 (world 2, micro batch 4); repeatable.")
    ],
    batch: Annotated[int, typer.Option("--batch", min=1, help="The global batch (train_batch_size).")],
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps compared.")] = 5,
    out: Annotated[Path | None, typer.Option("--out", help="Run directory. Default: runs/check-<time>.")] = None,
    launcher: Annotated[Launcher, typer.Option("--launcher", help="How you start the script today.")] = (
        Launcher.TORCHRUN
    ),
    deepspeed_config: Annotated[
        Path | None,
        typer.Option("--deepspeed-config", help="Your DeepSpeed config: each split gets a copy with its batch triple."),
    ] = None,
    baseline: Annotated[
        str | None,
        typer.Option(
            "--baseline",
            help="The reference the splits are compared with: a split (w2:mb8); auto — world 1 with the whole batch, "
            "else GA 1 at the largest micro batch a split ran at; none — each split judged by its targets' weights.",
        ),
    ] = None,
    instruments: Annotated[
        Instruments,
        typer.Option(
            "--instruments",
            help="Runs of the reference that measure the verdicts: its noise floor (2 twins), its detection limit "
            "(1), all or none. Without the floor, tolerances are the constants; without the limit, none is stated.",
        ),
    ] = Instruments.ALL,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="The runs, e.g. fp32,bf16: fp32 (the default) switches off your script's autocast and loss scaler — "
            "its sharpest run; bf16 or fp16 judges it as it trains.",
        ),
    ] = None,
) -> None:
    """Your training script, unchanged, under each split: `gaeq check train.py --batch 32 --split w1:mb4
    --split w2:mb4 -- --batch_size {micro_batch_size} --grad_accum {grad_accum_steps}`. The arguments
    after `--` are the script's ({name} filled per split); a script matrix is written for you into the
    run directory and run as `gaeq run` runs one."""
    spec = check_matrix(
        script,
        script_args=ctx.args,
        batch=batch,
        splits=[_split(given, option="--split") for given in split],
        steps=steps,
        launcher=launcher,
        deepspeed_config=deepspeed_config,
        baseline=baseline if baseline in (None, "auto", "none") else _split(baseline, option="--baseline"),
        instruments=instruments,
        dtypes=dtype.split(",") if dtype else (),
    )
    out = out or api.new_run_dir("check")
    out.mkdir(parents=True, exist_ok=True)
    matrix = out / "check.yaml"
    atomic_write(matrix, yaml.safe_dump(spec, sort_keys=False))
    try:
        run(matrix=matrix, out=out)
    finally:  # (it exits with the verdicts' code) where the reference ran out of memory: the command that fits
        report = out / "report.json"
        for world, micro in (json.loads(report.read_text())["fits"] if report.is_file() else {}).values():
            fits = check_command(spec, baseline=f"w{world}:mb{micro}")
            console.print(f"Rerun with a reference that fits: {fits}", highlight=False, soft_wrap=True)


def _split(given: str, *, option: str) -> tuple[int, int]:
    """`w2:mb4` → (world size, micro batch), or exit 2 saying how to write it."""
    if not (found := SPLIT.match(given)):
        _bad_input(f"{option} {given}: write it as w<world size>:mb<micro batch>, e.g. w2:mb4")
    return int(found[1]), int(found[2])


def _print_overrides(m: Matrix) -> None:
    """What each cell changes in a user's DeepSpeed config, one line per key; and what it trains with (the lr its
    scheduler gives, where that is not what the file seems to say)."""
    # (the overrides need no torch; what a config's schedule trains with imports DeepSpeed's scheduler, once)
    from gaeq.audit import overrides_of, trains_with

    for where, config, cells in deepspeed_configs(m):
        for line in overrides_of(config, cells):
            console.print(f"deepspeed_config of {where}, overridden: {line}", highlight=False, soft_wrap=True)
        for finding in trains_with(config):
            console.print(f"deepspeed_config of {where}, trains with: {finding.line}", highlight=False, soft_wrap=True)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `gaeq run`.")],
    atol: Annotated[float | None, typer.Option("--atol", min=0, help="Loss tolerance, absolute (every dtype).")] = None,
    rtol: Annotated[float | None, typer.Option("--rtol", min=0, help="Loss tolerance, relative (every dtype).")] = None,
    grad_rtol: Annotated[
        float | None, typer.Option("--grad-rtol", min=0, help="Grad-norm tolerance, relative.")
    ] = None,
    tensor_atol: Annotated[
        float | None, typer.Option("--tensor-atol", min=0, help="Params/grads tolerance, absolute.")
    ] = None,
    tensor_rtol: Annotated[
        float | None, typer.Option("--tensor-rtol", min=0, help="Params/grads tolerance, relative.")
    ] = None,
) -> None:
    """Re-judge a finished run from its saved traces (e.g. with other tolerances), without training."""
    try:
        result = api.open_run(
            run_dir,
            loss_atol=atol,
            loss_rtol=rtol,
            grad_norm_rtol=grad_rtol,
            tensor_atol=tensor_atol,
            tensor_rtol=tensor_rtol,
        )
    except MatrixError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    raise typer.Exit(print_result(console, result))


@app.command()
def worker(
    matrix: Annotated[Path, typer.Option("--matrix", "-m", help="Matrix YAML file (the same on every rank).")],
    out: Annotated[Path, typer.Option("--out", help="Run directory, on a filesystem every node shares.")],
    cell: Annotated[list[str], typer.Option("--cell", help="Run only these cells (repeatable).")] = [],  # noqa: B006
    search: Annotated[
        list[str], typer.Option("--search", help="Another folder to import plugins from (repeatable).")
    ] = [],  # noqa: B006
) -> None:
    """One rank under an external launcher (torchrun, deepspeed): run the matrix's cells of the launched world size.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the launcher; rank 0 writes traces
    into OUT. Cells from scratch run first, then resumed cells whose source finished in OUT (this launch or
    an earlier one). Judge with `gaeq report OUT`.
    """
    import dataclasses

    from gaeq.matrix import MATRIX_FILE
    from gaeq.results.report import record_versions
    from gaeq.runtime import dist, lifeline, worker
    from gaeq.runtime.external import cells_for_launch, launched_main

    try:
        me = dist.rank_from_env()
    except ValueError as exc:
        _bad_input(str(exc))
    lifeline.bind_to_parent()  # started by `gaeq run --launcher …`: gone when that gaeq is
    m = _load(matrix)
    m = dataclasses.replace(m, plugin_dirs=m.plugin_dirs + tuple(search))
    try:
        cells_for_launch(m, world_size=me.world_size, only=cell)
    except ValueError as exc:
        _bad_input(f"{matrix}: {exc}")
    out.mkdir(parents=True, exist_ok=True)
    if me.rank == 0 and not (out / MATRIX_FILE).exists():
        api.write_matrix(out, m)  # as validated (absolute paths); other ranks may read it: never half-written
        record_versions(out)
    code = launched_main(matrix=m, run_dir=out, only=cell)
    # Every outcome is written: leave without the interpreter's and C++'s teardown, where a
    # native thread still alive at exit (gloo's, the shm op's) can abort a finished rank with
    # "terminate called without an active exception" — gaeq's own ranks leave the same way.
    worker.hard_exit(code)


def main() -> NoReturn:
    """The `gaeq` program: run the command, then leave without the interpreter's teardown.

    Everything a command writes is written and closed when it returns (atomically, gaeq.files);
    what is left is finalising an interpreter that has imported torch: time at the end of every
    `gaeq run` spent on nothing. (The typer `app` itself, e.g. under CliRunner, returns normally.)"""
    try:
        app()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    with contextlib.suppress(OSError):  # a closed pipe (`gaeq run | head`) has nothing to flush to
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _stop_on_signals() -> None:
    """SIGTERM (`kill`, schedulers, CI) and SIGHUP (the terminal closed) stop a run like Ctrl-C:
    KeyboardInterrupt, then the launcher's clean-up kills every rank. A signal the run was started
    with ignored stays ignored, as every Unix program does: SIGINT for a background job (`cmd &` in
    a script — a stray Ctrl-C in its terminal must not stop it), SIGHUP under nohup."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.default_int_handler)
    # SIGINT: Python installs KeyboardInterrupt itself unless the signal was inherited ignored.


def _bad_input(message: str) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_BAD_INPUT)
