"""Export trained weights in formats diffusers loads: full weights via `save_pretrained`, LoRA weights via the family
pipeline's `save_lora_weights` (with the adapter metadata, so `lora_alpha != r` reloads with the right scale)."""

from __future__ import annotations

from pathlib import Path

import diffusers
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def _full_state_dict(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    # Collective: every rank must call it (FSDP2 shards are gathered to rank 0, on CPU).
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=opts)


def export_full(model: torch.nn.Module, out_dir: Path) -> Path | None:
    """`save_pretrained` of the whole transformer (rank 0 writes)."""
    state = _full_state_dict(model, trainable_only=False)
    path = out_dir / "transformer"
    if dist.get_rank() == 0:
        # An unhooked, unsharded twin built on the meta device (no second random init of the whole model): the
        # gathered tensors become its parameters as they are (assign=True), so rank 0 holds the weights once.
        with torch.device("meta"):
            twin = type(model).from_config(model.config)
        twin.load_state_dict(state, assign=True, strict=True)
        twin.save_pretrained(path)
    dist.barrier()
    return path


def export_lora(model: torch.nn.Module, pipeline_class: str, out_dir: Path) -> Path | None:
    """LoRA weights as `pytorch_lora_weights.safetensors` that `<Pipeline>.load_lora_weights(dir)` accepts."""
    from peft.utils import get_peft_model_state_dict

    state = _full_state_dict(model, trainable_only=True)
    path = out_dir / "lora"
    if dist.get_rank() == 0:
        lora = get_peft_model_state_dict(model, state_dict=state)
        pipeline = getattr(diffusers, pipeline_class)
        pipeline.save_lora_weights(
            path,
            transformer_lora_layers=lora,
            transformer_lora_adapter_metadata=model.peft_config["default"].to_dict(),
        )
    dist.barrier()
    return path
