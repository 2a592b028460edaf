"""Checkpoints for resume experiments: where they live, and how each trainer saves and loads them.

A source cell checkpoints after `step` optimizer steps; a resumed cell loads that state and trains
steps `step`..end with its own split. DeepSpeed checkpoints carry the universal-checkpoint info
that ``ds_to_universal`` needs (so it runs without ``--inject_missing_state``); the parent process
converts them (gaeq.runtime.convert). The torch trainer's checkpoint is its own state dicts, which
are independent of world size and GA by construction.
"""

from __future__ import annotations

from pathlib import Path

from gaeq.files import replacing
from gaeq.matrix import Resume


def checkpoint_root(run_dir: str | Path, source_id: str) -> Path:
    return Path(run_dir) / "checkpoints" / source_id


def deepspeed_tag(step: int, *, universal: bool = False) -> str:
    return f"global_step{step}" + ("_universal" if universal else "")


def torch_checkpoint(run_dir: str | Path, source_id: str, step: int) -> Path:
    return checkpoint_root(run_dir, source_id) / f"torch_step{step}.pt"


# --- DeepSpeed --------------------------------------------------------------------------------


def save_deepspeed(engine, *, run_dir: str | Path, cell_id: str, step: int) -> None:
    """A collective: every rank saves its partitions."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    client_state = {
        UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE},
        "gaeq_step": step,
    }
    engine.save_checkpoint(str(checkpoint_root(run_dir, cell_id)), tag=deepspeed_tag(step), client_state=client_state)


def load_deepspeed(engine, *, run_dir: str | Path, resume: Resume) -> int:
    """Load the source's (converted) checkpoint into a fresh engine; returns the step to train next."""
    root = checkpoint_root(run_dir, resume.source)
    tag = deepspeed_tag(resume.step, universal=resume.universal)
    if not (root / tag).is_dir():
        raise FileNotFoundError(f"no DeepSpeed checkpoint {root / tag} to resume from")
    path, client_state = engine.load_checkpoint(
        str(root),
        tag=tag,
        load_optimizer_states="optimizer" not in resume.drop,  # negative control when dropped
        load_lr_scheduler_states="schedule" not in resume.drop,
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load {root / tag} (see the DeepSpeed messages above)")
    return resume.step


# --- torch ------------------------------------------------------------------------------------


def save_torch(model, optimizer, scheduler, *, run_dir: str | Path, cell_id: str, step: int, rank: int) -> None:
    """Rank 0 writes the (replicated) state dicts, atomically."""
    import torch  # (here: the path helpers above are imported by `gaeq run`'s parent, torch-free)

    if rank != 0:
        return
    path = torch_checkpoint(run_dir, cell_id, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": step,
    }
    with replacing(path) as partial:
        torch.save(state, partial)


def load_torch(model, optimizer, scheduler, *, run_dir: str | Path, resume: Resume) -> int:
    path = torch_checkpoint(run_dir, resume.source, resume.step)
    if not path.is_file():
        raise FileNotFoundError(f"no torch checkpoint {path} to resume from")
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("step") != resume.step:
        raise ValueError(f"{path} holds step {state.get('step')}, expected {resume.step}")
    model.load_state_dict(state["model"])
    if "optimizer" not in resume.drop:  # negative control when dropped
        optimizer.load_state_dict(state["optimizer"])
    if "schedule" not in resume.drop:
        scheduler.load_state_dict(state["scheduler"])
    return resume.step
