"""FLUX.2's training spec: packed (already 2x2-patchified) latents, 4-axis position ids and the guidance embedding."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline, compute_empirical_mu

from train.models.spec import FamilySpec, ShiftSpec, frozen, output_tensors, patched_tokens, sigma_identity

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


def count_tokens(latents_shapes: Mapping[str, tuple[int, ...]], model_config: Mapping[str, Any]) -> int:
    return patched_tokens(latents_shapes["latents"], 1)  # the cache is already 2x2-patchified: one token per position


SPEC = FamilySpec(
    name="flux2",
    transformer_class="Flux2Transformer2DModel",
    pipeline_class="Flux2Pipeline",
    vae_class="AutoencoderKLFlux2",
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
    count_tokens=count_tokens,
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "prompt_embeds"),
)
