"""Wan 2.1 text-to-video (WanTransformer3DModel / WanPipeline).

Cache: ``latents`` (C, F, H, W) as WanPipeline normalises them (``(z - latents_mean) / latents_std`` of
AutoencoderKLWan); ``prompt_embeds`` (512, 4096) UMT5 states as ``encode_prompt`` returns them: cut to the prompt
length and zero-padded to ``max_sequence_length`` (the pipeline passes no text mask).

Forward kwargs, as WanPipeline's denoising loop: ``hidden_states`` = the latents unchanged (the transformer patchifies
them itself), ``encoder_hidden_states``, ``timestep = sigma * 1000``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .spec import FamilySpec, ShiftSpec, frozen, output_tensors, sigma_times_1000

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


def shift_seq_len(latents_shape: tuple[int, ...]) -> int:
    _, frames, height, width = latents_shape
    return frames * height * width  # unused: the shift is static


SPEC = FamilySpec(
    name="wan",
    transformer_class="WanTransformer3DModel",
    pipeline_class="WanPipeline",
    vae_class="AutoencoderKLWan",
    text_encoders=("text_encoder",),
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
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "prompt_embeds"),
    constants=frozen(vae_scale_factor_temporal=4, vae_scale_factor_spatial=8),
    notes=(
        "Wan 2.2 A14B (two experts switched at boundary_ratio) and TI2V-5B (expand_timesteps: per-token timesteps) "
        "are not covered; set a different flow_shift (e.g. 5.0 for 720p) by replacing the spec's shift."
    ),
)
