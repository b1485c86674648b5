"""Wan's training spec: forward kwargs from a cached batch, predictions back in the cache layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from train.models.spec import FamilySpec, ShiftSpec, frozen, output_tensors, patched_tokens, sigma_times_1000

# Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers scheduler/scheduler_config.json (relevant keys): UniPC with flow sigmas and a
# fixed `flow_shift` (3.0, the 480p default; WanPipeline's docs recommend 5.0 for 720p).
SCHEDULER_CONFIG = frozen(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
)


def build_inputs(
    batch: Mapping[str, Any],
    noisy_latents: Mapping[str, torch.Tensor],
    timesteps: Mapping[str, torch.Tensor],
    *,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
    return {
        "hidden_states": noisy_latents["latents"],
        "timestep": timesteps["latents"],
        "encoder_hidden_states": batch["prompt_embeds"],
    }


def unpack_output(
    out: Any, latents_shapes: Mapping[str, torch.Size], *, model_config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    return {"latents": output_tensors(out)[0]}


def count_tokens(latents_shapes: Mapping[str, tuple[int, ...]], model_config: Mapping[str, Any]) -> int:
    return patched_tokens(latents_shapes["latents"], model_config["patch_size"])  # (1, 2, 2) patches of (F, H, W)


SPEC = FamilySpec(
    name="wan",
    transformer_class="WanTransformer3DModel",
    pipeline_class="WanPipeline",
    vae_class="AutoencoderKLWan",
    latent_kind="video",
    # Self- and cross-attention projections (`attn1` / `attn2`), as the diffusers/finetrainers Wan LoRA recipes.
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    shift=ShiftSpec(
        kind="static",
        scheduler_class="UniPCMultistepScheduler",
        scheduler_config=SCHEDULER_CONFIG,
        shift=SCHEDULER_CONFIG["flow_shift"],
    ),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_times_1000,
    count_tokens=count_tokens,
    batch_keys=("latents", "prompt_embeds"),
)
