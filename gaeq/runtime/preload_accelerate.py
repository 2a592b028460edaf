"""Imported by the fork server as well when a matrix has accelerate cells (see preload.py)."""

import accelerate.accelerator  # noqa: F401

import gaeq.trainers.accelerate_native  # noqa: F401
