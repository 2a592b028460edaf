"""What the probe reads of a script's weights and gradients: a fingerprint of the initial parameters;
the grad norm at the boundary, summed in float64 (or a DeepSpeed engine's own); and after each
optimizer step a fixed random projection of how far the parameters moved (the update sketch) — a difference in lr,
clipping or the optimizer shows there when the objective still agrees. Nothing here assumes a CPU:
only the projected entries and float64 sums of bounded chunks are made where a tensor lives. Nor one
process per tensor: a DTensor (FSDP2's, tensor parallelism's) is read block by block where it lives and
its sums completed over the ranks holding the other blocks (gaeq.dtensors) — so every rank calls these,
in the same order."""

from __future__ import annotations

import hashlib

import torch

import gaeq.dtensors as dtensors

SKETCH_ENTRIES = 256
"""Entries of each parameter the update sketch projects (fixed positions and weights per parameter)."""


def fingerprint(params: list[torch.Tensor]) -> str:
    """The parameters' values, hashed (the same in every split whose init is the same)."""
    digest = hashlib.blake2b(digest_size=8)
    for p in params:  # a DTensor gathered whole (once, at the first step: a collective of every rank)
        digest.update(dtensors.whole(p.detach()).cpu().contiguous().float().numpy().tobytes())
    return digest.hexdigest()


class UpdateSketch:
    """A fixed random projection of how far the parameters moved from where they started, and its scale
    (the sum of the terms' sizes: the update's size, what a difference is relative to): the same positions
    and weights in every run of the same model, so two runs' sketches differ only where their updates do.
    Only the projected entries are read (on a GPU, 256 entries of each parameter are gathered, never the
    parameter copied); of a DTensor, those in this rank's block, the sums completed over the other blocks'
    ranks — every rank computes it."""

    def __init__(self) -> None:
        self._where: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        """Per parameter: its projected entries' flat positions in this rank's block, their weights, and
        which of the whole tensor's projected entries those are."""
        self._start: list[torch.Tensor] = []

    def start(self, params: list[torch.Tensor]) -> None:
        """Before the first update: where the projected entries start."""
        if self._where is None:
            self._where = []
            for i, p in enumerate(params):
                g = torch.Generator().manual_seed(1_000_003 * (i + 1) + p.numel())
                where = torch.randint(0, p.numel(), (min(SKETCH_ENTRIES, p.numel()),), generator=g)
                weights = torch.randn(len(where), generator=g, dtype=torch.float64)
                here, at = dtensors.entries_here(p, where)
                device = dtensors.local(p).device
                self._where.append((at.to(device), weights[here.cpu()].to(device), here))
            self._start = [self._entries(p, at) for p, (at, _, _) in zip(params, self._where)]

    @staticmethod
    def _entries(p: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return dtensors.local(p.detach()).reshape(-1)[at].double()

    def __call__(self, params: list[torch.Tensor]) -> tuple[float, float]:
        """(Σ weight × (entry − its start), Σ |that|) over the projected entries (one host sync)."""
        self.start(params)
        sums: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # per mesh and sharding: summed over its ranks
        for p, p0, (at, v, _) in zip(params, self._start, self._where):
            term = (self._entries(p, at) - p0) * v
            here = torch.stack([term.sum(), term.abs().sum()])
            key = dtensors.sharded_over(p) + (here.device,)
            sums[key] = (sums[key][0] + here, p) if key in sums else (here, p)
        total = sum((dtensors.sum_over_blocks(t, like).cpu() for t, like in sums.values()), torch.zeros(2).double())
        return float(total[0]), float(total[1])


NORM_CHUNK = 1 << 20
"""Elements of a gradient summed at a time in float64: a bounded copy (8 MB), never one of the whole
gradient — on a GPU, the float64 copy of a large model's gradients would not fit beside them."""


def grad_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm of `grads`, their squares summed in float64 where they live, a chunk at a time — of a
    DTensor (FSDP2's sharded gradients), the whole tensor's: each block's, summed over its ranks. One host
    sync per device, not one per gradient."""
    if not grads:
        return float("nan")
    sums: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # per mesh and sharding: summed over its ranks
    for g in grads:
        here = dtensors.local(g.detach())
        squares = sum(
            (chunk.double().square().sum() for chunk in here.reshape(-1).split(NORM_CHUNK)),
            torch.zeros((), dtype=torch.float64, device=here.device),
        )
        key = dtensors.sharded_over(g) + (here.device,)
        sums[key] = (sums[key][0] + squares, g) if key in sums else (squares, g)
    total = sum(float(dtensors.sum_over_blocks(t.reshape(1), like)) for t, like in sums.values())
    return total**0.5


FACTOR_PARAMETERS = 64
"""Parameters whose gradients say what the script multiplied them by after the last backward (evenly spread)."""
FACTOR_ENTRIES = 4
"""Entries of each of those read (spread over its block on this rank)."""
ROUNDING = 8
"""Units in the last place of the gradients' dtype that entries multiplied by one factor may differ by in ratio
(each multiplication rounds once)."""


class AsLeft:
    """The gradients as the last backward left them: each parameter, its gradient and that gradient's version — to
    tell at the step whether the script changed them in place since, by no call gaeq patches (a clip written by
    hand) — and a few of their entries, to tell by what factor (a division by the step's token count, Megatron-LM's
    and fairseq's; a clip). Not for a DeepSpeed engine, whose own norm is read."""

    def __init__(self) -> None:
        self.left: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._index: dict[int, int] = {}
        """Each gradient as left, by its id: its place in `left`."""
        self._entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """Per sampled parameter: it, its gradient as left, the flat positions read in that gradient's block on
        this rank, and their values then."""
        self._at: dict[tuple, torch.Tensor] = {}
        self._at_clip: dict | None = None
        """What the gradients were multiplied by between the last backward and the first clip call after it."""
        self.combined: str | None = None
        """How the script combined the ranks' gradients by hand after the last backward (`torch.distributed.all_reduce`
        on them): "sum" or "mean" (ReduceOp.AVG), "unread" (another op, or one left running) — None: not by hand (DDP,
        FSDP or a DeepSpeed engine averages them inside the backward; or one rank)."""
        self._prior = 1.0
        """What the gradients had been multiplied by before that all-reduce."""

    def take(self, model: torch.nn.Module | None) -> None:
        engine = callable(getattr(model, "get_global_grad_norm", None))
        params = [] if model is None or engine else model.parameters()
        self.left = [(p, p.grad, _version(p.grad)) for p in params if p.grad is not None]
        self._index = {id(g): i for i, (_, g, _) in enumerate(self.left)}  # (a hand all-reduce per gradient: O(1))
        self._entries, self._at_clip, self.combined, self._prior = [], None, None, 1.0
        for p, grad, _ in self.left[:: max(1, len(self.left) // FACTOR_PARAMETERS)]:
            here = dtensors.local(grad.detach()).reshape(-1)
            if here.numel():
                at = self._positions(here)
                self._entries.append((p, grad, at, here[at].double()))

    def _positions(self, here: torch.Tensor) -> torch.Tensor:
        n = here.numel()
        if (n, here.device) not in self._at:
            spread = sorted({(2 * k + 1) * n // (2 * FACTOR_ENTRIES) for k in range(FACTOR_ENTRIES)})
            self._at[n, here.device] = torch.tensor(spread, device=here.device)
        return self._at[n, here.device]

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a gradient as the last backward left it (what a hand all-reduce combines): before
        the first such all-reduce, what the gradients had been multiplied by until then is kept."""
        i = self._index.get(id(tensor))
        if i is None or i >= len(self.left) or self.left[i][1] is not tensor:
            return False
        if self.combined is None:
            before = self.factor()
            self._prior = before["factor"] if before is not None and before["factor"] is not None else 1.0
        return True

    def all_reduced(self, tensor: torch.Tensor, op: str | None) -> None:
        """The script all-reduced `tensor`, a gradient as left (:meth:`holds`), over the ranks (`op`: "sum", "mean",
        or None for another op or one left running): the ranks' gradients were combined by hand. From here on a
        factor is relative to the combined gradient, times what the gradients had been multiplied by before; the
        all-reduce itself is no change in place."""
        self.combined = op if self.combined in (None, op) and op is not None else "unread"
        i = self._index[id(tensor)]
        self.left[i] = (*self.left[i][:2], _version(tensor))
        for j, (p, g, at, _) in enumerate(self._entries):
            if g is tensor:
                self._entries[j] = (p, g, at, dtensors.local(g.detach()).reshape(-1)[at].double() / self._prior)

    def changed(self) -> bool:
        """Whether a gradient was changed in place, or replaced, since — by its version, or by the entries read (an
        edit through `.data`, or a kernel outside autograd, as Megatron-LM's clip makes, moves no version) — told
        once; one set to None is no change a step reads."""
        changed = any(p.grad is not None and (p.grad is not g or _version(g) != v) for p, g, v in self.left)
        changed = changed or (self.left and (found := self.factor()) is not None and found["factor"] != 1.0)
        self.left = [] if changed else self.left
        return bool(changed)

    def at_clip(self) -> None:
        """The first clip call after the last backward is about to clip: what the gradients were multiplied by
        until now is a rescale (Megatron-LM's ÷ the step's tokens), what follows a clip."""
        self._at_clip = self.factor()

    def rescale(self, carried: float) -> dict | None:
        """At an optimizer step: what the gradients it receives were multiplied by since the last backward (`factor`)
        and until the first clip call (`before_clip`), × `carried` — the loss scale the backward gave them over the
        one they still carry (GradScaler's unscale_ is no weighting). None where nothing was read."""
        found = self.factor()
        if found is None:
            return None

        def unscaled(said: dict | None) -> dict | None:
            if said is None:
                return None
            if said["factor"] is None:
                return {"factor": None, "range": [x * carried for x in said["range"]]}
            return {"factor": said["factor"] * carried, "resolution": said.get("resolution", 0.0)}

        return unscaled(found) | {"before_clip": unscaled(self._at_clip)}

    def factor(self) -> dict | None:
        """What the gradients were multiplied by since the last backward, from the entries read then and now:
        ``{"factor": f, "resolution": r}`` where every entry was multiplied alike (1: untouched), known to the
        gradients' rounding r; else ``{"factor": None, "range": [least, largest]}``; None where nothing was read (a
        DeepSpeed engine, no gradient). One host read."""
        if not self._entries:
            return None
        before = torch.cat([values for _, _, _, values in self._entries])
        now = torch.cat(
            [dtensors.local(_or(p.grad, g).detach()).reshape(-1)[at] for p, g, at, _ in self._entries]
        ).double()
        ratios = (now / before)[before != 0].cpu()
        if not ratios.numel():
            return None
        low, high = float(ratios.min()), float(ratios.max())
        eps = max(torch.finfo(g.dtype).eps for _, g, _, _ in self._entries)
        if low == high or (low * high > 0 and max(low / high, high / low) - 1 <= ROUNDING * eps):
            return {"factor": float(ratios.median()), "resolution": eps}  # (each entry × f rounded once or twice)
        return {"factor": None, "range": [low, high]}


def _or(grad: torch.Tensor | None, left: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient now, or the one it was left with where the script has set it to None since."""
    return left if grad is None else grad


def _version(grad: torch.Tensor) -> int:
    """A gradient's in-place version: a DTensor's is its local shard's (scaling `to_local()` in place, as a hand
    clip of FSDP2's shards does, leaves the wrapper's own counter as it was)."""
    return dtensors.local(grad)._version


def engine_norm(model: torch.nn.Module | None) -> float | None:
    """A DeepSpeed engine's global grad norm of this step, before clipping: its ZeRO optimizer's
    (computed before it steps the optimizer whose hook asks), else the engine's own (ZeRO-0)."""
    zero = getattr(getattr(model, "optimizer", None), "_global_grad_norm", None)
    if zero is not None:
        return float(zero)
    engine = getattr(model, "get_global_grad_norm", None)
    norm = engine() if callable(engine) else None
    return None if norm is None else float(norm)


def active_dropout(model: torch.nn.Module) -> dict[str, float]:
    """Dropout modules in training mode with p > 0: their masks come from torch's global RNG, which
    draws them for other rows in every split — a split-dependent update, named in the verdict."""
    return {
        name or type(m).__name__: float(m.p)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0
    }
