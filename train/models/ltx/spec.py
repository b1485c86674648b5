"""LTX-Video's training spec: packed latents, the post-patch grid and the rope interpolation scale."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers.pipelines.ltx.pipeline_ltx import LTXPipeline, calculate_shift

from train.models.spec import (
    FamilySpec,
    ShiftSpec,
    frozen,
    output_tensors,
    patched_tokens,
    sigma_times_1000,
    uniform_value,
)

# Lightricks/LTX-Video (0.9.1) scheduler/scheduler_config.json (relevant keys).
SCHEDULER_CONFIG = frozen(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
)

# LTXPipeline defaults: AutoencoderKLLTXVideo compression ratios and `frame_rate`.
VAE_SPATIAL_COMPRESSION = 32
VAE_TEMPORAL_COMPRESSION = 8
FRAME_RATE = 25


def _patch_sizes(model_config: Mapping[str, Any]) -> tuple[int, int]:
    return int(model_config.get("patch_size", 1)), int(model_config.get("patch_size_t", 1))


def build_inputs(
    batch: Mapping[str, Any],
    noisy_latents: Mapping[str, torch.Tensor],
    timesteps: Mapping[str, torch.Tensor],
    *,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
    latents = noisy_latents["latents"]
    _, _, frames, height, width = latents.shape
    patch_size, patch_size_t = _patch_sizes(model_config)
    frame_rate = batch.get("frame_rate")
    frame_rate = FRAME_RATE if frame_rate is None else uniform_value(torch.as_tensor(frame_rate), "frame_rate")
    mask = batch.get("prompt_mask")
    return {
        "hidden_states": LTXPipeline._pack_latents(latents, patch_size, patch_size_t),
        "encoder_hidden_states": batch["prompt_embeds"],
        "timestep": timesteps["latents"],
        "encoder_attention_mask": None if mask is None else mask.bool(),
        "num_frames": frames // patch_size_t,
        "height": height // patch_size,
        "width": width // patch_size,
        "rope_interpolation_scale": (
            VAE_TEMPORAL_COMPRESSION / frame_rate,
            VAE_SPATIAL_COMPRESSION,
            VAE_SPATIAL_COMPRESSION,
        ),
    }


def unpack_output(
    out: Any, latents_shapes: Mapping[str, torch.Size], *, model_config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    _, _, frames, height, width = latents_shapes["latents"]
    patch_size, patch_size_t = _patch_sizes(model_config)
    pred = LTXPipeline._unpack_latents(
        output_tensors(out)[0],
        frames // patch_size_t,
        height // patch_size,
        width // patch_size,
        patch_size,
        patch_size_t,
    )
    return {"latents": pred}


def shift_seq_len(latents_shape: Sequence[int]) -> int:
    _, frames, height, width = latents_shape
    return frames * height * width  # LTXPipeline: latent_num_frames * latent_height * latent_width


def count_tokens(latents_shapes: Mapping[str, tuple[int, ...]], model_config: Mapping[str, Any]) -> int:
    patch_size, patch_size_t = _patch_sizes(model_config)
    return patched_tokens(latents_shapes["latents"], (patch_size_t, patch_size, patch_size))


SPEC = FamilySpec(
    name="ltx",
    transformer_class="LTXVideoTransformer3DModel",
    pipeline_class="LTXPipeline",
    vae_class="AutoencoderKLLTXVideo",
    latent_kind="video",
    # Self- and cross-attention projections (`attn1` / `attn2`), as the diffusers/finetrainers LTX LoRA recipes.
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    shift=ShiftSpec.linear_mu(SCHEDULER_CONFIG, calculate_shift),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_times_1000,
    count_tokens=count_tokens,
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "prompt_embeds", "prompt_mask"),
    text_mask_kwarg="encoder_attention_mask",
)
