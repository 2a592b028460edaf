"""gaeq: gradient-accumulation equivalence lab for PyTorch and DeepSpeed.

The Python API (:mod:`gaeq.api`) is re-exported here: ``gaeq.load``, ``gaeq.run``, ``gaeq.open_run``.
"""

__version__ = "0.1.0"

_API = ("load", "run", "open_run", "RunResult", "MatrixError")


def probe(*, model=None, engine=None, pad_id=None) -> None:
    """In a script gaeq checks (gaeq.script), tell it what it cannot see for itself:

    - `model` (or `engine`, the DeepSpeed engine wrapping it): the module being trained, when the
      first module called with gradients on that has trainable parameters is another (a teacher's);
      its inputs are the samples, its parameters the ones fingerprinted, projected and whose norm is read,
      and it is what the instruments reorder and weigh (the noise floor's twins, the detection limit);
    - `pad_id`: the value your collation pads the model's inputs with, when it passes no attention
      mask and pads without ``torch.nn.utils.rnn.pad_sequence`` — padding is removed before a
      sample is fingerprinted (gaeq.script.samples), so the data can be checked.

    A no-op when the script runs outside gaeq."""
    import sys

    probing = sys.modules.get("gaeq.script.probe")  # loaded only inside a probed rank
    if probing is None or probing.ACTIVE is None:
        return
    if engine is not None or model is not None:
        probing.ACTIVE.model = engine if engine is not None else model
    if model is not None:  # its inputs are the samples (an engine's are read inside it, at its module)
        probing.ACTIVE.reads = model
    if engine is not None or model is not None:
        probing.ACTIVE.name_model(engine if engine is not None else model)
    if pad_id is not None:
        probing.ACTIVE.samples.pad_values.add(pad_id)


def __getattr__(name: str):
    # Lazy, so that `import gaeq` (and every rank's import of a submodule) stays cheap.
    if name in _API:
        from gaeq import api

        return getattr(api, name)
    raise AttributeError(f"module 'gaeq' has no attribute {name!r}")


__all__ = [*_API, "probe", "__version__"]
