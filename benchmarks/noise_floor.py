"""The scale ladder's numbers: noise floor and control effect against the number of parameters.

    gaeq run --matrix experiments/scale.yaml --out runs/scale
    python benchmarks/noise_floor.py runs/scale            # prints the table, writes docs/noise_floor.png
    python benchmarks/noise_floor.py --tiny     # trains a tiny scale-like run itself; the figure to a temp path
    python benchmarks/noise_floor.py --long 100 --variants base,gpt_43k --out runs/scale-long   # fp32, 100 steps

For each group of the run (a model size × configuration × dtype): the parameters, how far the
baseline's nudged twins drifted by rounding alone (their max |Δloss| and max rel Δ‖g‖: the floor), the
largest margin of a correct split (its largest share of its tolerance: < 1 is a match), the smallest
margin of a planted control (> 1 is caught), and the detection limit — the smallest δ of rows reweighed
1 ± δ (the total weight unchanged) the run would have caught — beside what a split with that error planted really showed
(weight_error cells: a verdict that contradicts the limit by 3× or more fails the benchmark). A verdict
holds at a size when the first margin stays below 1 and the second above it.

`--tiny` first trains experiments/scale.yaml cut to its two smallest models (the 3 k MLP and the 43 k
GPT), world 1, 2 steps, into a temporary folder, then prints the same table and draws the same figure
from it — to a temporary path, never docs/noise_floor.png. Its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = "tiny run (--tiny): the smallest sizes, to keep the code working — its numbers mean nothing"
TINY_VARIANTS = ("base", "gpt_43k")
"""--tiny: the ladder's smallest MLP and GPT (a group named by its dtype alone, and one by dtype@variant)."""


def train_tiny(folder: Path) -> Path:
    """experiments/scale.yaml cut to TINY_VARIANTS, its world-1 torch cells (splits in fp32 and bf16,
    the controls), 2 steps: a run with every kind of group the ladder reads, in seconds."""
    import yaml

    spec = yaml.safe_load((REPO / "experiments" / "scale.yaml").read_text())
    spec["problem"]["steps"] = 2
    spec["variants"] = {name: v for name, v in spec["variants"].items() if name in TINY_VARIANTS}
    spec["axes"] = {"trainer": ["torch"], "world_size": [1], "micro_batch_size": [2], "variant": list(TINY_VARIANTS)}
    spec["cells"] = [
        c
        for c in spec["cells"]
        if c["trainer"] == "torch" and c.get("world_size", 1) == 1 and c["variant"] in TINY_VARIANTS
    ]
    (folder / "scale.yaml").write_text(yaml.safe_dump(spec))
    run_dir = folder / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gaeq", "run", "--matrix", str(folder / "scale.yaml"), "--out", str(run_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if proc.returncode != 0:
        sys.exit(f"gaeq run failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return run_dir


def train_long(folder: Path, steps: int, variants: list[str] | None) -> Path:
    """experiments/scale.yaml's fp32 rows (its bf16 cells left out) at `steps` steps — its `variants` only,
    where named — trained into `folder`/run: the ladder's claims over a long run."""
    import yaml

    spec = yaml.safe_load((REPO / "experiments" / "scale.yaml").read_text())
    spec["problem"]["steps"] = steps
    keep = variants or ["base", *spec["variants"]]
    spec["variants"] = {name: v for name, v in spec["variants"].items() if name in keep}
    spec["axes"]["variant"] = [v for v in spec["axes"]["variant"] if v in keep]
    spec["cells"] = [c for c in spec["cells"] if c.get("dtype", "fp32") == "fp32" and c["variant"] in keep]
    (folder / "scale_long.yaml").write_text(yaml.safe_dump(spec))
    run_dir = folder / "run"
    subprocess.run(
        [sys.executable, "-m", "gaeq", "run", "--matrix", str(folder / "scale_long.yaml"), "--out", str(run_dir)],
        cwd=REPO,
        check=False,  # (a verdict against its expectation exits 1: the table says which)
    )
    return run_dir


def parameters(run_dir: Path) -> dict[str, int]:
    """variant → parameters of its model, built from the run's own matrix."""
    from gaeq.matrix import load_matrix
    from gaeq.problem.build import build_problem

    matrix = load_matrix(run_dir / "matrix.yaml")
    return {
        v: sum(p.numel() for p in build_problem(problem).model.parameters()) for v, problem in matrix.problems.items()
    }


def ladder(run_dir: Path) -> list[dict]:
    report = json.loads((run_dir / "report.json").read_text())
    sizes = parameters(run_dir)
    groups: dict[str, list[dict]] = defaultdict(list)
    for c in report["cells"]:
        group = c["dtype"] if c["variant"] == "base" else f"{c['dtype']}@{c['variant']}"
        groups[group].append(c)
    rows = []
    for group, cells in groups.items():
        floor = report["noise_floors"].get(group, {})
        splits = [
            c
            for c in cells
            if c["role"] == "cell" and c["bug"] is None and not c.get("weight_error") and c["verdict"] != "skipped"
        ]
        controls = [c for c in cells if c["bug"] is not None]
        variant = cells[0]["variant"]
        limit = report.get("detection_limits", {}).get(group, {}).get("limit")
        planted = [c for c in cells if c["role"] == "cell" and c.get("weight_error") and c["verdict"] != "skipped"]
        rows.append({
            "group": group,
            "parameters": sizes[variant],
            "floor_loss": floor.get("max_abs_loss_diff"),
            "floor_grad": floor.get("max_rel_grad_norm_diff"),
            "max_loss": max((c["max_abs_loss_diff"] for c in splits), default=None),
            "max_grad": max((c["max_rel_grad_norm_diff"] for c in splits), default=None),
            "worst_split": max((c["margin"] for c in splits), default=None),
            "false_alarms": sum(c["verdict"] != "match" for c in splits),
            "weakest_control": min((c["margin"] for c in controls), default=None),
            "missed_controls": sum(c["verdict"] != "diverge" for c in controls),
            "limit": limit,
            "planted": [(c["weight_error"], c["verdict"]) for c in planted],
            "contradicted": sum(contradicts(limit, c["weight_error"], c["verdict"]) for c in planted),
        })  # fmt: skip
    return sorted(rows, key=lambda r: (r["group"].split("@")[0], r["parameters"], r["group"]))


def contradicts(limit: float | None, delta: float, verdict: str) -> bool:
    """Whether a split with each micro-batch's rows reweighed 1 ± delta contradicts the detection limit
    measured on the baseline's split: caught at a third of the limit or less, or missed at three times it or
    more (between the two, the split's own samples decide: either verdict agrees)."""
    if limit is None:
        return False
    return (delta <= limit / 3 and verdict == "diverge") or (delta >= 3 * limit and verdict != "diverge")


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for dtype, marker in (("fp32", "o"), ("bf16", "s")):
        mine = [r for r in rows if r["group"].split("@")[0] == dtype and r["floor_loss"] is not None]
        x = [r["parameters"] for r in mine]
        left.scatter(
            x, [max(r["floor_loss"], 1e-12) for r in mine], marker=marker, label=f"{dtype}: twins' drift (the floor)"
        )
        left.scatter(
            x,
            [max(r["max_loss"] or 0, 1e-12) for r in mine],
            marker=marker,
            facecolors="none",
            edgecolors="C2",
            label=f"{dtype}: largest |Δloss| of a correct split",
        )
        margins = [(r["parameters"], r["worst_split"], r["weakest_control"]) for r in mine]
        right.scatter(
            [m[0] for m in margins],
            [m[1] for m in margins],
            marker=marker,
            color="C2",
            label=f"{dtype}: worst correct split",
        )
        right.scatter([m[0] for m in margins if m[2]], [m[2] for m in margins if m[2]], marker=marker, color="C3",
                      label=f"{dtype}: weakest control")  # fmt: skip
    left.set(xscale="log", yscale="log", xlabel="parameters", ylabel="max |Δloss| vs baseline",
             title="Rounding grows with the model; the twins measure it")  # fmt: skip
    right.axhline(1.0, color="black", lw=1)
    right.set(xscale="log", yscale="log", xlabel="parameters", ylabel="share of the tolerance used (margin)",
              title="Correct splits stay below 1, controls above it")  # fmt: skip
    for ax in (left, right):
        ax.legend(fontsize=7)
        ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, nargs="?", help="A finished run of experiments/scale.yaml.")
    parser.add_argument("--figure", type=Path, default=None, help="Default docs/noise_floor.png (--tiny: a temp path).")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="Train a tiny scale-like run first (2 variants, 2 steps) and read it: for the suite, numbers meaningless.",
    )
    parser.add_argument("--long", type=int, metavar="STEPS", help="Train the ladder's fp32 rows at STEPS steps first.")
    parser.add_argument("--variants", help="--long: only these variants (comma-separated; base is the 3 k MLP).")
    parser.add_argument("--out", type=Path, help="--long: train into this folder (kept).")
    args = parser.parse_args()
    if args.long:
        folder = args.out or Path(tempfile.mkdtemp(prefix="gaeq-scale-long-"))
        folder.mkdir(parents=True, exist_ok=True)
        run_dir = train_long(folder, args.long, args.variants.split(",") if args.variants else None)
        table_and_figure(run_dir, args.figure or folder / "noise_floor.png")
        return
    if args.tiny == (args.run_dir is not None):
        parser.error("give a run directory, or --tiny (which trains its own)")
    if args.tiny:
        print(TINY, flush=True)
        with tempfile.TemporaryDirectory(prefix="gaeq-noise-floor-") as folder:
            table_and_figure(train_tiny(Path(folder)), args.figure or Path(folder) / "noise_floor.png")
    else:
        table_and_figure(args.run_dir, args.figure or REPO / "docs" / "noise_floor.png")


def table_and_figure(run_dir: Path, figure_path: Path) -> None:
    rows = ladder(run_dir)
    print(f"{'group':<22} {'params':>10} {'floor |Δloss|':>13} {'floor rel Δ‖g‖':>14} {'max |Δloss|':>11} "
          f"{'worst split':>11} {'weakest control':>15} {'detects δ ≥':>11} {'planted δ: verdict':>20}"
          "  false alarms / missed controls / limit contradicted")  # fmt: skip
    for r in rows:

        def f(x, spec=".1e"):
            return "-" if x is None else format(x, spec)

        print(
            f"{r['group']:<22} {r['parameters']:>10,} {f(r['floor_loss']):>13} {f(r['floor_grad']):>14} "
            f"{f(r['max_loss']):>11} "
            f"{f(r['worst_split'], '.2f'):>11} {f(r['weakest_control'], '.3g'):>15} {f(r['limit']):>11} "
            f"{', '.join(f'{d:.0e}: {v}' for d, v in r['planted']) or '-':>20}  {r['false_alarms']} / "
            f"{r['missed_controls']} / {r['contradicted']}"
        )
    figure(rows, figure_path)
    print(f"figure: {figure_path}")
    if any(r["false_alarms"] or r["missed_controls"] or r["contradicted"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
