"""Wan VACE's training spec: Wan's inputs plus the control stream, the cached VACE conditioning as
``control_hidden_states`` at WanVACEPipeline's default ``conditioning_scale`` (1 for every VACE layer)."""

from __future__ import annotations

import dataclasses
from typing import Any

from train.models import Batch, Config, Streams
from train.models.wan import spec as wan


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    latents = noisy_latents["latents"]
    control = batch["control_latents"].to(latents.dtype)  # the pipeline: conditioning_latents.to(transformer_dtype)
    if control.shape[0] != latents.shape[0] or control.shape[2:] != latents.shape[2:]:
        raise ValueError(f"control_latents {tuple(control.shape)} must match latents {tuple(latents.shape)} in batch, "
                         "frames and size")  # fmt: skip
    return wan.build_inputs(batch, noisy_latents, timesteps, model_config=model_config) | {
        "control_hidden_states": control,
        # conditioning_scale=1.0 -> one scale per VACE layer, a tensor in the transformer's dtype
        "control_hidden_states_scale": latents.new_ones(len(model_config["vace_layers"])),
    }


# Wan-AI/Wan2.1-VACE-{1.3B,14B}-diffusers: Wan 2.1's VAE, text and flow shift 3.0 (diffusers' conversion gives VACE's
# scheduler 3.0; set model.flow_shift for 720p). LoRA on Wan's attention projections matches the main blocks' and the
# control blocks' (`vace_blocks.*.attn1` / `attn2`). The control tokens run beside the noisy latents' tokens, one for
# one: the sequence is Wan's.
SPEC = dataclasses.replace(
    wan.SPEC,
    name="wan_vace",
    classes=wan.SPEC.classes._replace(transformer="WanVACETransformer3DModel", pipeline="WanVACEPipeline"),
    build_inputs=build_inputs,
    batch_keys=("latents", "prompt_embeds", "control_latents"),
    # diffusers' Wan converter names no VACE layer (`vace_blocks`): no original format is proven for it
    lora_format=None,
)
