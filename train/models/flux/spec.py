"""FLUX.1's training spec: 2x2-packed latents, position ids, pooled CLIP embeddings and the guidance embedding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from train.models import Batch, Config, Shapes, Streams
from train.models.flux.lora_format import FORMAT
from train.models.spec import Classes, FamilySpec, Patch, ShiftSpec, batch_guidance, output_tensors, sigma_identity

# FluxPipeline.__call__ default `guidance_scale`.
GUIDANCE_SCALE = 3.5


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    latents = noisy_latents["latents"]
    batch_size, channels, height, width = latents.shape
    prompt_embeds = batch["prompt_embeds"]
    device, dtype = latents.device, prompt_embeds.dtype
    return {
        "hidden_states": FluxPipeline._pack_latents(latents, batch_size, channels, height, width),
        "timestep": timesteps["latents"],
        "guidance": batch_guidance(batch, latents, GUIDANCE_SCALE)
        if model_config.get("guidance_embeds", False)
        else None,
        "pooled_projections": batch["pooled_embeds"],
        "encoder_hidden_states": prompt_embeds,
        "txt_ids": torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype),
        "img_ids": FluxPipeline._prepare_latent_image_ids(batch_size, height // 2, width // 2, device, dtype),
    }


def unpack_output(out: Any, latents_shapes: Shapes, *, model_config: Config) -> dict[str, torch.Tensor]:
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    _, _, height, width = latents_shapes["latents"]
    # vae_scale_factor=1: height/width are given in latent pixels.
    return {"latents": FluxPipeline._unpack_latents(output_tensors(out)[0].contiguous(), height, width, 1)}


def shift_seq_len(latents_shape: Sequence[int]) -> int:
    _, height, width = latents_shape
    return (height // 2) * (width // 2)


SPEC = FamilySpec(
    name="flux",
    classes=Classes("FluxTransformer2DModel", "FluxPipeline", "AutoencoderKL"),
    latent_kind="image",
    # train_dreambooth_lora_flux.py default `--lora_layers`.
    lora_targets=("to_k", "to_q", "to_v", "to_out.0"),
    # black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json: the FlowMatchEulerDiscreteScheduler defaults but
    # shift 3.0, dynamic shifting
    shift=ShiftSpec.linear_mu("diffusers.pipelines.flux.pipeline_flux", shift=3.0),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_identity,
    patch=Patch((2, 2)),  # FluxPipeline packs 2x2 latent pixels per token
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "prompt_embeds", "pooled_embeds"),
    # No text mask: FluxPipeline lets the T5 padding tokens be attended.
    lora_format=FORMAT,
)
