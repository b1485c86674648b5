"""FLUX.1 Kontext's training spec: FLUX.1's, with the reference image's packed latents after the target tokens, their
position ids offset (first coordinate 1), and the prediction cut back to the target tokens."""

from __future__ import annotations

from typing import Any

import torch

from train.models import Batch, Config, Streams
from train.models.flux import spec as base


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    from diffusers.pipelines.flux.pipeline_flux_kontext import FluxKontextPipeline

    kwargs = base.build_inputs(batch, noisy_latents, timesteps, model_config=model_config)
    target = noisy_latents["latents"]
    reference = batch["reference_latents"].to(device=target.device, dtype=target.dtype)  # (B, C, H', W')
    batch_size, channels, height, width = reference.shape
    ids = kwargs["img_ids"]
    # FluxKontextPipeline.prepare_latents: image ids are the latent ids of the reference grid with coordinate 0 set to
    # 1; the denoising loop feeds cat([latents, image_latents], dim=1) and cat([latent_ids, image_ids], dim=0).
    packed = FluxKontextPipeline._pack_latents(reference, batch_size, channels, height, width)
    grid = (height // 2, width // 2)
    image_ids = FluxKontextPipeline._prepare_latent_image_ids(batch_size, *grid, ids.device, ids.dtype)
    image_ids[..., 0] = 1
    return kwargs | {
        "hidden_states": torch.cat([kwargs["hidden_states"], packed], dim=1),
        "img_ids": torch.cat([ids, image_ids], dim=0),
    }


SPEC = base.SPEC.with_appended_latents(
    "reference_latents",
    name="flux_kontext",
    classes=base.SPEC.classes._replace(pipeline="FluxKontextPipeline"),
    build_inputs=build_inputs,
)
