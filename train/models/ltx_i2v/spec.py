"""LTX-Video image-to-video's training spec: LTX's, with a clean first latent frame and per-token timesteps."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from diffusers.pipelines.ltx.pipeline_ltx_image2video import LTXImageToVideoPipeline

from train.models.ltx.spec import SPEC as LTX_SPEC
from train.models.ltx.spec import _patch_sizes
from train.models.ltx.spec import build_inputs as ltx_build_inputs


def condition_mask(batch: Mapping[str, Any], latents: torch.Tensor) -> torch.Tensor:
    """(B, 1, F, 1, 1): 1 on latent frame 0, the image LTXImageToVideoPipeline.prepare_latents keeps clean
    (``conditioning_mask[:, :, 0] = 1``)."""
    mask = latents.new_zeros(latents.shape[0], 1, latents.shape[2], 1, 1)
    mask[:, :, 0] = 1
    return mask


def token_timesteps(timestep: torch.Tensor, latents_shape: torch.Size, model_config: Mapping[str, Any]) -> torch.Tensor:
    """The pipeline's per-token timestep (B, S), ``t * (1 - conditioning_mask)`` with the mask packed by
    ``_pack_latents`` (then ``squeeze(-1)``): the per-element ``timestep`` (broadcastable to ``latents_shape``, 0 on
    the clean first frame) packed the same way, one value per token."""
    batch, _, frames, height, width = latents_shape
    patch_size, patch_size_t = _patch_sizes(model_config)
    full = timestep.expand(batch, 1, frames, height, width)
    return LTXImageToVideoPipeline._pack_latents(full, patch_size, patch_size_t)[..., 0]


def build_inputs(
    batch: Mapping[str, Any],
    noisy_latents: Mapping[str, torch.Tensor],
    timesteps: Mapping[str, torch.Tensor],
    *,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
    latents, timestep = noisy_latents["latents"], timesteps["latents"]
    if timestep.ndim != latents.ndim:
        raise ValueError(f"ltx_i2v takes per-element timesteps (condition_mask), got shape {tuple(timestep.shape)}")
    kwargs = ltx_build_inputs(batch, noisy_latents, timesteps, model_config=model_config)
    kwargs["timestep"] = token_timesteps(timestep, latents.shape, model_config)
    return kwargs


SPEC = dataclasses.replace(
    LTX_SPEC,
    name="ltx_i2v",
    pipeline_class="LTXImageToVideoPipeline",
    build_inputs=build_inputs,
    condition_mask=condition_mask,
)
