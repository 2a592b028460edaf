from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def write_matrix(tmp_path):
    """Write a matrix dict as YAML; return its path."""

    def write(spec: dict, name: str = "matrix.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path

    return write
