"""From a ProblemSpec to the objects a trainer uses: dataset, model, loss — built-ins or plugins.

Plugin contract (docs/matrix.md: Plugins), each named ``{import: "package.module:function", args: {...}}``:

- data:  ``function(*, seed, **args)`` → an object with ``batch(indices) -> (inputs, targets)``
  (tensors, one row per index) and optionally ``loss_elements(index) -> int`` (default 1);
- model: ``function(**args)`` → ``torch.nn.Module`` (called under ``torch.manual_seed(seed)``);
- loss:  ``function(outputs, targets)`` → scalar tensor, the **sum** of the per-element losses of
  the micro-batch (gaeq divides by the global batch's element count).

A model may also be a transformers causal LM by class name (``model: {hf: ..., config: {...}}``,
gaeq/problem/hf.py), and ``loss: hf`` its own loss.

Modules are imported from ``sys.path``, where :func:`import_plugins_from` puts the matrix file's
folder and the working directory (and ``--search`` folders) once per process: the parent before it
checks the problem, each rank before its first cell.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gaeq.problem import hf
from gaeq.problem.completions import CompletionData
from gaeq.problem.data import Dataset, RegressionData, TokenData
from gaeq.problem.loss import LOSSES
from gaeq.problem.models import GPT, MLP
from gaeq.problem.spec import GPTSpec, HFModelSpec, MLPSpec, PluginSpec, ProblemSpec, RegressionSpec, TokensSpec


class PluginError(ValueError):
    """A plugin that cannot be imported or breaks the contract. The message names it."""


@dataclass(frozen=True, kw_only=True)
class BuiltProblem:
    dataset: Dataset
    model: torch.nn.Module
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    """The loss sum of a micro-batch from the model's outputs; None for ``loss: hf`` (the model's own)."""
    per_sample: bool = False
    """Each sample counts as one loss element whatever the dataset's count (a loss_sum of per-sample means)."""

    def micro_loss(
        self,
        net: torch.nn.Module,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        num_items: int,
        aux_share: float = 1.0,
    ) -> torch.Tensor:
        """Forward `inputs` through `net` (the model or its wrapper): the micro-batch's loss sum ÷
        `num_items` — with num_items the global batch's element count, its share of the global mean
        (a transformers mixture of experts' balance term weighed by `aux_share`, hf.model_loss)."""
        if self.loss_sum is None:  # transformers divides
            return hf.model_loss(net, inputs, targets, num_items=num_items, aux_share=aux_share)
        return self.loss_sum(hf.logits(net(inputs)), targets) / num_items

    def loss_elements(self, index: int) -> int:
        if self.per_sample:
            return 1
        counter = getattr(self.dataset, "loss_elements", None)
        return 1 if counter is None else int(counter(index))

    def total_loss_elements(self, indices) -> int:
        """Loss elements of many samples (a dataset may answer in one call)."""
        if self.per_sample:
            return len(indices)
        total = getattr(self.dataset, "total_loss_elements", None)
        if total is not None:
            return int(total(indices))
        if getattr(self.dataset, "loss_elements", None) is None:
            return len(indices)
        return sum(self.loss_elements(i) for i in indices)


def import_plugins_from(folders: Sequence[str]) -> None:
    """Put the folders plugin modules are imported from at the front of ``sys.path``, the first
    folder first (a folder already there stays where it is)."""
    for folder in reversed(folders):
        if folder not in sys.path:
            sys.path.insert(0, folder)


def resolve(plugin: PluginSpec, *, role: str) -> Callable:
    module_name, _, attr = plugin.import_.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the plugin's
        raise PluginError(
            f"{role} plugin {plugin.import_!r}: cannot import {module_name} ({type(exc).__name__}: {exc})"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PluginError(f"{role} plugin {plugin.import_!r}: {module_name} has no function {attr!r}")
    return fn


def build_problem(problem: ProblemSpec) -> BuiltProblem:
    dataset = _build_data(problem)
    # A private generator state: the init must not depend on what ran before in this process
    # (processes are reused across cells).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(problem.seed)
        model = _build_model(problem, dataset)
    if isinstance(problem.loss, PluginSpec):
        loss_sum = resolve(problem.loss, role="loss")
    elif problem.loss == "hf":
        loss_sum = None
    else:
        loss_sum = LOSSES[problem.loss]
    return BuiltProblem(dataset=dataset, model=model, loss_sum=loss_sum)


def _build_data(problem: ProblemSpec) -> Dataset:
    spec = problem.data
    if isinstance(spec, RegressionSpec):
        return RegressionData(spec, seed=problem.seed)
    if isinstance(spec, TokensSpec):
        return (TokenData if spec.completions is None else CompletionData)(spec, seed=problem.seed)
    fn = resolve(spec, role="data")
    try:
        dataset = fn(seed=problem.seed, **spec.args)
    except Exception as exc:  # noqa: BLE001
        raise PluginError(f"data plugin {spec.import_!r} raised {type(exc).__name__}: {exc}") from None
    if not callable(getattr(dataset, "batch", None)):
        raise PluginError(
            f"data plugin {spec.import_!r} returned {type(dataset).__name__}, which has no batch(indices)"
        )
    return dataset


def _build_model(problem: ProblemSpec, dataset: Dataset) -> torch.nn.Module:
    spec = problem.model
    if isinstance(spec, MLPSpec):
        return MLP(spec, in_features=dataset.in_features, out_features=dataset.out_features, seed=problem.seed)
    if isinstance(spec, GPTSpec):
        return GPT(spec, vocab_size=dataset.vocab_size, block_size=dataset.seq_len, seed=problem.seed)
    if isinstance(spec, HFModelSpec):
        return hf.build_hf_model(spec, vocab_size=dataset.vocab_size, seq_len=dataset.seq_len)
    fn = resolve(spec, role="model")
    try:
        model = fn(**spec.args)
    except Exception as exc:  # noqa: BLE001
        raise PluginError(f"model plugin {spec.import_!r} raised {type(exc).__name__}: {exc}") from None
    if not isinstance(model, torch.nn.Module):
        raise PluginError(f"model plugin {spec.import_!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def check_problem(problem: ProblemSpec) -> BuiltProblem:
    """Build the problem and push two samples through it, before any process starts; returns what
    was built (its model's sizes decide what a cell can do: nvme offload).

    Raises PluginError naming the plugin that breaks the contract.
    """
    from gaeq.problem.models import sample_keys

    built = build_problem(problem)
    name = lambda role: getattr(getattr(problem, role), "import_", role)  # noqa: E731
    try:
        batch = built.dataset.batch([0, 1])
    except Exception as exc:  # noqa: BLE001
        raise PluginError(f"data {name('data')!r}: batch([0, 1]) raised {type(exc).__name__}: {exc}") from None
    if not (isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise PluginError(
            f"data {name('data')!r}: batch() must return (inputs, targets) tensors, got {type(batch).__name__}"
        )
    try:
        counts = [built.loss_elements(i) for i in (0, 1)]
    except Exception as exc:  # noqa: BLE001
        raise PluginError(f"data {name('data')!r}: loss_elements() raised {type(exc).__name__}: {exc}") from None
    if any(c <= 0 for c in counts):
        raise PluginError(f"data {name('data')!r}: loss_elements() must be positive, got {counts}")
    try:
        with sample_keys([0, 1]):
            loss = built.micro_loss(built.model, *batch, num_items=sum(counts))
    except Exception as exc:  # noqa: BLE001
        raise PluginError(f"model/loss: a forward pass on two samples raised {type(exc).__name__}: {exc}") from None
    if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.requires_grad):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise PluginError(f"loss {name('loss')!r} must return a scalar tensor with a gradient (a sum), got {shape}")
    return built
