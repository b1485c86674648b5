"""Qwen-Image (QwenImageTransformer2DModel / QwenImagePipeline).

Cache: ``latents`` (C, 1, H, W) as QwenImagePipeline normalises them (``(z - latents_mean) / latents_std`` of
AutoencoderKLQwenImage, whose latents carry a frame axis of 1); ``prompt_embeds`` (L, 3584) with ``prompt_mask`` (L,)
bool, as ``encode_prompt`` returns them (template prefix dropped, right-padded).

Forward kwargs, as QwenImagePipeline's denoising loop: ``hidden_states`` packed 2x2 (``QwenImagePipeline._pack_latents``
on the (B, 1, C, H, W) layout the pipeline uses), ``img_shapes = [[(1, H/2, W/2)]] * B``,
``encoder_hidden_states_mask`` (``None`` when nothing is padded, as ``encode_prompt`` does), ``guidance``
(``guidance_embeds`` checkpoints only), ``timestep = sigma``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline, calculate_shift

from .spec import FamilySpec, ShiftSpec, frozen, output_tensors, sigma_identity

# Qwen/Qwen-Image scheduler/scheduler_config.json (relevant keys).
SCHEDULER_CONFIG = frozen(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)


def build_inputs(
    batch: Mapping[str, Any],
    noisy_latents: Mapping[str, torch.Tensor],
    timesteps: Mapping[str, torch.Tensor],
    *,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
    latents = noisy_latents["latents"]  # (B, C, 1, H, W)
    batch_size, channels, _, height, width = latents.shape
    mask = batch.get("prompt_mask")
    if mask is not None and bool(mask.all()):
        mask = None  # as QwenImagePipeline.encode_prompt
    guidance = None
    if model_config.get("guidance_embeds", False):
        guidance = batch["guidance"].to(device=latents.device, dtype=torch.float32).reshape(-1).expand(batch_size)
    return {
        "hidden_states": QwenImagePipeline._pack_latents(
            latents.permute(0, 2, 1, 3, 4), batch_size, channels, height, width
        ),
        "timestep": timesteps["latents"],
        "guidance": guidance,
        "encoder_hidden_states": batch["prompt_embeds"],
        "encoder_hidden_states_mask": mask,
        "img_shapes": [[(1, height // 2, width // 2)]] * batch_size,
    }


def unpack_output(
    out: Any, latents_shapes: Mapping[str, torch.Size], *, model_config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    *_, height, width = latents_shapes["latents"]
    # vae_scale_factor=1: height/width are given in latent pixels. Returns (B, C, 1, H, W).
    return {"latents": QwenImagePipeline._unpack_latents(output_tensors(out)[0].contiguous(), height, width, 1)}


def shift_seq_len(latents_shape: Sequence[int]) -> int:
    *_, height, width = latents_shape
    return (height // 2) * (width // 2)


SPEC = FamilySpec(
    name="qwenimage",
    transformer_class="QwenImageTransformer2DModel",
    pipeline_class="QwenImagePipeline",
    vae_class="AutoencoderKLQwenImage",
    text_encoders=("text_encoder",),
    latent_kind="image",
    # train_dreambooth_lora_qwen_image.py default `--lora_layers`.
    lora_targets=("to_k", "to_q", "to_v", "to_out.0"),
    shift=ShiftSpec.linear_mu(SCHEDULER_CONFIG, calculate_shift),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_identity,
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "prompt_embeds", "prompt_mask"),
    text_mask_fed_in_cp=True,  # a (B, 1, 1, S) joint mask, broadcast over heads: Ulysses can shard it
    text_mask_kwarg="encoder_hidden_states_mask",
    constants=frozen(vae_scale_factor=8),
    notes="Qwen-Image-Edit (reference-image latents, zero_cond_t) is not covered.",
)
