"""How fast the lab itself is. One run, one machine; prints the numbers and the ratios.

    python benchmarks/lab_speed.py            # ~8 minutes on 2 cores (~5 with --skip-isolate)
    python benchmarks/lab_speed.py --tiny     # every phase at its smallest, for the suite: its numbers mean nothing

1. The default matrix (experiments/ga.yaml) with one process group per world size (what `gaeq run`
   does) against `--isolate` (one fresh group per cell: one launch per config). A reused run whose wall were
   its cells' summed in-loop time would reach isolate ÷ in-loop: target ≥ 90 % of that.
2. Whole-matrix wall time against the summed in-loop training time of its cells. Target: ≤ 1.10×.
   And the price of lanes (world-1 groups side by side, each on a core of its own) for the cost
   columns: each world-1 cell's step time against the same cell in a `--lanes 1` run.
3. The torch trainer's optimizer step against a bare PyTorch loop on the same model and batches (target: ≤ 1.10×
   a bare loop that generates its batches as it goes),
   and what recording costs on top of it (trace, comm counting, memory). Target: ≤ 5 % of a bare step.
4. The peer way of checking: one launch of a plain DeepSpeed script (benchmarks/plain_deepspeed.py,
   under DeepSpeed's launcher) per configuration, for 8 ZeRO × GA configurations at world 2, against
   one `gaeq run` of the same 8 cells (and its baseline). Target: ≥ 8× per configuration (a launch's start-up
   is most of it; even a gaeq run that were nothing but its training would be ~15× faster).

`--tiny` runs every phase with the same code at its smallest — a matrix of the baseline alone, 5 steps
(the schedule's warm-up), one peer configuration, one repeat — in seconds: the suite runs it
(tests/integration/test_benchmarks.py), so that a rename breaks a test, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = "tiny run (--tiny): every phase at its smallest sizes, to keep the code working — its numbers mean nothing"
TINY_STEPS = 5
"""The fewest steps a matrix of experiments/ga.yaml's problem may have: its schedule warms up over 5."""


def run_matrix(matrix: Path, out: Path, *extra: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gaeq", "run", "--matrix", str(matrix), "--out", str(out), *extra],
                   check=True, stdout=subprocess.DEVNULL, cwd=REPO)  # fmt: skip
    return time.perf_counter() - started


def tiny_matrix(matrix: Path, folder: Path) -> Path:
    """`matrix` cut to its baseline alone (no twin), TINY_STEPS steps: every phase's code, in seconds."""
    import yaml

    spec = yaml.safe_load(matrix.read_text())
    spec["problem"]["steps"] = TINY_STEPS
    spec["axes"] = {"trainer": ["torch"], "world_size": [1], "micro_batch_size": [spec["problem"]["train_batch_size"]]}
    spec["noise_floor"] = spec["detection_limit"] = False  # the baseline alone: no instrument beside it
    spec.pop("cells", None), spec.pop("variants", None)
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


PEER_CONFIGS = [(zero, micro) for micro in (4, 8) for zero in (0, 1, 2, 3)]
"""ZeRO stage × micro-batch at world 2, B = 32: GA 4 and GA 2."""


def peer_comparison(*, steps: int, configs: list[tuple[int, int]], tiny: bool) -> tuple[float, float, float, float]:
    """Seconds: one `gaeq run` of the configurations and its cells' summed in-loop training; one
    launch of the plain script each, and their summed training loops."""
    import yaml

    from gaeq.runtime.dist import free_port
    from gaeq.runtime.shm import release_shm_buffers

    with tempfile.TemporaryDirectory() as tmp:
        spec = yaml.safe_load((REPO / "experiments" / "ga.yaml").read_text())
        spec["problem"]["steps"] = steps
        spec["cells"] = [
            {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": micro, "zero_stage": zero}
            for zero, micro in configs
        ]
        spec.pop("axes", None), spec.pop("variants", None)
        spec["detection_limit"] = False  # the cells, their baseline and its twins: what this measured before the limit
        spec["noise_floor"] = not tiny  # (tiny: the code of every phase, not its numbers — no twin)
        matrix = Path(tmp) / "peer.yaml"
        matrix.write_text(yaml.safe_dump(spec))
        gaeq = run_matrix(matrix, Path(tmp) / "run")
        gaeq_loop = in_loop_seconds(Path(tmp) / "run")
    launches = peer_loop = 0.0
    failed: list[str] = []
    for zero, micro in configs:
        started = time.perf_counter()
        # A port of its own per launch: the previous launch's may still be held (TIME_WAIT).
        port = free_port()
        proc = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_local_rank",
                               "--master_port", str(port), str(REPO / "benchmarks" / "plain_deepspeed.py"),
                               "--zero", str(zero), "--micro", str(micro), "--steps", str(steps),
                               *(["--tiny"] if tiny else [])], capture_output=True,
                              text=True, cwd=REPO, env={**os.environ, "DS_ACCELERATOR": "cpu"})  # fmt: skip
        launches += time.perf_counter() - started
        # DeepSpeed's CPU comm op leaves a 66 MB segment per rank in /dev/shm that nothing frees
        # (gaeq frees its own groups'): the launch is over, so its segments go here.
        release_shm_buffers(port=port)
        trained = re.search(r"trained in ([\d.]+) s", proc.stdout)
        if trained is None:  # it did not train: nothing of it can be compared
            sys.exit(
                f"plain_deepspeed.py --zero {zero} --micro {micro} failed "
                f"({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        peer_loop += float(trained.group(1))
        if proc.returncode != 0:  # trained, then died at exit: counted (its time was spent), and said
            failed.append(
                f"--zero {zero} --micro {micro} (exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]})"
            )
    for launch in failed:
        print(f"  note: plain_deepspeed.py {launch} finished training, then failed at exit")
    return gaeq, gaeq_loop, launches, peer_loop


def step_seconds(run_dir: Path) -> dict[str, float]:
    """Each cell's median step time, as its cost columns report it."""
    return {c["id"]: c["step_seconds"] for c in json.loads((run_dir / "report.json").read_text())["cells"]}


def in_loop_seconds(run_dir: Path) -> float:
    total = 0.0
    for trace in run_dir.glob("cells/*/trace.jsonl"):
        total += sum(json.loads(line)["seconds"] for line in trace.read_text().splitlines())
    return total


def bare_vs_trainer(*, steps: int, repeats: int) -> dict[str, float]:
    """Seconds per optimizer step: bare loop, data generation alone, the gaeq trainer (with and without recording)."""
    import torch
    import yaml

    from gaeq.matrix import load_matrix
    from gaeq.problem.build import build_problem
    from gaeq.problem.loss import mse_sum
    from gaeq.problem.optim import build_optimizer, build_scheduler
    from gaeq.trainers import RunContext, trainer_for
    from gaeq.trainers import base as trainer_base
    from gaeq.trainers.recorder import StepRecorder

    torch.set_num_threads(1)
    folder = tempfile.TemporaryDirectory()
    tmp = Path(folder.name)
    spec = yaml.safe_load((REPO / "experiments" / "ga.yaml").read_text())
    spec["problem"]["steps"] = steps
    spec["axes"] = {"trainer": ["torch"], "world_size": [1], "micro_batch_size": [8]}
    spec.pop("cells", None), spec.pop("variants", None)
    (tmp / "m.yaml").write_text(yaml.safe_dump(spec))
    matrix = load_matrix(tmp / "m.yaml")
    cell = next(c for c in matrix.cells if c.micro_batch_size == 8)
    problem = matrix.problem
    plan = trainer_base.plan_of(cell, problem)  # the samples the trainer's cell sees
    ga = plan.grad_accum_steps

    def generate():
        built = build_problem(problem)
        return built, [
            [built.dataset.batch(plan.sample_indices(step=s, micro_step=k, rank=0)) for k in range(ga)]
            for s in range(steps)
        ]

    def bare(*, inline: bool = False) -> float:
        """The same training without gaeq: batches made beforehand, or (`inline`) as it goes — as
        any real loop loads its data between steps, and as the trainer does."""
        built, batches = generate()
        model = built.model
        optimizer = build_optimizer(model.named_parameters(), problem)
        scheduler = build_scheduler(optimizer, problem)
        ended = []
        for step in range(steps):
            for k in range(ga):
                x, y = (
                    built.dataset.batch(plan.sample_indices(step=step, micro_step=k, rank=0))
                    if inline
                    else batches[step][k]
                )
                (mse_sum(model(x), y) / cell.train_batch_size).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), problem.gradient_clipping)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            ended.append(time.perf_counter())
        return per_step(ended)

    def data_only() -> float:
        started = time.perf_counter()
        generate()
        return (time.perf_counter() - started) / steps

    def trainer() -> float:
        """Seconds a step, as the bare loops are timed: from the end of the first step to the end of the
        last (its recording included; the cell's set-up and closing are the matrix's wall, measured apart)."""
        cell_dir = tmp / f"cell-{time.perf_counter_ns()}"
        cell_dir.mkdir()
        ended: list[float] = []
        ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"), cell_dir=cell_dir, run_dir=tmp,
                         on_step=lambda step: ended.append(time.perf_counter()))  # fmt: skip
        started = time.perf_counter()
        trainer_for("torch")(cell=cell, problem=problem, ctx=ctx)
        total = time.perf_counter() - started
        loop = per_step(ended)
        setup.append(total - loop * (steps - 1))
        return loop

    def recording(calls: int = 2000) -> float:
        """One step's recording (trace line, loss reduction, comm and memory counters), timed alone:
        inside a whole step it is below the run-to-run noise of the step itself."""
        cell_dir = tmp / f"rec-{time.perf_counter_ns()}"
        cell_dir.mkdir()
        ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"), cell_dir=cell_dir, run_dir=tmp)
        recorder = StepRecorder(cell=cell, ctx=ctx, steps=calls, plan=plan)
        started = time.perf_counter()
        for step in range(calls):
            recorder.record(step=step, local_loss_sum=1.0, normaliser=32, grad_norm=1.0, lr=1e-3, seconds=1e-3)
        elapsed = (time.perf_counter() - started) / calls
        recorder.close()
        return elapsed

    setup: list[float] = []  # each trainer call's seconds outside its steps 1..n-1 (its first step, set-up, close)
    measures = {
        "bare": bare,
        "data": data_only,
        "floor": lambda: bare(inline=True),
        "trainer": trainer,
        "recording": recording,
    }
    with folder:
        for fn in measures.values():
            fn()  # warm-up
        results: dict[str, list[float]] = {name: [] for name in measures}
        for _ in range(repeats):  # interleaved, so that drift hits every measure alike
            for name, fn in measures.items():
                results[name].append(fn())
    medians = {name: statistics.median(values) for name, values in results.items()}
    # the trainer against the floor timed beside it, repeat by repeat: a drift of the machine's speed over
    # the run (a VM's neighbours) moves both alike and leaves the ratio
    ratio = statistics.median(t / f for t, f in zip(results["trainer"], results["floor"], strict=True))
    return medians | {"setup": statistics.median(setup), "ratio": ratio}


def per_step(ended: list[float]) -> float:
    """Seconds a step from the times steps ended: the first step left out (the optimizer's state made, the
    trainer's first-step checks), as in every loop timed here."""
    return (ended[-1] - ended[0]) / (len(ended) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", type=Path, default=REPO / "experiments" / "ga.yaml")
    parser.add_argument(
        "--skip-isolate", action="store_true", help="Only the in-process measurements and one reuse run."
    )
    parser.add_argument("--steps", type=int, default=None, help=f"The trainer's steps: 100 ({TINY_STEPS} with --tiny).")
    parser.add_argument("--repeats", type=int, default=None, help="The trainer's repeats: 7 (1 with --tiny).")
    parser.add_argument(
        "--skip-peer", action="store_true", help="Leave out the one-launch-per-configuration comparison (~2 min)."
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="Every phase at its smallest (the matrix's baseline alone, 5 steps, one peer configuration, one "
        "repeat): seconds, for the suite — its numbers mean nothing.",
    )
    args = parser.parse_args()
    if args.tiny:
        print(TINY, flush=True)
    steps = args.steps or (TINY_STEPS if args.tiny else 100)
    repeats = args.repeats or (1 if args.tiny else 7)
    peer_steps, peer_configs = (TINY_STEPS, PEER_CONFIGS[:1]) if args.tiny else (50, PEER_CONFIGS)

    with tempfile.TemporaryDirectory() as tmp:
        matrix = tiny_matrix(args.matrix, Path(tmp)) if args.tiny else args.matrix
        reuse = run_matrix(matrix, Path(tmp) / "reuse")
        loop = in_loop_seconds(Path(tmp) / "reuse")
        print(
            f"default matrix, process groups reused (lanes side by side): {reuse:.1f} s wall; "
            f"summed in-loop training {loop:.1f} s → wall / in-loop = {reuse / loop:.2f} (target ≤ 1.10)"
        )
        one = run_matrix(matrix, Path(tmp) / "one-lane", "--lanes", "1")
        one_loop = in_loop_seconds(Path(tmp) / "one-lane")
        print(f"the same with --lanes 1 (groups one after another): {one:.1f} s wall; in-loop {one_loop:.1f} s "
              f"→ wall / in-loop = {one / one_loop:.2f}")  # fmt: skip
        laned, alone = step_seconds(Path(tmp) / "reuse"), step_seconds(Path(tmp) / "one-lane")
        w1 = [
            c["id"]
            for c in json.loads((Path(tmp) / "reuse" / "report.json").read_text())["cells"]
            if c["world_size"] == 1
        ]
        ratios = sorted(laned[i] / alone[i] for i in w1)
        print(
            "cost columns: world-1 cells' step time in a lane ÷ with --lanes 1: median "
            f"{statistics.median(ratios):.2f} "
            f"(from {ratios[0]:.2f} to {ratios[-1]:.2f}, {len(ratios)} cells; run-to-run noise of one cell is of "
            "that order)"
        )
        if not args.skip_isolate:
            isolate = run_matrix(matrix, Path(tmp) / "isolate", "--isolate")
            # A reuse whose wall were its cells' summed in-loop time would reach isolate ÷ in-loop.
            print(
                f"default matrix, --isolate: {isolate:.1f} s wall → isolate / reuse = {isolate / reuse:.1f}×; a reuse "
                f"whose wall were its in-loop time would reach {isolate / loop:.1f}×: reached {loop / reuse:.0%} of it "
                "(target ≥ 90 %)"
            )

    if not args.skip_peer:
        gaeq, gaeq_loop, launches, peer_loop = peer_comparison(steps=peer_steps, configs=peer_configs, tiny=args.tiny)
        n = len(peer_configs)
        print(
            f"peer check, {n} ZeRO × GA configurations at world 2, {peer_steps} steps: one launch each of a plain "
            f"DeepSpeed script {launches:.1f} s ({launches / n:.1f} s a configuration) vs one gaeq run {gaeq:.1f} s "
            f"({gaeq / n:.2f} s a configuration) → {launches / gaeq:.1f}× per configuration (target ≥ 8×)"
        )
        print(
            f"  training loops alone: the launches' {peer_loop:.1f} s, gaeq's cells' {gaeq_loop:.1f} s → even a gaeq "
            "run "
            f"that were nothing but its training would be {launches / gaeq_loop:.1f}× faster per configuration"
        )

    t = bare_vs_trainer(steps=steps, repeats=repeats)
    ms = {k: v * 1e3 for k, v in t.items()}
    overhead = t["recording"] / t["bare"]
    print(
        f"per optimizer step (MLP, B=32, GA 4, 1 thread): bare loop {ms['bare']:.2f} ms; data generation alone "
        f"{ms['data']:.2f} ms; "
        f"bare loop generating its batches as it goes {ms['floor']:.2f} ms; gaeq trainer {ms['trainer']:.2f} ms"
    )
    print(
        f"gaeq trainer ÷ bare loop generating as it goes = {t['ratio']:.2f}× (target ≤ 1.10; the median of "
        f"{repeats} repeats' ratios); "
        f"÷ (bare + data generation apart) = {t['trainer'] / (t['bare'] + t['data']):.2f}×; ÷ bare = "
        f"{t['trainer'] / t['bare']:.2f}×"
    )
    print(
        f"recording/instrumentation: {t['recording'] * 1e6:.0f} µs a step = {overhead:.1%} of a bare step (target ≤ "
        "5 %)"
    )
    print(
        "trainer minus the generating bare loop minus recording: "
        f"{(t['trainer'] - t['floor'] - t['recording']) * 1e3:+.2f} ms; outside its steps (set-up, first step, "
        f"closing: the matrix's wall) {t['setup'] * 1e3:.1f} ms a cell"
    )
    if math.isnan(overhead):
        sys.exit(1)


if __name__ == "__main__":
    main()
