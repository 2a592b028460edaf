"""The matrix: one training problem (and its variants) and the ways to split its global batch.

- :mod:`~gaeq.matrix.schema` — the YAML schema (pydantic, every key checked and documented);
- :mod:`~gaeq.matrix.cell` — :class:`Split`, :class:`Cell` and :class:`Matrix`, plain frozen data;
- :mod:`~gaeq.matrix.expand` — axes × variants + explicit cells + resume experiments → cells, baselines included;
- :mod:`~gaeq.matrix.rules` — the rules a split keeps to become a cell;
- :mod:`~gaeq.matrix.resume` — the rules of checkpoint → resume experiments;
- :mod:`~gaeq.matrix.load` — a file or a mapping → a :class:`Matrix`, or one :class:`MatrixError` line.
"""

from gaeq.matrix.cell import (
    Cell,
    Fault,
    Matrix,
    Perturbation,
    Reference,
    Resume,
    Role,
    Split,
    group_key,
)
from gaeq.matrix.load import load_matrix, matrix_from_dict, with_references
from gaeq.matrix.schema import BASE, MATRIX_FILE, MatrixError, MatrixSpec

__all__ = [
    "BASE",
    "MATRIX_FILE",
    "Cell",
    "Fault",
    "Matrix",
    "MatrixError",
    "MatrixSpec",
    "Perturbation",
    "Reference",
    "Resume",
    "Role",
    "Split",
    "group_key",
    "load_matrix",
    "matrix_from_dict",
    "with_references",
]
