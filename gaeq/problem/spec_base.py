"""The base of every schema class of the problem (and the matrix): frozen, no unknown keys, no inf/nan."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Spec(BaseModel):
    # No inf/nan anywhere (YAML's .inf would pass `gt=0`); unknown keys are errors.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
