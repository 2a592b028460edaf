"""gaeq: a gradient-accumulation equivalence lab for PyTorch and DeepSpeed."""

__version__ = "0.1.0"
