"""Wan Animate's training spec: Wan 2.1 I2V's text and CLIP image embeddings, the reference channels in front of the
noisy latents' frames, the pose latents and the face video as WanAnimatePipeline's denoising loop passes them (its
first segment, animation mode)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from train.models import Batch, Config, Streams
from train.models.spec import ATTENTION_PROJECTIONS
from train.models.wan import spec as wan
from train.models.wan_i2v import spec as wan_i2v


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    latents = noisy_latents["latents"]  # (B, C, T + 1, H, W): the reference image's frame, then the clip's T
    reference = batch["reference_latents"]  # (B, 4 + C, T + 1, H, W): [mask | latents] of [image, zeros...]
    pose = batch["pose_latents"]  # (B, C, T, H, W)
    if reference.shape[2:] != latents.shape[2:] or pose.shape[2] + 1 != latents.shape[2]:
        raise ValueError(f"reference_latents {tuple(reference.shape)} must match latents {tuple(latents.shape)} in "
                         f"frames and size, pose_latents {tuple(pose.shape)} have one frame less")  # fmt: skip
    return {
        # latent_model_input = cat([latents, reference_latents], dim=1).to(transformer_dtype)
        "hidden_states": torch.cat([latents, reference.to(latents.dtype)], dim=1),
        "timestep": timesteps["latents"],
        "encoder_hidden_states": batch["prompt_embeds"],
        "encoder_hidden_states_image": batch["image_embeds"],
        "pose_hidden_states": pose.to(latents.dtype),
        "face_pixel_values": batch["face_pixels"].to(latents.dtype),  # the face video in [-1, 1], (B, 3, F, M, M)
    }


# Wan-AI/Wan2.2-Animate-14B-Diffusers: Wan 2.1 I2V-14B's transformer plus the pose patch embedding, the motion and
# face encoders and a face adapter after every 5th block; Wan's VAE; flow shift 5.0 (Wan 2.2's animate_14B
# sample_shift; the Diffusers scheduler config was not in the sources searched: set model.flow_shift if it differs).
# LoRA adapts the blocks' self- and cross-attention, as the Wan I2V recipes (the image K/V `add_k_proj` / `add_v_proj`
# stay frozen, as do the face adapters, whose output projection is no `to_out.0`, and the motion and face encoders:
# a full fine-tune trains them). The tokens are Wan's over T + 1 latent frames (the reference frame first).
SPEC = dataclasses.replace(
    wan_i2v.SPEC,
    name="wan_animate",
    classes=wan.SPEC.classes._replace(transformer="WanAnimateTransformer3DModel", pipeline="WanAnimatePipeline"),
    shift=wan.unipc_flow_shift(5.0),
    build_inputs=build_inputs,
    batch_keys=("latents", "prompt_embeds", "reference_latents", "image_embeds", "pose_latents", "face_pixels"),
    lora_targets=tuple(f"{attn}.{p}" for attn in ("attn1", "attn2") for p in ATTENTION_PROJECTIONS),
    # no full weights in the original layout: the authors' motion encoder holds its conv biases as (1, C, 1, 1) and
    # its face adapter fuses k and v, which no rename expresses
    lora_format=dataclasses.replace(wan.SPEC.lora_format, full=None),
)
