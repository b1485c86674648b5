"""Wan 2.1 image-to-video's training spec: Wan's, with the first-frame mask and the condition latents concatenated in
channels (WanImageToVideoPipeline's denoising loop; ChronoEdit reuses it)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from train.models import Batch, Config, Streams
from train.models.wan import spec as wan

VAE_SCALE_FACTOR_TEMPORAL = 4


def first_frame_mask(latents: torch.Tensor, vae_scale_factor_temporal: int = VAE_SCALE_FACTOR_TEMPORAL) -> torch.Tensor:
    """The (B, vae_scale_factor_temporal, F, H, W) mask of ``WanImageToVideoPipeline.prepare_latents`` (no last image).

    The pipeline builds a pixel-frame mask (1 on frame 0), repeats frame 0 ``vae_scale_factor_temporal`` times and
    folds groups of that many pixel frames into channels: latent frame 0 is all ones, the others all zeros.
    """
    batch_size, _, frames, height, width = latents.shape
    mask = latents.new_zeros(batch_size, vae_scale_factor_temporal, frames, height, width)
    mask[:, :, 0] = 1
    return mask


def channel_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams) -> dict[str, Any]:
    """The kwargs of WanImageToVideoPipeline's loop without ``expand_timesteps``, image embeddings aside:
    ``hidden_states = cat([latents, mask, condition_latents], dim=1)``, the timestep, the text (Wan 2.2 A14B's whole
    input; Wan 2.1 adds the CLIP image embeddings)."""
    latents = noisy_latents["latents"]
    condition = batch["condition_latents"].to(latents.dtype)
    if condition.shape != latents.shape:
        raise ValueError(f"condition_latents {tuple(condition.shape)} must match latents {tuple(latents.shape)}")
    return {
        "hidden_states": torch.cat([latents, first_frame_mask(condition), condition], dim=1),
        "timestep": timesteps["latents"],
        "encoder_hidden_states": batch["prompt_embeds"],
    }


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    return channel_inputs(batch, noisy_latents, timesteps) | {"encoder_hidden_states_image": batch["image_embeds"]}


# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers: Wan's transformer and VAE, LoRA targets (`attn2.add_k_proj` / `add_v_proj`, the
# image K/V, stay frozen, as in the Wan I2V recipes) and 480p flow shift 3.0 (the pipeline's docs: 5.0 for 720p; set
# model.flow_shift). The noised latents' tokens are Wan's: the condition channels ride along in the same tokens.
SPEC = dataclasses.replace(
    wan.SPEC,
    name="wan_i2v",
    classes=wan.SPEC.classes._replace(pipeline="WanImageToVideoPipeline"),
    build_inputs=build_inputs,
    batch_keys=("latents", "prompt_embeds", "condition_latents", "image_embeds"),
)
