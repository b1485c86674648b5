"""LTX-Video's training spec: packed latents, the post-patch grid and the rope interpolation scale."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from train.models import Batch, Config, Shapes, Streams
from train.models.ltx.lora_format import FORMAT
from train.models.spec import Classes, FamilySpec, Patch, ShiftSpec, output_tensors, uniform_value

# LTXPipeline defaults: AutoencoderKLLTXVideo compression ratios and `frame_rate`.
VAE_SPATIAL_COMPRESSION = 32
VAE_TEMPORAL_COMPRESSION = 8
FRAME_RATE = 25

PATCH = Patch.time_space(patch_size_t=1, patch_size=1)  # LTXVideoTransformer3DModel's defaults


def _patch_sizes(model_config: Config) -> tuple[int, int]:
    patch_size_t, patch_size, _ = PATCH.of(model_config)
    return patch_size, patch_size_t


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    from diffusers.pipelines.ltx.pipeline_ltx import LTXPipeline

    latents = noisy_latents["latents"]
    _, _, frames, height, width = latents.shape
    patch_size, patch_size_t = _patch_sizes(model_config)
    frame_rate = batch.get("frame_rate")
    frame_rate = FRAME_RATE if frame_rate is None else uniform_value(torch.as_tensor(frame_rate), "frame_rate")
    mask = batch.get("prompt_mask")
    return {
        "hidden_states": LTXPipeline._pack_latents(latents, patch_size, patch_size_t),
        "encoder_hidden_states": batch["prompt_embeds"],
        "timestep": timesteps["latents"],
        "encoder_attention_mask": None if mask is None else mask.bool(),
        "num_frames": frames // patch_size_t,
        "height": height // patch_size,
        "width": width // patch_size,
        "rope_interpolation_scale": (
            VAE_TEMPORAL_COMPRESSION / frame_rate,
            VAE_SPATIAL_COMPRESSION,
            VAE_SPATIAL_COMPRESSION,
        ),
    }


def unpack_output(out: Any, latents_shapes: Shapes, *, model_config: Config) -> dict[str, torch.Tensor]:
    from diffusers.pipelines.ltx.pipeline_ltx import LTXPipeline

    _, _, frames, height, width = latents_shapes["latents"]
    patch_size, patch_size_t = _patch_sizes(model_config)
    pred = LTXPipeline._unpack_latents(
        output_tensors(out)[0],
        frames // patch_size_t,
        height // patch_size,
        width // patch_size,
        patch_size,
        patch_size_t,
    )
    return {"latents": pred}


def shift_seq_len(latents_shape: Sequence[int]) -> int:
    _, frames, height, width = latents_shape
    return frames * height * width  # LTXPipeline: latent_num_frames * latent_height * latent_width


SPEC = FamilySpec(
    lora_format=FORMAT,
    name="ltx",
    classes=Classes("LTXVideoTransformer3DModel", "LTXPipeline", "AutoencoderKLLTXVideo"),
    latent_kind="video",
    # Lightricks/LTX-Video (0.9.1) scheduler/scheduler_config.json (relevant keys): the FlowMatchEulerDiscreteScheduler
    # defaults but these, dynamic shifting
    shift=ShiftSpec.linear_mu(
        "diffusers.pipelines.ltx.pipeline_ltx",
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        shift_terminal=0.1,
    ),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    patch=PATCH,
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "prompt_embeds", "prompt_mask"),
    # The defaults: LoRA on the attention projections of self- and cross-attention (`attn1` / `attn2`), as the
    # diffusers/finetrainers LTX LoRA recipes; timestep sigma * 1000.
)
