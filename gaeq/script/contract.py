"""What gaeq's launch of a script and the probe inside it agree on (no torch: the parent reads it)."""

ENV = "GAEQ_PROBE"
"""JSON the launch hands every rank: {"out": the cell's directory, "steps": optimizer steps to record,
"perturbation": an instrument's {"twin_seed", "weight"} (gaeq.perturb), only for one}."""
PROBE_FILE = "probe.json"
"""Rank 0's record of what it saw, per optimizer step (written even when the script stops early)."""
