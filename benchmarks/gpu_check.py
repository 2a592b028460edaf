"""The GPU check: the same verdicts on CUDA — fp32, bf16 and fp16 for real — and gaeq's speed against
bare loops, in one prepared run that writes everything it measured under OUT_DIR. Started by
benchmarks/gpu_check.sh (which first installs what the machine lacks from a folder of wheels):

    python benchmarks/gpu_check.py OUT_DIR          # one NVIDIA GPU (several: world 2-8 too, see PHASES)
    python benchmarks/gpu_check.py OUT_DIR --cpu    # every phase at its smallest on a CPU: the suite runs it

Phases (each timed, each failure recorded and the next phase run all the same):

1. **equivalence** — `gaeq run --matrix experiments/gpu.yaml`: a 27 M-parameter GPT, world 1, GA 2 and 8,
   gaeq's torch loop and DeepSpeed ZeRO 0-3 in fp32 and bf16, fp16 autocast with torch's GradScaler,
   DeepSpeed's fp16 engine with its dynamic loss scaler, planted controls; every verdict as expected.
   Where the machine has several GPUs the same matrix runs at world 2 up to 8 as well.
2. **repeat** — every baseline trained once more in a second run: bitwise the first, or by how much
   not (CUDA kernels such as an embedding's backward accumulate with atomics), and that difference
   within the tolerance the first run's verdicts used (its noise floor, measured by nudged twins).
3. **script** — a user's script (experiments/scripts/ddp_manual.py, nanoGPT's device choice, widened to
   10.8 M parameters) under `gaeq run` as a script matrix on the device: GA 1-8 matching, a mean of
   micro-batch means caught; the same script under bf16 autocast (as trained, and made float32: the mean of
   means caught by the float32 run); an FSDP2 script (experiments/scripts/fsdp2_loop.py) at world 1; and
   what the probe costs a step on this device.
4. **speed** — gaeq's torch and DeepSpeed trainers against bare loops of the same model and split
   (benchmarks/gpu_speed.py): samples/s, the goal within 10 % (printed, never asserted); peak memory per
   cell comes from phase 1's report.

The exit code is 1 when a verdict is wrong, a baseline repeats beyond its tolerance or a phase fails.
Nothing here is specific to one card: the report names the device and the versions that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # gpu_speed, beside this file
GOAL = 1.10
"""gaeq's seconds per step ÷ a bare loop's: the goal (printed, never asserted)."""
TINY = {
    "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
    "data": {"kind": "tokens", "vocab_size": 32, "seq_len": 16, "min_len": 3},
    "steps": 5,  # the schedule warms up over 5
}
"""--cpu: the problem at its smallest (the phases and their code unchanged)."""


PHASES = ("equivalence", "repeat", "script", "speed")
"""In the order they run (repeat reads equivalence's report)."""


def gaeq(*args: str, log: Path) -> int:
    """`gaeq …` as its user types it, its output in `log`."""
    with log.open("w") as out:
        return subprocess.run(  # from OUT_DIR: the installed gaeq, not a checkout's beside it
            [sys.executable, "-m", "gaeq", *args], stdout=out, stderr=subprocess.STDOUT, cwd=log.parent
        ).returncode


def matrix_spec(*, cpu: bool) -> dict:
    spec = yaml.safe_load((REPO / "experiments" / "gpu.yaml").read_text())
    if cpu:
        spec["problem"] |= TINY
        spec["axes"] |= {"micro_batch_size": [4], "zero_stage": [2]}
        spec["cells"] = [c for c in spec["cells"] if c["micro_batch_size"] == 4 and c.get("zero_stage", 2) == 2]
    return spec


def environment() -> dict:
    import torch

    import gaeq
    from gaeq.script.ranks import versions

    found = {"python": sys.version.split()[0], "versions": versions(), "cuda": torch.version.cuda}
    found["gaeq_from"] = str(Path(gaeq.__file__).parent)  # the wheel's, where gpu_check.sh installed one
    if torch.cuda.is_available():
        found["device"] = torch.cuda.get_device_name(0)
        found["gpus"] = torch.cuda.device_count()
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    else:
        found["device"], found["gpus"] = "cpu", 0
    return found


def equivalence(out: Path, *, cpu: bool, gpus: int) -> dict:
    spec = matrix_spec(cpu=cpu)
    if gpus > 1:  # several GPUs: the same splits at world 2 up to 8 (as many as there are)
        spec["axes"]["world_size"] = [w for w in (1, 2, 4, 8) if w <= gpus]
    (out / "gpu.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    code = gaeq("run", "--matrix", str(out / "gpu.yaml"), "--out", str(out / "run"), log=out / "run.log")
    report = json.loads((out / "run" / "report.json").read_text())
    wrong = wrong_cells(report)
    return {"exit_code": code, "summary": report["summary"], "wrong": wrong, "cells": report["cells"]}


def wrong_cells(report: dict) -> list[str]:
    """A gaeq run's cells whose verdict is not the one they expect, each with its reason."""
    return [f"{c['id']}: {c['verdict']} ({c['reason']})" for c in report["cells"] if not c["as_expected"]]


def repeat(out: Path) -> dict:
    """Each baseline of the first run trained again, alone: its trace against the first's."""
    from gaeq.results.trace import read_trace

    first = json.loads((out / "run" / "report.json").read_text())
    spec = yaml.safe_load((out / "gpu.yaml").read_text())
    by_id = {c["id"]: c for c in first["cells"]}
    keys = ("variant", "trainer", "world_size", "micro_batch_size", "zero_stage")
    # a baseline skipped in the first run (fp16 on a CPU without it) has nothing to repeat: said, not wrong
    ran = {g: b for g, b in first["baselines"].items() if by_id[b]["verdict"] != "skipped"}
    again = [{k: by_id[b][k] for k in keys if by_id[b].get(k) is not None} for b in ran.values()]
    spec |= {"axes": None, "cells": again, "noise_floor": False, "detection_limit": False}
    spec.pop("axes")
    (out / "repeat.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    gaeq("run", "--matrix", str(out / "repeat.yaml"), "--out", str(out / "repeat"), log=out / "repeat.log")
    rows = {g: {"baseline": b, "skipped": by_id[b]["reason"]} for g, b in first["baselines"].items() if g not in ran}
    for group, baseline in ran.items():
        a, b = read_trace(out / "run" / "cells" / baseline), read_trace(out / "repeat" / "cells" / baseline)
        tolerance = first["tolerances"][by_id[baseline]["dtype"]]
        rows[group] = {"baseline": baseline} | twice(a, b, tolerance, first["noise_floors"].get(group, {}))
    wrong = [
        f"{r['baseline']} trained twice: |Δloss| {r['max_abs_loss_diff']:.2e} (tol {r['tolerance_loss']:.1e}), "
        f"rel Δ‖g‖ {r['max_rel_grad_norm_diff']:.2e} (tol {r['tolerance_grad_norm']:.1e})"
        for r in rows.values()
        if r.get("beyond")
    ]
    return {"groups": rows, "wrong": wrong}


def twice(a: list, b: list, tolerance: dict, floor: dict) -> dict:
    """One baseline's two traces: bitwise or not, and whether they differ by more than the largest
    tolerance the run's verdicts used (`tolerance`: the dtype's constants; `floor`: the run's noise floor)."""
    pairs = list(zip(a, b))
    loss = max(abs(x.loss - y.loss) for x, y in pairs)
    norm = max(abs(x.grad_norm - y.grad_norm) / abs(x.grad_norm) for x, y in pairs)
    loss_tol = max(
        widened(tolerance["loss_atol"], floor.get("max_abs_loss_diff", 0.0)) + tolerance["loss_rtol"] * abs(x.loss)
        for x, _ in pairs
    )
    norm_tol = widened(tolerance["grad_norm_rtol"], floor.get("max_rel_grad_norm_diff", 0.0))
    return {
        "steps": len(pairs),
        "bitwise": loss == 0.0 and norm == 0.0,
        "max_abs_loss_diff": loss,
        "max_rel_grad_norm_diff": norm,
        "tolerance_loss": loss_tol,
        "tolerance_grad_norm": norm_tol,
        "beyond": loss > loss_tol or norm > norm_tol,
    }


def widened(constant: float, floor: float) -> float:
    """The largest tolerance a verdict of the run used (gaeq.results.floor's rule, at its last step):
    the constant, widened to FACTOR × the noise floor, never past CEILING × the constant."""
    from gaeq.results.floor import CEILING, FACTOR

    return max(constant, min(FACTOR * floor, CEILING * constant))


def script(out: Path, *, cpu: bool) -> dict:
    """Users' scripts on the device: every split matches, each planted mistake is caught; the probe's cost."""
    ddp = str(REPO / "experiments" / "scripts" / "ddp_manual.py")
    args = ["--batch_size", "{micro_batch_size}", "--grad_accum", "{grad_accum_steps}", "--max_steps", "{steps}"]
    size = [] if cpu else ["--d_model", "640", "--hidden", "8192"]
    bug = {"world_size": 1, "micro_batch_size": 4, "args": ["--bug", "mean_of_means"], "expect": "diverge"}
    micro = [4] if cpu else [16, 8, 4]
    matrices = {
        "script": {"path": ddp, "args": args + size, "axes": {}, "cells": [bug]},
        "script_bf16": {  # as trained (bf16 autocast) and made float32; the mean of means caught by the latter
            "path": ddp,
            "args": args + size + ["--amp", "bf16", "--min_len", "23"],
            "axes": {"dtype": ["fp32", "bf16"]},
            "cells": [bug | {"dtype": "fp32"}],
        },
        "script_fsdp2": {"path": str(REPO / "experiments" / "scripts" / "fsdp2_loop.py"), "args": args, "axes": {}},
    }
    found: dict = {"exit_code": 0, "wrong": [], "probe": {}, "cells": []}
    for name, m in matrices.items():
        spec = {
            "name": f"gpu_{name}",
            "script": {"path": m["path"], "launcher": "torchrun", "args": m["args"]},
            "steps": 3 if cpu else 8,
            "train_batch_size": 32,
            "axes": {"world_size": [1], "micro_batch_size": micro} | m["axes"],
            "cells": m.get("cells", []),
        }
        (out / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        code = gaeq("run", "--matrix", str(out / f"{name}.yaml"), "--out", str(out / name), log=out / f"{name}.log")
        report = json.loads((out / name / "report.json").read_text())
        found["exit_code"] = found["exit_code"] or code
        found["wrong"] += wrong_cells(report)
        found["cells"] += report["cells"]
        found[f"{name}_summary"] = report["summary"]
        for c in report["cells"]:
            probe = out / name / "cells" / c["id"] / "probe.json"
            if c["role"] in ("cell", "baseline") and probe.is_file():
                steps = json.loads(probe.read_text())["steps"][1:]  # after the first (imports, allocations)
                found["probe"][c["id"]] = {
                    "step_s": statistics.median(s["seconds"] for s in steps),
                    "probe_s": statistics.median(s["probe_seconds"] for s in steps),
                }
    return found


def speed(out: Path, *, cpu: bool) -> dict:
    import gpu_speed

    cells = {"torch": "torch-w1-mb4-ga8", "deepspeed": "deepspeed-z2-w1-mb4-ga8"}
    found = gpu_speed.measure(out / "gpu.yaml", cells=cells, steps=4 if cpu else 12)
    found["goal"] = GOAL
    return found


def report_md(results: dict) -> str:
    env = results["environment"]
    lines = [
        "# gaeq GPU check",
        "",
        f"{env['device']} ({env.get('gpus', 0)} GPU(s), capability {env.get('capability', '-')}), CUDA {env['cuda']}, "
        f"Python {env['python']}, " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
        "",
    ]
    for name, phase in results["phases"].items():
        lines += [f"## {name} ({phase.get('seconds', 0):.0f} s)", ""]
        if "error" in phase:
            lines += ["```", phase["error"], "```", ""]
            continue
        if "cells" in phase:
            lines += [row("cell", "dtype", "expect", "verdict", "✓", "max Δloss", "max rel Δ‖g‖", "s/step", "peak MiB")]
            lines += ["|---" * 9 + "|"]
            for c in phase["cells"]:
                peak = c.get("peak_mem_bytes")
                ok = "✓" if c["as_expected"] else "✗"
                numbers = [fmt(c.get(k)) for k in ("max_abs_loss_diff", "max_rel_grad_norm_diff", "step_seconds")]
                lines.append(row(c["id"], c["dtype"], c["expect"], c["verdict"], ok, *numbers, mib(peak)))
            lines.append("")
        if "groups" in phase:
            lines += [row("group", "baseline", "bitwise", "max Δloss", "tol", "max rel Δ‖g‖", "tol"), "|---" * 7 + "|"]
            for g, r in phase["groups"].items():
                if "skipped" in r:
                    lines.append(row(g, r["baseline"], "skipped: " + r["skipped"], "-", "-", "-", "-"))
                    continue
                loss, norm = fmt(r["max_abs_loss_diff"]), fmt(r["max_rel_grad_norm_diff"])
                tol_loss, tol_norm = fmt(r["tolerance_loss"]), fmt(r["tolerance_grad_norm"])
                lines.append(row(g, r["baseline"], r["bitwise"], loss, tol_loss, norm, tol_norm))
            lines.append("")
        for cell, p in phase.get("probe", {}).items():
            lines.append(f"- probe: {cell}: {p['probe_s'] * 1e3:.2f} ms of a {p['step_s'] * 1e3:.1f} ms step")
        for trainer in ("torch", "deepspeed"):
            if trainer in phase:
                t = phase[trainer]
                lines.append(
                    f"- {trainer} ({t['cell']}): gaeq {t['gaeq_s'] * 1e3:.1f} ms/step, bare {t['bare_s'] * 1e3:.1f} "
                    f"ms/step = {t['ratio']:.2f}× (goal ≤ {GOAL}); samples/s {t['samples_per_s']['gaeq']:.0f} "
                    f"against {t['samples_per_s']['bare']:.0f}"
                )
        lines += [f"- wrong: {w}" for w in phase.get("wrong", [])] + [""]
    return "\n".join(lines)


def row(*values) -> str:
    return "| " + " | ".join(map(str, values)) + " |"


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.0f}"


def fmt(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cpu", action="store_true", help="Every phase at its smallest, on the CPU (the suite).")
    parser.add_argument(
        "--phases", default=",".join(PHASES), help=f"Which phases, comma-separated (default: all, {','.join(PHASES)})."
    )
    args = parser.parse_args()
    chosen = args.phases.split(",")
    if unknown := [name for name in chosen if name not in PHASES]:
        parser.error(f"no phase {', '.join(unknown)}: one of {', '.join(PHASES)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    if not args.cpu and env["gpus"] == 0:
        sys.exit("no CUDA device: run with --cpu for the dry run")
    phases = {  # PHASES, each
        "equivalence": lambda: equivalence(out, cpu=args.cpu, gpus=env["gpus"]),
        "repeat": lambda: repeat(out),
        "script": lambda: script(out, cpu=args.cpu),
        "speed": lambda: speed(out, cpu=args.cpu),
    }
    results: dict = {"environment": env, "cpu": args.cpu, "phases": {}}
    for name, phase in phases.items():
        if name not in chosen:
            continue
        started = time.perf_counter()
        print(f"{name} …", flush=True)
        try:
            found = phase()
        except Exception:  # noqa: BLE001 - a phase that breaks is reported, and the next one runs
            found = {"error": traceback.format_exc(limit=6), "wrong": [f"{name} failed"]}
        found["seconds"] = time.perf_counter() - started
        results["phases"][name] = found
        print(f"{name}: {found['seconds']:.0f} s, {len(found.get('wrong', []))} wrong", flush=True)
        (out / "report.json").write_text(json.dumps(results, indent=1))  # what was measured so far, each phase
    wrong = [f"{name}: {w}" for name, phase in results["phases"].items() for w in phase.get("wrong", [])]
    (out / "report.md").write_text(report_md(results))
    summary = [
        f"gaeq GPU check on {env['device']} ({'CPU dry run: numbers mean nothing' if args.cpu else 'CUDA'})",
        *(f"{n}: {p['seconds']:.0f} s, {len(p.get('wrong', []))} wrong" for n, p in results["phases"].items()),
        *(f"WRONG {w}" for w in wrong),
        "OK" if not wrong else "NOT OK",
    ]
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    print("\n".join(summary), flush=True)
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
