"""Sharded checkpoints with exact resume: model + optimizer (torch.distributed.checkpoint), LR scheduler, data
position and RNG state, every N steps, keeping the last K.

Layout: `<output_dir>/checkpoints/step_000004/` holds the DCP shards, `trainer.pt` (scheduler, step, sampler
position), `rng_rank<r>.pt` per rank, and a `COMPLETE` marker written last, so a run killed mid-save never resumes
from a partial checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class AppState(Stateful):
    """Model + optimizer through DCP's state-dict helpers (handles FSDP2 shards and frozen LoRA bases)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool) -> None:
        self.model, self.optimizer = model, optimizer
        # LoRA: only the adapters are saved; the frozen base comes from the pretrained weights again on resume.
        self.options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self.options)  # fmt: skip


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    done = sorted(p.parent for p in checkpoint_root(output_dir).glob("step_*/COMPLETE"))
    return done[-1] if done else None


def save_checkpoint(output_dir: str | Path, step: int, app: AppState, trainer_state: dict, keep_last: int) -> Path:
    path = checkpoint_root(output_dir) / f"step_{step:06d}"
    dcp.save({"app": app}, checkpoint_id=str(path))
    rank = dist.get_rank()
    torch.save({"torch": torch.get_rng_state()}, path / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save(trainer_state, path / "trainer.pt")
    dist.barrier()
    if rank == 0:
        (path / "COMPLETE").touch()
        complete = sorted(p.parent for p in checkpoint_root(output_dir).glob("step_*/COMPLETE"))
        for old in complete[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load_checkpoint(path: Path, app: AppState) -> dict:
    """Restore model/optimizer in place and this rank's RNG; return the trainer state (step, scheduler, data)."""
    dcp.load({"app": app}, checkpoint_id=str(path))
    rng = path / f"rng_rank{dist.get_rank()}.pt"
    if rng.exists():  # absent when resuming on a different number of ranks: RNG then restarts from the seed
        torch.set_rng_state(torch.load(rng)["torch"])
    return torch.load(path / "trainer.pt", weights_only=False)
