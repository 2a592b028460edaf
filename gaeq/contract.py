"""What gaeq's launch of a script and the probe inside it agree on (no torch: the parent reads it)."""

ENV = "GAEQ_PROBE"
"""JSON the launch hands every rank: {"out": the cell's directory, "steps": optimizer steps to record,
"perturbation": an instrument's {"twin_seed", "weight", "unit"} (gaeq.perturb), only for one; "float32": the
cell is labelled fp32, so its autocast and loss scaler are switched off (gaeq.script.precision); "switched_off":
what the launch itself switched off (a DeepSpeed config's bf16/fp16 section)}."""
PROBE_FILE = "probe.json"
"""Rank 0's record of what it saw, per optimizer step (written even when the script stops early)."""
TARGETS_FILE = "targets.rank{rank}.json"
"""A rank of gaeq's own trainers: its steps' target weights, beside the cell's trace (gaeq.script.targets.reading;
a script's are in its probe's file)."""
FAILURE_FILE = "probe-failure-rank{rank}.json"
"""A rank whose probe raised writes why here ({"error", "where", "out_of_memory"}): the cell's reason is gaeq's
failure, not a guess about the script — or, where an allocation failed in it, out of memory."""
OUT_OF_MEMORY_FILE = "out-of-memory-rank{rank}.json"
"""A rank whose script raised a failed allocation (gaeq.oom) writes it here ({"error", "where"}): the cell's reason
is out of memory, at the split's micro batch, whatever its peers said of it."""


def failed_in_gaeq(exc: BaseException) -> dict:
    """What a failure of gaeq's own code says: the error and the innermost frame in gaeq where it raised."""
    import os

    from gaeq.oom import is_out_of_memory

    package = os.path.dirname(os.path.abspath(__file__))  # …/gaeq
    return {
        "error": f"{type(exc).__name__}: {exc}",
        "where": _innermost(exc, under=package, relative_to=os.path.dirname(package)),
        "out_of_memory": is_out_of_memory(exc),
    }


def ran_out_of_memory(exc: BaseException, *, script: str) -> dict[str, str]:
    """What a failed allocation in a user's script says: the error (its first line) and the script's innermost
    frame it passed through."""
    import os

    error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return {"error": error, "where": _innermost(exc, under=os.path.dirname(os.path.abspath(script)))}


def _innermost(exc: BaseException, *, under: str, relative_to: str | None = None) -> str:
    """`file:line in function` of the innermost frame of `exc`'s traceback in a file under `under` ('?': none)."""
    import os
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename).startswith(under)]
    if not frames:
        return "?"
    where = frames[-1]
    name = os.path.relpath(where.filename, relative_to) if relative_to else os.path.basename(where.filename)
    return f"{name}:{where.lineno} in {where.name}"
