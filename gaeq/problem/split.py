"""Why a global batch cannot be split so: what the data plan (gaeq/problem/data.py) and the matrix's
rules (gaeq/matrix/) say alike, in one place. No torch."""

from __future__ import annotations


def indivisible_message(*, train_batch_size: int, micro_batch_size: int, world_size: int) -> str:
    """Why a global batch cannot be split so (the matrix's cells and the data plan say it alike)."""
    return (
        f"train_batch_size {train_batch_size} is not divisible by "
        f"micro_batch_size {micro_batch_size} × world_size {world_size}"
    )


def short_step_message(*, num_samples: int, train_batch_size: int, micro_batch_size: int, data_parallel: int) -> str:
    """Why an epoch's short last step (epoch_end short_step) cannot be split so; '' if it can: a rank's
    last micro-batch may be short, but every data-parallel rank must run as many micro-steps, none empty."""
    left = num_samples % train_batch_size
    if data_parallel == 1 or left % (micro_batch_size * data_parallel) == 0:
        return ""
    return (
        f"an epoch's last step holds num_samples {num_samples} mod train_batch_size {train_batch_size} = {left} "
        f"samples: not divisible by micro_batch_size {micro_batch_size} × data-parallel ranks {data_parallel} "
        "(every rank must run as many micro-steps, none of them empty)"
    )
