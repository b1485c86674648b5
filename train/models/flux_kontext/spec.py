"""FLUX.1 Kontext's training spec: FLUX.1's, with the reference image's packed latents after the target tokens, their
position ids offset (first coordinate 1), and the prediction cut back to the target tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from diffusers.pipelines.flux.pipeline_flux_kontext import FluxKontextPipeline

from train.models.flux import spec as base
from train.models.spec import output_tensors, patched_tokens


def build_inputs(
    batch: Mapping[str, Any],
    noisy_latents: Mapping[str, torch.Tensor],
    timesteps: Mapping[str, torch.Tensor],
    *,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
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


def unpack_output(
    out: Any, latents_shapes: Mapping[str, torch.Size], *, model_config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    # noise_pred[:, : latents.size(1)]: only the target tokens are a prediction (the loss never sees the reference)
    _, _, height, width = latents_shapes["latents"]
    target = output_tensors(out)[0][:, : (height // 2) * (width // 2)]
    return base.unpack_output((target,), latents_shapes, model_config=model_config)


def count_tokens(latents_shapes: Mapping[str, tuple[int, ...]], model_config: Mapping[str, Any]) -> int:
    """Target plus reference tokens (the sequence the transformer runs); the reference counts like the target when
    its shape is not given (the trainer's throughput passes the noised streams only)."""
    reference = latents_shapes.get("reference_latents", latents_shapes["latents"])
    return base.count_tokens(latents_shapes, model_config) + patched_tokens(reference, 2)


SPEC = dataclasses.replace(
    base.SPEC,
    name="flux_kontext",
    pipeline_class="FluxKontextPipeline",
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    count_tokens=count_tokens,
    batch_keys=(*base.SPEC.batch_keys, "reference_latents"),
)
