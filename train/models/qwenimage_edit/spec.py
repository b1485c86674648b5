"""Qwen-Image-Edit's training spec: Qwen-Image's, with the reference image's packed latents after the target tokens,
two entries per sample in ``img_shapes``, and the prediction cut back to the target tokens."""

from __future__ import annotations

from typing import Any

import torch

from train.models import Batch, Config, Streams
from train.models.qwenimage import spec as base


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline

    kwargs = base.build_inputs(batch, noisy_latents, timesteps, model_config=model_config)
    target = noisy_latents["latents"]  # (B, C, 1, H, W)
    reference = batch["reference_latents"].to(device=target.device, dtype=target.dtype)  # (B, C, 1, H', W')
    batch_size, channels, _, height, width = reference.shape
    # QwenImageEditPipeline.prepare_latents packs the (B, C, 1, H', W') image latents as they come; the denoising loop
    # feeds cat([latents, image_latents], dim=1) with img_shapes [target, reference] per sample.
    packed = QwenImageEditPipeline._pack_latents(reference, batch_size, channels, height, width)
    (target_shape,) = kwargs["img_shapes"][0]
    return kwargs | {
        "hidden_states": torch.cat([kwargs["hidden_states"], packed], dim=1),
        "img_shapes": [[target_shape, (1, height // 2, width // 2)]] * batch_size,
    }


SPEC = base.SPEC.with_appended_latents(
    "reference_latents",
    name="qwenimage_edit",
    classes=base.SPEC.classes._replace(pipeline="QwenImageEditPipeline"),
    build_inputs=build_inputs,
)
