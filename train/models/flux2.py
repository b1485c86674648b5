"""FLUX.2 (Flux2Transformer2DModel / Flux2Pipeline).

Cache: ``latents`` (C, H, W) as Flux2Pipeline normalises them: the VAE latents 2x2-patchified
(``Flux2Pipeline._patchify_latents``, 128 channels) and then batch-norm normalised with the VAE's running stats;
``prompt_embeds`` (L, D) Mistral hidden states (stacked layers). Flux2Pipeline passes no text mask. Optional
``guidance`` overrides the default guidance scale.

Forward kwargs, as Flux2Pipeline's denoising loop (text-to-image, no reference images): ``hidden_states``
(``Flux2Pipeline._pack_latents``), ``img_ids`` (``_prepare_latent_ids``), ``txt_ids`` (``_prepare_text_ids``),
``guidance`` (``guidance_embeds`` checkpoints; Klein checkpoints have none), ``timestep = sigma``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline, compute_empirical_mu

from .spec import FamilySpec, ShiftSpec, frozen, output_tensors, sigma_identity

# black-forest-labs/FLUX.2-dev scheduler/scheduler_config.json (relevant keys). Flux2Pipeline ignores the base/max
# shift keys and computes mu with `compute_empirical_mu(image_seq_len, num_inference_steps)`.
SCHEDULER_CONFIG = frozen(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    time_shift_type="exponential",
)

# Flux2Pipeline.__call__ defaults.
GUIDANCE_SCALE = 4.0
NUM_INFERENCE_STEPS = 50


def build_inputs(
    batch: Mapping[str, Any],
    noisy_latents: Mapping[str, torch.Tensor],
    timesteps: Mapping[str, torch.Tensor],
    *,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
    latents = noisy_latents["latents"]
    batch_size = latents.shape[0]
    prompt_embeds = batch["prompt_embeds"]
    device = latents.device
    guidance = None
    if model_config.get("guidance_embeds", True):
        guidance = batch.get("guidance")
        if guidance is None:
            guidance = torch.full([1], GUIDANCE_SCALE, device=device, dtype=torch.float32)
        guidance = guidance.to(device=device, dtype=torch.float32).reshape(-1).expand(batch_size)
    return {
        "hidden_states": Flux2Pipeline._pack_latents(latents),
        "timestep": timesteps["latents"],
        "guidance": guidance,
        "encoder_hidden_states": prompt_embeds,
        "txt_ids": Flux2Pipeline._prepare_text_ids(prompt_embeds).to(device),
        "img_ids": Flux2Pipeline._prepare_latent_ids(latents).to(device),
    }


def unpack_output(
    out: Any, latents_shapes: Mapping[str, torch.Size], *, model_config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
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
    transformer_class="Flux2Transformer2DModel",
    pipeline_class="Flux2Pipeline",
    vae_class="AutoencoderKLFlux2",
    text_encoders=("text_encoder",),
    latent_kind="image",
    # train_dreambooth_lora_flux2.py default `--lora_layers` (double-stream attention; single-stream blocks use a fused
    # `to_qkv_mlp_proj`).
    lora_targets=("to_k", "to_q", "to_v", "to_out.0"),
    shift=ShiftSpec(
        kind="dynamic",
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        scheduler_config=SCHEDULER_CONFIG,
        shift=SCHEDULER_CONFIG["shift"],
        # Flux2Pipeline: mu = compute_empirical_mu(image_seq_len, num_inference_steps); the pipeline default step count.
        mu_fn=functools.partial(compute_empirical_mu, num_steps=NUM_INFERENCE_STEPS),
    ),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_identity,
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "prompt_embeds"),
    constants=frozen(guidance_scale=GUIDANCE_SCALE, num_inference_steps=NUM_INFERENCE_STEPS),
    notes=(
        "Reference-image (image-to-image / multi-reference) conditioning is not covered. The dynamic shift's mu "
        "depends on the inference step count in Flux2Pipeline; training uses the pipeline default (50)."
    ),
)
