"""FLUX.1's training spec: 2x2-packed latents, position ids, pooled CLIP embeddings and the guidance embedding."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, calculate_shift

from train.models.spec import FamilySpec, ShiftSpec, frozen, output_tensors, patched_tokens, sigma_identity

# black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json
SCHEDULER_CONFIG = frozen(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)

# FluxPipeline.__call__ default `guidance_scale`.
GUIDANCE_SCALE = 3.5


def build_inputs(
    batch: Mapping[str, Any],
    noisy_latents: Mapping[str, torch.Tensor],
    timesteps: Mapping[str, torch.Tensor],
    *,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
    latents = noisy_latents["latents"]
    batch_size, channels, height, width = latents.shape
    prompt_embeds = batch["prompt_embeds"]
    device, dtype = latents.device, prompt_embeds.dtype
    guidance = None
    if model_config.get("guidance_embeds", False):
        guidance = batch.get("guidance")
        if guidance is None:
            guidance = torch.full([1], GUIDANCE_SCALE, device=device, dtype=torch.float32)
        guidance = guidance.to(device=device, dtype=torch.float32).reshape(-1).expand(batch_size)
    return {
        "hidden_states": FluxPipeline._pack_latents(latents, batch_size, channels, height, width),
        "timestep": timesteps["latents"],
        "guidance": guidance,
        "pooled_projections": batch["pooled_embeds"],
        "encoder_hidden_states": prompt_embeds,
        "txt_ids": torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype),
        "img_ids": FluxPipeline._prepare_latent_image_ids(batch_size, height // 2, width // 2, device, dtype),
    }


def unpack_output(
    out: Any, latents_shapes: Mapping[str, torch.Size], *, model_config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    _, _, height, width = latents_shapes["latents"]
    # vae_scale_factor=1: height/width are given in latent pixels.
    return {"latents": FluxPipeline._unpack_latents(output_tensors(out)[0].contiguous(), height, width, 1)}


def shift_seq_len(latents_shape: Sequence[int]) -> int:
    _, height, width = latents_shape
    return (height // 2) * (width // 2)


def count_tokens(latents_shapes: Mapping[str, tuple[int, ...]], model_config: Mapping[str, Any]) -> int:
    return patched_tokens(latents_shapes["latents"], 2)  # FluxPipeline packs 2x2 latent pixels per token


SPEC = FamilySpec(
    name="flux",
    transformer_class="FluxTransformer2DModel",
    pipeline_class="FluxPipeline",
    vae_class="AutoencoderKL",
    latent_kind="image",
    # train_dreambooth_lora_flux.py default `--lora_layers`.
    lora_targets=("to_k", "to_q", "to_v", "to_out.0"),
    shift=ShiftSpec.linear_mu(SCHEDULER_CONFIG, calculate_shift),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_identity,
    count_tokens=count_tokens,
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "prompt_embeds", "pooled_embeds"),
    # No text mask: FluxPipeline lets the T5 padding tokens be attended.
)
