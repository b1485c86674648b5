"""Qwen-Image-Edit-Plus' training spec: Qwen-Image's, with each control image's packed latents after the target tokens
(in order), one ``img_shapes`` entry per image, and the prediction cut back to the target tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from train.models import Batch, Config, Streams
from train.models.qwenimage import spec as base
from train.models.spec import patched_tokens

# The cache keys of an item's 1-3 control images, in the order the pipeline takes them (an item has the first k).
REFERENCES = ("reference_latents", "reference_latents_2", "reference_latents_3")


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import QwenImageEditPlusPipeline

    kwargs = base.build_inputs(batch, noisy_latents, timesteps, model_config=model_config)
    target = noisy_latents["latents"]  # (B, C, 1, H, W)
    packed, shapes = [], []
    for key in (k for k in REFERENCES if k in batch):
        image = batch[key].to(device=target.device, dtype=target.dtype)  # (B, C, 1, H', W')
        size, channels, _, height, width = image.shape
        # QwenImageEditPlusPipeline.prepare_latents packs each image's latents and concatenates them in order
        packed.append(QwenImageEditPlusPipeline._pack_latents(image, size, channels, height, width))
        shapes.append((1, height // 2, width // 2))
    (target_shape,) = kwargs["img_shapes"][0]
    # the denoising loop feeds cat([latents, image_latents], dim=1), img_shapes [target, image 1, image 2, ...]; a
    # zero_cond_t transformer (2511) reads the same img_shapes to give the image tokens timestep 0 (modulate_index)
    return kwargs | {
        "hidden_states": torch.cat([kwargs["hidden_states"], *packed], dim=1),
        "img_shapes": [[target_shape, *shapes]] * target.shape[0],
    }


def count_tokens(latents_shapes: Mapping[str, Sequence[int]], model_config: Config) -> int:
    """The target's and each control image's patches; one control image of the target's size where the shapes give
    none (the trainer's throughput passes the noised stream only)."""
    patch, target = base.SPEC.patch.of(model_config), latents_shapes["latents"]
    images = [latents_shapes[k] for k in REFERENCES if k in latents_shapes] or [target]
    return sum(patched_tokens(shape, patch) for shape in (target, *images))


SPEC = base.SPEC.with_appended_latents(
    "reference_latents",  # every item has a first control image; the others are optional keys
    name="qwenimage_edit_plus",
    classes=base.SPEC.classes._replace(pipeline="QwenImageEditPlusPipeline"),
    build_inputs=build_inputs,
    count_tokens=count_tokens,
)
