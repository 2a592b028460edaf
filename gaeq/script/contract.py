"""What gaeq's launch of a script and the probe inside it agree on (no torch: the parent reads it)."""

ENV = "GAEQ_PROBE"
"""JSON the launch hands every rank: {"out": the cell's directory, "steps": optimizer steps to record,
"perturbation": an instrument's {"twin_seed", "weight", "unit"} (gaeq.perturb), only for one; "float32": the
cell is labelled fp32, so its autocast and loss scaler are switched off (gaeq.script.precision); "switched_off":
what the launch itself switched off (a DeepSpeed config's bf16/fp16 section)}."""
PROBE_FILE = "probe.json"
"""Rank 0's record of what it saw, per optimizer step (written even when the script stops early)."""
FAILURE_FILE = "probe-failure-rank{rank}.json"
"""A rank whose probe raised writes why here ({"error", "where"}): the cell's reason is gaeq's failure, not
a guess about the script."""


def failed_in_gaeq(exc: BaseException) -> dict[str, str]:
    """What a failure of gaeq's own code says: the error and the innermost frame in gaeq where it raised."""
    import os
    import traceback

    package = os.path.dirname(os.path.abspath(__file__)).rsplit(os.sep, 1)[0]  # …/gaeq
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename).startswith(package)]
    where = frames[-1] if frames else None
    said = (
        f"{os.path.relpath(where.filename, os.path.dirname(package))}:{where.lineno} in {where.name}" if where else "?"
    )
    return {"error": f"{type(exc).__name__}: {exc}", "where": said}
