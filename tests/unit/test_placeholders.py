"""A script's arguments per cell: `{name}` and integer expressions of names, filled without eval; every
other brace (JSON, a regex) passes through as written."""

from __future__ import annotations

import re

import pytest

from gaeq.problem.placeholders import PlaceholderError, check, fill

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
    "argument",
    [
        # the transformers Trainer's JSON flags
        '{"split_batches": true}',  # --accelerator_config
        '{"a": {"b": 1}}',
        '{"zero_optimization": {"stage": 2}}',  # --deepspeed
        '{"min_lr": 1e-5}',  # --lr_scheduler_kwargs
        '{"limit_all_gathers": true, "transformer_layer_cls_to_wrap": ["GPT2Block"]}',  # --fsdp_config
        '--accelerator_config={"split_batches": true, "dispatch_batches": null}',
        # regex quantifiers, and braces that name nothing
        r"\d{3}",
        "[a-z]{2,5}",
        "{}",
        "{ }",
        "{{3}}",
        "{1 + 2}",
        # a shape gaeq does not fill that names nothing of gaeq's: never evaluated
        "{__import__('os')}",
        "{args.lr}",
        '{"micro_batch_size"}',
        # what does not parse is text, like JSON, even when it names a name
        "{micro_batch_size +}",
        # a lone brace
        "{micro_batch_size",
        "micro_batch_size}",
    ],
)
def test_braces_that_are_no_placeholder_pass_through_byte_for_byte(argument):
    assert fill(argument, VALUES) == argument
    check(argument)


@pytest.mark.parametrize(
    ("argument", "filled"),
    [
        ('{"train_micro_batch_size_per_gpu": {micro_batch_size}}', '{"train_micro_batch_size_per_gpu": 4}'),
        ('{"a": {"b": {grad_accum_steps}}}', '{"a": {"b": 8}}'),
        (
            '{"gradient_accumulation_steps": {grad_accum_steps}, "x": {"y": 1}}',
            '{"gradient_accumulation_steps": 8, "x": {"y": 1}}',
        ),
    ],
)
def test_a_placeholder_inside_json_is_filled(argument, filled):
    assert fill(argument, VALUES) == filled


@pytest.mark.parametrize(
    ("argument", "literal"),
    [
        ("{{micro_batch_size}}", "{micro_batch_size}"),
        ("--template={{epoch}}-{{ steps - 1 }}", "--template={epoch}-{ steps - 1 }"),
        ("{{micro_batch_size}}={micro_batch_size}", "{micro_batch_size}=4"),
    ],
)
def test_doubled_braces_are_a_literal_placeholder(argument, literal):
    assert fill(argument, VALUES) == literal


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("{batch_size}", "{batch_size}: unknown name 'batch_size'; known: micro_batch_size, grad_accum_steps, "),
        ("{micro_batch}", "(for the literal text {micro_batch}, write {{micro_batch}})"),  # a typo
        ('{"a": {micro_batch}}', "unknown name 'micro_batch'"),
        ("{micro_batch_size ** 2}", "{micro_batch_size ** 2}: only names, integers, + - * // and parentheses"),
        ("{micro_batch_size / 2}", "only names, integers, + - * // and parentheses"),
        ("{int(seed)}", "only names, integers"),
        ("{micro_batch_size, world_size}", "only names, integers"),
        ("{{micro_batch_size ** 2}}", "only names, integers"),  # no escape for what is no placeholder
        ("{cell_dir * 2}", "{cell_dir * 2}: arithmetic on a path"),
        ("{-deepspeed_config}", "arithmetic on a path"),
        ("{world_size // 0}", "{world_size // 0}: division by zero"),
    ],
)
def test_what_cannot_be_filled_is_named(argument, message):
    with pytest.raises(PlaceholderError, match=re.escape(message)):
        check(argument)
