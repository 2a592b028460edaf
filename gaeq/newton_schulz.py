"""How many Newton–Schulz orthogonalisations this process ran (Muon's, DeepSpeed's or torch's): their
kernels wrapped once with a counter. gaeq's trainers read it per cell (gaeq/trainers/muon.py) and the
probe per step of a user's script (gaeq/script/probe.py). A leaf: no gaeq imports."""

from __future__ import annotations

import functools
import importlib
import sys

KERNELS = {
    "deepspeed.runtime.zero.muon.original_muon": ("zeropower_via_gram_newtonschulz", "zeropower_via_newtonschulz5"),
    "torch.optim._muon": ("_zeropower_via_newtonschulz",),
}
"""The kernels, by module: DeepSpeed's (its muon_update calls one) and torch's Muon's. The updates look
them up when they run, so a wrapped module attribute is what they call."""
_calls = [0]


def calls() -> int:
    """Newton–Schulz calls in this process so far."""
    return _calls[0]


def count(*, loaded_only: bool = False) -> None:
    """Wrap the kernels with the counter (once per process); `loaded_only`: only in modules already
    imported (a user's script pays for no import it did not make)."""
    for module_name, names in KERNELS.items():
        if loaded_only and module_name not in sys.modules:
            continue
        module = importlib.import_module(module_name)
        for name in names:
            kernel = getattr(module, name)
            if getattr(kernel, "counted_by_gaeq", False):
                continue

            @functools.wraps(kernel)
            def counted(*args, _kernel=kernel, **kwargs):
                _calls[0] += 1
                return _kernel(*args, **kwargs)

            counted.counted_by_gaeq = True
            setattr(module, name, counted)
