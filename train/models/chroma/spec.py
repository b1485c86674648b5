"""Chroma's training spec: FLUX.1's packing, ids and shift; no pooled text or guidance; the pipeline's joint
attention mask from the tokenizer's."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from train.models import Batch, Config, Streams
from train.models.flux import spec as flux
from train.models.spec import ShiftSpec


def attention_mask(prompt_mask: torch.Tensor, image_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """ChromaPipeline's transformer ``attention_mask`` (B, L + S): ``_get_t5_prompt_embeds``' text mask (1 up to and
    including the first padding token: ``arange(L) <= tokens``) in the text's ``dtype``, then
    ``_prepare_attention_mask``'s S boolean ones (``torch.cat`` promotes them to ``dtype``)."""
    batch, length = prompt_mask.shape
    tokens = prompt_mask.sum(dim=1)
    text = (torch.arange(length, device=prompt_mask.device)[None] <= tokens[:, None]).to(dtype)
    return torch.cat([text, torch.ones(batch, image_tokens, device=text.device, dtype=torch.bool)], dim=1)


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    from diffusers.pipelines.chroma.pipeline_chroma import ChromaPipeline

    latents = noisy_latents["latents"]
    batch_size, channels, height, width = latents.shape
    prompt_embeds = batch["prompt_embeds"]
    device, dtype = latents.device, prompt_embeds.dtype
    packed = ChromaPipeline._pack_latents(latents, batch_size, channels, height, width)
    return {
        "hidden_states": packed,
        "timestep": timesteps["latents"],
        "encoder_hidden_states": prompt_embeds,
        "txt_ids": torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype),
        "img_ids": ChromaPipeline._prepare_latent_image_ids(batch_size, height // 2, width // 2, device, dtype),
        "attention_mask": attention_mask(batch["prompt_mask"].to(device), packed.shape[1], dtype),
    }


SPEC = dataclasses.replace(
    flux.SPEC,
    name="chroma",
    classes=flux.SPEC.classes._replace(transformer="ChromaTransformer2DModel", pipeline="ChromaPipeline"),
    # Chroma1-HD's scheduler/scheduler_config.json was not in the sources searched: FLUX.1-dev's (its conversion's
    # source; ChromaPipeline computes mu with calculate_shift from the same keys) is assumed. Set model.flow_shift
    # for a checkpoint whose scheduler differs.
    shift=ShiftSpec.linear_mu("diffusers.pipelines.chroma.pipeline_chroma", shift=3.0),
    build_inputs=build_inputs,
    batch_keys=("latents", "prompt_embeds", "prompt_mask"),
    # FLUX.1's LoRA names; no full weights in the original layout here (its distilled guidance layer is named apart)
    lora_format=dataclasses.replace(flux.SPEC.lora_format, full=None),
)
