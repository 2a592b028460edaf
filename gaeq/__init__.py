"""gaeq: gradient-accumulation equivalence lab for PyTorch and DeepSpeed.

The Python API (:mod:`gaeq.api`) is re-exported here: ``gaeq.load``, ``gaeq.run``, ``gaeq.open_run``.
"""

__version__ = "0.1.0"

_API = ("load", "run", "open_run", "RunResult", "MatrixError")


def probe(*, model=None, engine=None) -> None:
    """In a script gaeq checks (gaeq.script): say which module is the one being trained — the model,
    or the DeepSpeed engine wrapping it — when its first training forward is not (a teacher's, an
    EMA copy's). Its parameters are then the ones fingerprinted, projected and whose norm is read.
    A no-op when the script runs outside gaeq."""
    import sys

    probing = sys.modules.get("gaeq.script.probe")  # loaded only inside a probed rank
    if probing is not None and probing.ACTIVE is not None:
        probing.ACTIVE.model = engine if engine is not None else model


def __getattr__(name: str):
    # Lazy, so that `import gaeq` (and every rank's import of a submodule) stays cheap.
    if name in _API:
        from gaeq import api

        return getattr(api, name)
    raise AttributeError(f"module 'gaeq' has no attribute {name!r}")


__all__ = [*_API, "probe", "__version__"]
