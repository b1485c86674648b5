"""Krea 2's training spec: 2x2-packed latents after the fixed-length text block in one joint sequence, the (t, h, w)
position ids of that sequence, the text key-padding mask, ``timestep = sigma``."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from train.models import Batch, Config, Shapes, Streams
from train.models.spec import Classes, FamilySpec, Patch, ShiftSpec, output_tensors, sigma_identity

# Krea2Pipeline's default patch_size (a pipeline argument: the transformer's config has no patch size): latents are
# packed into 2x2 patches, in_channels = 4 x the VAE's latent channels.
PATCH = 2
# The pipeline state its static-like helpers read (_pack_latents / _unpack_latents take `self`), sizes in latent pixels.
_PIPE = SimpleNamespace(patch_size=PATCH, vae_scale_factor=1)


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    from diffusers.pipelines.krea2.pipeline_krea2 import Krea2Pipeline

    latents = noisy_latents["latents"]  # (B, C, 1, H, W), the VAE's frame axis of 1
    batch_size, channels, _, height, width = latents.shape
    embeds = batch["prompt_embeds"]  # (B, L, num_text_layers, D): encode_prompt's stack of tapped layers
    mask = batch.get("prompt_mask")  # (the estimator's calibration instance has none: every token valid)
    if mask is not None:
        mask = mask.to(latents.device).bool()  # encode_prompt's bool mask, passed even when nothing is padded
    # Krea2Pipeline._pack_latents on the (B, C, H, W) latents it draws (its patch size is all it reads of the pipeline)
    packed = Krea2Pipeline._pack_latents(_PIPE, latents[:, :, 0], batch_size, channels, height, width)
    position_ids = Krea2Pipeline.prepare_position_ids(embeds.shape[1], height // PATCH, width // PATCH, latents.device)
    return {
        "hidden_states": packed,
        "encoder_hidden_states": embeds,
        "timestep": timesteps["latents"].to(latents.dtype),  # the pipeline's t / 1000 in the latents' dtype
        "position_ids": position_ids,
        "encoder_attention_mask": mask,
    }


def unpack_output(out: Any, latents_shapes: Shapes, *, model_config: Config) -> dict[str, torch.Tensor]:
    from diffusers.pipelines.krea2.pipeline_krea2 import Krea2Pipeline

    *_, height, width = latents_shapes["latents"]
    # Krea2Pipeline._unpack_latents with vae_scale_factor 1 (sizes in latent pixels): (B, H/2 * W/2, C*4) ->
    # (B, C, 1, H, W)
    return {"latents": Krea2Pipeline._unpack_latents(_PIPE, output_tensors(out)[0].contiguous(), height, width)}


def shift_seq_len(latents_shape: Sequence[int]) -> int:
    *_, height, width = latents_shape
    return (height // PATCH) * (width // PATCH)  # the pipeline's latents.shape[1]: packed image tokens


SPEC = FamilySpec(
    name="krea2",
    classes=Classes("Krea2Transformer2DModel", "Krea2Pipeline", "AutoencoderKLQwenImage"),
    latent_kind="image",
    # Krea2Pipeline's documented scheduler config: dynamic shifting with base_shift 0.5, max_shift 1.15,
    # base_image_seq_len 256, max_image_seq_len 6400 (the pipeline's own fallbacks for these keys); mu from its
    # calculate_shift of the packed image tokens. The distilled Turbo checkpoint (is_distilled) uses mu = 1.15: an
    # inference schedule; LoRAs are trained on the Raw base.
    shift=ShiftSpec.linear_mu("diffusers.pipelines.krea2.pipeline_krea2", max_image_seq_len=6400),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_identity,
    patch=Patch((1, PATCH, PATCH)),  # the (1, H, W) grid, packed 2x2
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "prompt_embeds", "prompt_mask"),
)
