"""LTX-Video image-to-video's training spec: LTX's, with a clean first latent frame and per-token timesteps."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from train.models import Batch, Config, Streams
from train.models.ltx import spec as ltx
from train.models.spec import first_frame_condition


def token_timesteps(timestep: torch.Tensor, latents_shape: torch.Size, model_config: Config) -> torch.Tensor:
    """The pipeline's per-token timestep (B, S), ``t * (1 - conditioning_mask)`` with the mask packed by
    ``_pack_latents`` (then ``squeeze(-1)``): the per-element ``timestep`` (broadcastable to ``latents_shape``, 0 on
    the clean first frame) packed the same way, one value per token."""
    from diffusers.pipelines.ltx.pipeline_ltx_image2video import LTXImageToVideoPipeline

    batch, _, frames, height, width = latents_shape
    patch_size, patch_size_t = ltx._patch_sizes(model_config)
    full = timestep.expand(batch, 1, frames, height, width)
    return LTXImageToVideoPipeline._pack_latents(full, patch_size, patch_size_t)[..., 0]


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    latents, timestep = noisy_latents["latents"], timesteps["latents"]
    if timestep.ndim != latents.ndim:
        raise ValueError(f"ltx_i2v takes per-element timesteps (condition_mask), got shape {tuple(timestep.shape)}")
    kwargs = ltx.build_inputs(batch, noisy_latents, timesteps, model_config=model_config)
    kwargs["timestep"] = token_timesteps(timestep, latents.shape, model_config)
    return kwargs


SPEC = dataclasses.replace(
    ltx.SPEC,
    name="ltx_i2v",
    classes=ltx.SPEC.classes._replace(pipeline="LTXImageToVideoPipeline"),
    build_inputs=build_inputs,
    # 1 on latent frame 0, the image LTXImageToVideoPipeline.prepare_latents keeps clean (`conditioning_mask[:, :, 0]
    # = 1`)
    condition_mask=first_frame_condition,
)
