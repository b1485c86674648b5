"""Wan 2.1 image-to-video's training spec: Wan's, with the first-frame mask and the condition latents concatenated in
channels (WanImageToVideoPipeline's denoising loop; ChronoEdit reuses it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from train.models.spec import FamilySpec, ShiftSpec, frozen, sigma_times_1000
from train.models.wan.spec import count_tokens, unpack_output  # the same output layout as Wan

# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers scheduler/scheduler_config.json (relevant keys): UniPC with flow sigmas, the
# 480p flow shift 3.0 (WanImageToVideoPipeline's docs: 5.0 for 720p; set model.flow_shift).
SCHEDULER_CONFIG = frozen(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
)

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


def build_inputs(
    batch: Mapping[str, Any],
    noisy_latents: Mapping[str, torch.Tensor],
    timesteps: Mapping[str, torch.Tensor],
    *,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
    latents = noisy_latents["latents"]
    condition = batch["condition_latents"].to(latents.dtype)
    if condition.shape != latents.shape:
        raise ValueError(f"condition_latents {tuple(condition.shape)} must match latents {tuple(latents.shape)}")
    return {
        "hidden_states": torch.cat([latents, first_frame_mask(condition), condition], dim=1),
        "timestep": timesteps["latents"],
        "encoder_hidden_states": batch["prompt_embeds"],
        "encoder_hidden_states_image": batch["image_embeds"],
    }


SPEC = FamilySpec(
    name="wan_i2v",
    transformer_class="WanTransformer3DModel",
    pipeline_class="WanImageToVideoPipeline",
    vae_class="AutoencoderKLWan",
    latent_kind="video",
    # Wan attention projections; `attn2.add_k_proj` / `add_v_proj` (image K/V) stay frozen, as in the Wan I2V recipes.
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    shift=ShiftSpec(
        kind="static",
        scheduler_class="UniPCMultistepScheduler",
        scheduler_config=SCHEDULER_CONFIG,
        shift=SCHEDULER_CONFIG["flow_shift"],
    ),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_times_1000,
    count_tokens=count_tokens,  # the noised latents' tokens (the condition channels ride along in the same tokens)
    batch_keys=("latents", "prompt_embeds", "condition_latents", "image_embeds"),
)
