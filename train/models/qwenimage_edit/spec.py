"""Qwen-Image-Edit's training spec: Qwen-Image's, with the reference image's packed latents after the target tokens,
two entries per sample in ``img_shapes``, and the prediction cut back to the target tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline

from train.models.qwenimage import spec as base
from train.models.spec import output_tensors, patched_tokens


def build_inputs(
    batch: Mapping[str, Any],
    noisy_latents: Mapping[str, torch.Tensor],
    timesteps: Mapping[str, torch.Tensor],
    *,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
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


def unpack_output(
    out: Any, latents_shapes: Mapping[str, torch.Size], *, model_config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    # noise_pred[:, : latents.size(1)]: only the target tokens are a prediction (the loss never sees the reference)
    *_, height, width = latents_shapes["latents"]
    target = output_tensors(out)[0][:, : (height // 2) * (width // 2)]
    return base.unpack_output((target,), latents_shapes, model_config=model_config)


def count_tokens(latents_shapes: Mapping[str, tuple[int, ...]], model_config: Mapping[str, Any]) -> int:
    """Target plus reference tokens (the sequence the transformer runs); the reference counts like the target when
    its shape is not given (the trainer's throughput passes the noised streams only)."""
    reference = latents_shapes.get("reference_latents", latents_shapes["latents"])
    return base.count_tokens(latents_shapes, model_config) + patched_tokens(reference, (1, 2, 2))


SPEC = dataclasses.replace(
    base.SPEC,
    name="qwenimage_edit",
    pipeline_class="QwenImageEditPipeline",
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    count_tokens=count_tokens,
    batch_keys=(*base.SPEC.batch_keys, "reference_latents"),
)
