"""Wan 2.2 TI2V-5B's training spec: image-to-video with the clean first latent frame and per-token timesteps
(WanImageToVideoPipeline with ``expand_timesteps=True``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from train.models import Batch, Config, Streams
from train.models.spec import first_frame_condition
from train.models.wan import spec as wan


def token_timesteps(timestep: torch.Tensor, latents_shape: torch.Size, patch_size: Any) -> torch.Tensor:
    """The pipeline's per-token timestep (B, S): ``(first_frame_mask[0][0][:, ::p_h, ::p_w] * t).flatten()``, i.e.
    one value per (1, p_h, p_w) patch in the transformer's (F, H / p_h, W / p_w) token order. ``timestep`` is per
    latent element, broadcastable to ``latents_shape`` (B, C, F, H, W): 0 on the clean first frame."""
    batch, _, frames, height, width = latents_shape
    _, p_h, p_w = patch_size
    grid = timestep.expand(batch, 1, frames, height, width)[:, 0, :, ::p_h, ::p_w]
    return grid.reshape(batch, -1)


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    latents, timestep = noisy_latents["latents"], timesteps["latents"]
    if timestep.ndim != latents.ndim:
        raise ValueError(f"wan22_ti2v takes per-element timesteps (condition_mask), got shape {tuple(timestep.shape)}")
    return {
        "hidden_states": latents,  # frame 0 is the clean image latent: the trainer does not noise it
        "timestep": token_timesteps(timestep, latents.shape, model_config["patch_size"]),
        "encoder_hidden_states": batch["prompt_embeds"],
    }


SPEC = dataclasses.replace(
    wan.SPEC,
    name="wan22_ti2v",
    classes=wan.SPEC.classes._replace(pipeline="WanImageToVideoPipeline"),
    # Wan-AI/Wan2.2-TI2V-5B-Diffusers: flow shift 5.0 (Wan 2.2's ti2v_5B sample_shift)
    shift=wan.unipc_flow_shift(5.0),
    build_inputs=build_inputs,
    # 1 on latent frame 0, the image the pipeline keeps clean (``1 - first_frame_mask`` of
    # ``WanImageToVideoPipeline.prepare_latents`` with ``expand_timesteps``); its tokens still count
    condition_mask=first_frame_condition,
)
