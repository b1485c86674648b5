"""Wan 2.2 TI2V-5B's training spec: image-to-video with the clean first latent frame and per-token timesteps
(WanImageToVideoPipeline with ``expand_timesteps=True``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from train.models.spec import FamilySpec, ShiftSpec, frozen, sigma_times_1000
from train.models.wan.spec import count_tokens, unpack_output  # the same output layout as Wan

# Wan-AI/Wan2.2-TI2V-5B-Diffusers scheduler/scheduler_config.json (relevant keys): UniPC with flow sigmas and flow
# shift 5.0 (Wan 2.2's ti2v_5B sample_shift).
SCHEDULER_CONFIG = frozen(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=5.0,
)


def condition_mask(batch: Mapping[str, Any], latents: torch.Tensor) -> torch.Tensor:
    """(B, 1, F, 1, 1): 1 on latent frame 0, the image the pipeline keeps clean (``1 - first_frame_mask`` of
    ``WanImageToVideoPipeline.prepare_latents`` with ``expand_timesteps``)."""
    mask = latents.new_zeros(latents.shape[0], 1, latents.shape[2], 1, 1)
    mask[:, :, 0] = 1
    return mask


def token_timesteps(timestep: torch.Tensor, latents_shape: torch.Size, patch_size: Any) -> torch.Tensor:
    """The pipeline's per-token timestep (B, S): ``(first_frame_mask[0][0][:, ::p_h, ::p_w] * t).flatten()``, i.e.
    one value per (1, p_h, p_w) patch in the transformer's (F, H / p_h, W / p_w) token order. ``timestep`` is per
    latent element, broadcastable to ``latents_shape`` (B, C, F, H, W): 0 on the clean first frame."""
    batch, _, frames, height, width = latents_shape
    _, p_h, p_w = patch_size
    grid = timestep.expand(batch, 1, frames, height, width)[:, 0, :, ::p_h, ::p_w]
    return grid.reshape(batch, -1)


def build_inputs(
    batch: Mapping[str, Any],
    noisy_latents: Mapping[str, torch.Tensor],
    timesteps: Mapping[str, torch.Tensor],
    *,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
    latents, timestep = noisy_latents["latents"], timesteps["latents"]
    if timestep.ndim != latents.ndim:
        raise ValueError(f"wan22_ti2v takes per-element timesteps (condition_mask), got shape {tuple(timestep.shape)}")
    return {
        "hidden_states": latents,  # frame 0 is the clean image latent: the trainer does not noise it
        "timestep": token_timesteps(timestep, latents.shape, model_config["patch_size"]),
        "encoder_hidden_states": batch["prompt_embeds"],
    }


SPEC = FamilySpec(
    name="wan22_ti2v",
    transformer_class="WanTransformer3DModel",
    pipeline_class="WanImageToVideoPipeline",
    vae_class="AutoencoderKLWan",
    latent_kind="video",
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
    count_tokens=count_tokens,  # every latent frame's tokens, the clean first frame's included
    batch_keys=("latents", "prompt_embeds"),
    condition_mask=condition_mask,
)
