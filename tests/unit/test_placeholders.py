"""A script's arguments per cell: `{name}` and integer expressions of names, filled without eval."""

from __future__ import annotations

import pytest

from gaeq.script.placeholders import PlaceholderError, check, fill

VALUES = {
    "micro_batch_size": 4,
    "grad_accum_steps": 8,
    "world_size": 2,
    "train_batch_size": 64,
    "steps": 10,
    "seed": 0,
    "deepspeed_config": "/run/cells/c/ds_config.json",
    "cell_dir": "/run/cells/c",
}


@pytest.mark.parametrize(
    ("argument", "filled"),
    [
        ("{micro_batch_size}", "4"),
        ("--batch_size={micro_batch_size}", "--batch_size=4"),  # nanoGPT's configurator
        ("--gradient_accumulation_steps={grad_accum_steps * world_size}", "--gradient_accumulation_steps=16"),
        ("{train_batch_size // (micro_batch_size * world_size)}", "8"),
        ("--deepspeed_config={deepspeed_config}", "--deepspeed_config=/run/cells/c/ds_config.json"),
        ("--out", "--out"),
        ("{ steps - 1 }", "9"),
    ],
)
def test_placeholders_are_filled(argument, filled):
    assert fill(argument, VALUES) == filled


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("{batch_size}", "unknown name 'batch_size'"),
        ("{__import__('os')}", "only names, integers"),
        ("{micro_batch_size ** 2}", "only names, integers"),
        ("{cell_dir * 2}", "arithmetic on a path"),
        ("{world_size // 0}", "division by zero"),
        ("{micro_batch_size +}", "not a name or an integer expression"),
    ],
)
def test_what_cannot_be_filled_is_named(argument, message):
    with pytest.raises(PlaceholderError, match=message):
        check(argument)
