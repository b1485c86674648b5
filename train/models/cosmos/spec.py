"""Cosmos Predict 2.5's training spec: the latents with their clean conditioning frames, the condition-mask channel,
one timestep (sigma) per latent frame, as Cosmos2_5_PredictBasePipeline's denoising loop passes them."""

from __future__ import annotations

from typing import Any

import torch

from train.models import Batch, Config, Streams
from train.models.spec import Classes, FamilySpec, sigma_identity
from train.models.wan import spec as wan

# Cosmos2_5_PredictBasePipeline.__call__(conditional_frame_timestep=0.0001): the timestep of the clean frames
CONDITION_TIMESTEP = 1e-4
VAE_SPATIAL = 8  # AutoencoderKLWan (Wan 2.1)'s stride: the pipeline's padding mask is (1, 1, height, width) in pixels


def frame_condition(batch: Batch, latents: torch.Tensor) -> torch.Tensor:
    """The ``condition_mask`` (B, 1, F, 1, 1): 1 on the clean conditioning latent frames of each sample, the cache's
    ``condition_mask`` (B, F) (a prefix of 0, 1 or 2 frames: text2world, image2world, video2world); the pipeline's
    ``cond_indicator`` (``create_condition_mask``)."""
    frames = batch["condition_mask"].to(device=latents.device, dtype=latents.dtype)
    return frames.reshape(latents.shape[0], 1, latents.shape[2], 1, 1)


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    latents, timestep = noisy_latents["latents"], timesteps["latents"]
    batch_size, _, frames, height, width = latents.shape
    indicator = frame_condition(batch, latents)  # (B, 1, F, 1, 1)
    # sigma per frame (0 on the clean frames, condition_sigmas), or (B,) when no mask was applied
    sigma = timestep.reshape(batch_size, 1, -1, 1, 1).expand(batch_size, 1, frames, 1, 1)
    indicator_t = indicator.to(sigma.dtype)
    return {
        # the clean frames are the cached ones: in_latents = cond_mask * cond_latent + (1 - cond_mask) * latents
        "hidden_states": latents,
        "condition_mask": indicator.expand(batch_size, 1, frames, height, width),  # cond_mask, transformer dtype
        # in_timestep = cond_indicator * conditional_frame_timestep + (1 - cond_indicator) * sigma: (B, 1, F, 1, 1)
        "timestep": indicator_t * CONDITION_TIMESTEP + (1 - indicator_t) * sigma,
        "encoder_hidden_states": batch["prompt_embeds"],
        # zeros(1, 1, height, width), which forward() resizes (nearest) to the latent grid: zeros whatever the size
        "padding_mask": latents.new_zeros(1, 1, height * VAE_SPATIAL, width * VAE_SPATIAL),
    }


SPEC = FamilySpec(
    name="cosmos",
    classes=Classes("CosmosTransformer3DModel", "Cosmos2_5_PredictBasePipeline", "AutoencoderKLWan"),
    latent_kind="video",
    # Training sigmas: the released Predict 2.5 training config's rectified flow with a static shift of 5
    # (cosmos-predict2.5 `released_config`: "shift": 5, "use_dynamic_shift": False), written as the UniPC flow shift
    # it equals. The Diffusers folder's scheduler (UniPCMultistepScheduler with Karras flow sigmas between sigma_min
    # 0.01 and sigma_max 200, as diffusers' convert_cosmos_to_diffusers.py writes it) is an inference schedule, not a
    # training density.
    shift=wan.unipc_flow_shift(5.0),
    build_inputs=build_inputs,
    batch_keys=("latents", "prompt_embeds", "condition_mask"),
    # the pipeline passes sigma itself (scheduler.sigmas[i]) as the timestep
    timestep_from_sigma=sigma_identity,
    # the clean conditioning frames are not noised and are left out of the loss (the pipeline replaces the
    # prediction there by the ground-truth velocity)
    condition_mask=frame_condition,
)
