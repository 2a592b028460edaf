"""Does a run's detection limit mean what it says? For each group of a matrix (fp32 by default): the limit the
run printed, and the error it is measured with — each batch's rows reweighed 1 ± δ, the total weight
unchanged (gaeq.perturb.row_weights) — planted in *every* split the group judges, at 2 × the limit and at a
third of it: caught in each, and in none.

    python benchmarks/detection_limit.py experiments/ga.yaml experiments/pitfalls.yaml experiments/your_script.yaml
    python benchmarks/detection_limit.py experiments/your_amp_script.yaml --dtype bf16 --dtype fp32
    python benchmarks/detection_limit.py experiments/your_script.yaml --deltas 3e-5,1e-4,1e-3   # a ladder of δ
    python benchmarks/detection_limit.py experiments/scale.yaml --as-is runs/scale   # the ladder, already run
    python benchmarks/detection_limit.py --tiny      # a tiny matrix: keeps the code working, numbers mean nothing

Each matrix is trained twice with `gaeq run`: as it is (its report states each group's limit), then with
every judged split of the chosen groups (no planted bug, expected to match) copied with the error planted —
beside their baselines and noise-floor twins, so that each copy is judged by the tolerance its split had.
Prints one row per group; exits 1 when a verdict contradicts the limit (a split at 2 × that matches, or one
at a third that diverges).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TIMES = (2.0, 1 / 3)
"""Multiples of the printed limit planted: caught at the first, not at the second."""
LIMIT_METRICS = ("loss", "grad_norm")
"""What the limit is measured on: a split caught below it by another check (a script's update sketch) is
sharper than the limit claims, not a contradiction of it."""
SPLIT_KEYS = (
    *("trainer", "world_size", "tensor_parallel", "pipeline_parallel", "pipeline_schedule", "sequence_parallel"),
    *("hsdp_replicas", "micro_batch_size", "zero_stage", "offload", "dtype", "variant"),
)
"""A judged cell's split, as report.json names it (a script cell's: its world size, micro batch and dtype)."""
TINY_SPEC = {
    "name": "tiny_limit",
    "problem": {
        "model": {"kind": "mlp", "hidden": 16, "depth": 2},
        "data": {"kind": "regression", "in_features": 8, "out_features": 2},
        "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
        "gradient_clipping": 1.0,
        "steps": 3,
        "seed": 7,
        "train_batch_size": 8,
    },
    "axes": {"trainer": ["torch"], "world_size": [1], "micro_batch_size": [2, 4]},
}


def gaeq_run(matrix: Path, out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "gaeq", "run", "--matrix", str(matrix), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    report = out / "report.json"
    if not report.is_file():
        sys.exit(f"gaeq run {matrix} wrote no report ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(report.read_text())


def group_of(cell: dict) -> str:
    return cell["dtype"] + (f"@{cell['variant']}" if cell.get("variant") not in (None, "base") else "")


def judged(report: dict, groups: set[str]) -> list[dict]:
    """The group's splits that claim equivalence: cells (not instruments, not the baseline) with no planted
    bug or error, expected to match, that ran."""
    baselines = set(report["baselines"].values())
    return [
        c
        for c in report["cells"]
        if c["role"] == "cell"
        and c["id"] not in baselines
        and not c.get("bug")
        and not c.get("weight_error")
        and c["expect"] == "match"
        and c["verdict"] in ("match", "diverge")
        and group_of(c) in groups
        and "-args_" not in c["id"]  # a script cell with arguments of its own: a mistake behind a flag
    ]


def planted_spec(spec: dict, cells: list[dict], deltas: dict[str, list[float]], *, script: bool) -> dict:
    """The matrix with only its baselines' split on its axes and each judged cell copied once per δ of its
    group, the error planted (its expectation: caught above the limit, not below — the benchmark reads it)."""
    planted = []
    for c in cells:
        split = {k: c[k] for k in SPLIT_KEYS if c.get(k) is not None}
        if script:
            split = {k: split[k] for k in ("world_size", "micro_batch_size", "dtype") if k in split}
        elif split.get("trainer") not in ("deepspeed", "ds_pipeline"):
            split.pop("zero_stage", None)
        planted += [{**split, "weight_error": float(d), "expect": "diverge"} for d in deltas[group_of(c)]]
    out = {**spec, "cells": planted, "detection_limit": False}
    out.pop("resume", None)
    if "axes" in out:  # the baselines' split alone (each group's baseline and twins are added for its cells)
        out["axes"] = {k: v[:1] for k, v in out["axes"].items() if k not in ("variant",)}
    return out


def check(
    matrix: Path, folder: Path, *, dtypes: tuple[str, ...], deltas: list[float] | None, as_is: Path | None = None
) -> list[dict]:
    """One row per group: its limit and what the planted splits showed (`as_is`: the matrix's run, if made)."""
    spec = yaml.safe_load(matrix.read_text())
    if "script" in spec:
        spec["script"]["path"] = str((matrix.parent / spec["script"]["path"]).resolve())
        for key in ("deepspeed_config",):
            if spec["script"].get(key):
                spec["script"][key] = str((matrix.parent / spec["script"][key]).resolve())
    (folder / "as_is.yaml").write_text(yaml.safe_dump(spec))
    if as_is is not None:
        first = json.loads((as_is / "report.json").read_text())
    else:
        first = gaeq_run(folder / "as_is.yaml", folder / "as_is")
    limits = {g: lim for g, lim in first.get("detection_limits", {}).items() if g.split("@")[0] in dtypes}
    cells = judged(first, set(limits))
    plant = {g: deltas or [t * lim["limit"] for t in TIMES] for g, lim in limits.items()}
    (folder / "planted.yaml").write_text(yaml.safe_dump(planted_spec(spec, cells, plant, script="script" in spec)))
    second = gaeq_run(folder / "planted.yaml", folder / "planted")
    by_group: dict[str, list[dict]] = defaultdict(list)
    for c in second["cells"]:
        if c["role"] == "cell" and c.get("weight_error"):
            by_group[group_of(c)].append(c)
    rows = []
    for group, lim in limits.items():
        row = {"matrix": matrix.name, "group": group, "limit": lim["limit"], "weakest": lim.get("weakest"), "by": {}}
        for d in plant[group]:
            got = [c for c in by_group[group] if abs(c["weight_error"] - d) <= 1e-9 * d]
            caught = [c for c in got if c["verdict"] == "diverge"]
            margins = [c["margin"] for c in got if c.get("margin") is not None]
            spread = (min(margins, default=0.0), max(margins, default=0.0))
            # the limit is the loss's and the grad norm's: a script's update sketch may see smaller errors
            by_limits = sum(c["caught_by"] in LIMIT_METRICS for c in caught)
            by = sorted({c["caught_by"] for c in caught})
            row["by"][d] = {"caught": len(caught), "by_limits": by_limits, "of": len(got), "margins": spread, "how": by}
        rows.append(row)
    return rows


def contradicted(row: dict) -> int:
    """Planted splits whose verdict contradicts the limit: missed at 2 × it or more, caught at a third or less."""
    bad = 0
    for d, seen in row["by"].items():
        if d >= 2 * row["limit"] * (1 - 1e-9):
            bad += seen["of"] - seen["caught"]
        elif d <= row["limit"] / 3 * (1 + 1e-9):
            bad += seen["by_limits"]
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("matrices", nargs="*", type=Path)
    parser.add_argument("--dtype", action="append", help="groups of this dtype (default fp32; repeatable)")
    parser.add_argument("--deltas", help="plant these δ (comma-separated) instead of 2 × and a third of the limit")
    parser.add_argument("--tiny", action="store_true", help="a tiny MLP matrix, 3 steps: the code, not the numbers")
    parser.add_argument("--keep", type=Path, help="train into this folder (kept) instead of a temporary one")
    parser.add_argument("--as-is", type=Path, help="the (one) matrix's run as it is, already made: its RUN_DIR")
    args = parser.parse_args()
    dtypes = tuple(args.dtype or ["fp32"])
    deltas = [float(d) for d in args.deltas.split(",")] if args.deltas else None
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        matrices = list(args.matrices)
        if args.tiny:
            (Path(tmp) / "tiny.yaml").write_text(yaml.safe_dump(TINY_SPEC))
            matrices.append(Path(tmp) / "tiny.yaml")
        if not matrices:
            parser.error("name a matrix, or --tiny")
        rows = []
        for i, matrix in enumerate(matrices):
            folder = root / f"{i}-{matrix.stem}"
            folder.mkdir(parents=True, exist_ok=True)
            rows += check(matrix.resolve(), folder, dtypes=dtypes, deltas=deltas, as_is=args.as_is)
    if args.tiny:
        print("tiny run (--tiny): a 3-step MLP, to keep the code working — its numbers mean nothing")
    print("| matrix | group | detects δ ≥ | weakest step (δ) | planted δ | caught | by | margins |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        weakest = f"{row['weakest'][0]} ({row['weakest'][1]:.1e})" if row["weakest"] else "-"
        for d, seen in row["by"].items():
            low, high = seen["margins"]
            print(
                f"| {row['matrix']} | {row['group']} | {row['limit']:.1e} | {weakest} | {d:.1e} "
                f"({d / row['limit']:.2g} ×) | {seen['caught']}/{seen['of']} | {', '.join(seen['how']) or '-'} | "
                f"{low:.2f}–{high:.2f} |"
            )
    bad = sum(contradicted(row) for row in rows)
    print(f"verdicts contradicting the limit (missed at 2 ×, or caught by the loss or grad norm at a third): {bad}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
