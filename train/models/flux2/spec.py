"""FLUX.2's training spec: packed (already 2x2-patchified) latents, 4-axis position ids and the guidance embedding."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from train.models import Batch, Config, Shapes, Streams
from train.models.flux2.lora_format import FORMAT
from train.models.spec import (
    Classes,
    FamilySpec,
    Patch,
    PipelineFunction,
    ShiftSpec,
    batch_guidance,
    output_tensors,
    sigma_identity,
)

# Flux2Pipeline.__call__ defaults.
GUIDANCE_SCALE = 4.0
NUM_INFERENCE_STEPS = 50
# mu of (image_seq_len, num_steps): the pipeline module's own
compute_empirical_mu = PipelineFunction("diffusers.pipelines.flux2.pipeline_flux2", "compute_empirical_mu")


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    latents = noisy_latents["latents"]
    prompt_embeds = batch["prompt_embeds"]
    device = latents.device
    return {
        "hidden_states": Flux2Pipeline._pack_latents(latents),
        "timestep": timesteps["latents"],
        "guidance": batch_guidance(batch, latents, GUIDANCE_SCALE)
        if model_config.get("guidance_embeds", True)
        else None,
        "encoder_hidden_states": prompt_embeds,
        "txt_ids": Flux2Pipeline._prepare_text_ids(prompt_embeds).to(device),
        "img_ids": Flux2Pipeline._prepare_latent_ids(latents).to(device),
    }


def unpack_output(out: Any, latents_shapes: Shapes, *, model_config: Config) -> dict[str, torch.Tensor]:
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    shape = latents_shapes["latents"]
    pred = output_tensors(out)[0]
    pred = pred[:, : shape[2] * shape[3]]  # as the pipeline: drop reference-image tokens, if any
    latent_ids = Flux2Pipeline._prepare_latent_ids(torch.empty(shape, device="meta")).to(pred.device)
    return {"latents": Flux2Pipeline._unpack_latents_with_ids(pred, latent_ids)}


def shift_seq_len(latents_shape: Sequence[int]) -> int:
    _, height, width = latents_shape  # already 2x2-patchified
    return height * width


SPEC = FamilySpec(
    name="flux2",
    classes=Classes("Flux2Transformer2DModel", "Flux2Pipeline", "AutoencoderKLFlux2"),
    latent_kind="image",
    # train_dreambooth_lora_flux2.py default `--lora_layers` (double-stream attention; single-stream blocks use a fused
    # `to_qkv_mlp_proj`).
    lora_targets=("to_k", "to_q", "to_v", "to_out.0"),
    # black-forest-labs/FLUX.2-dev scheduler/scheduler_config.json (relevant keys): the FlowMatchEulerDiscreteScheduler
    # defaults but shift 3.0, dynamic shifting. Flux2Pipeline ignores the base/max shift keys: mu =
    # compute_empirical_mu(image_seq_len, num_inference_steps), at the pipeline's default step count.
    shift=ShiftSpec.dynamic(
        functools.partial(compute_empirical_mu, num_steps=NUM_INFERENCE_STEPS), shift=3.0, time_shift_type="exponential"
    ),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_identity,
    patch=Patch((1, 1)),  # the cache is already 2x2-patchified: one token per position
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "prompt_embeds"),
    lora_format=FORMAT,
)
