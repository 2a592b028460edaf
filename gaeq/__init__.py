"""gaeq: gradient-accumulation equivalence lab for PyTorch and DeepSpeed.

The Python API (:mod:`gaeq.api`) is re-exported here: ``gaeq.load``, ``gaeq.run``, ``gaeq.open_run``.
"""

__version__ = "0.1.0"

_API = ("load", "run", "open_run", "RunResult", "MatrixError")


def __getattr__(name: str):
    # Lazy, so that `import gaeq` (and every rank's import of a submodule) stays cheap.
    if name in _API:
        from gaeq import api

        return getattr(api, name)
    raise AttributeError(f"module 'gaeq' has no attribute {name!r}")


__all__ = [*_API, "__version__"]
