"""Kandinsky 5 T2V's training spec: channels-last latents with the pipeline's empty visual condition, unpadded
Qwen2.5-VL text with its RoPE positions, the pooled CLIP embedding, the pipeline's RoPE scale for the clip's size,
dense attention, and the float32-RoPE attention processor the family trains with."""

from __future__ import annotations

from typing import Any

import torch

from train.models import Batch, Config, Shapes, Streams
from train.models.spec import Classes, FamilySpec, ShiftSpec, frozen

from .attention import float32_rope

# The flow shift of the Lite 5 s checkpoints: FastVideo's Kandinsky5T2VConfig(flow_shift=5.0) and the released training
# config (ai-forever/Kandinsky-5 "..._scheduler5.0_batch4.yaml"). kandinskylab's Diffusers scheduler_config.json was not
# in the sources searched (musubi-tuner samples the Lite T2V checkpoints at scheduler_scale 10.0): set model.flow_shift
# for a checkpoint whose scheduler differs.
SCHEDULER_CONFIG = frozen(num_train_timesteps=1000, shift=5.0, use_dynamic_shifting=False)

# AutoencoderKLHunyuanVideo's spatial_compression_ratio (the released VAE's, and the tiny pipeline's): the pipeline's
# height and width in pixels are the latent grid times this.
VAE_SPATIAL = 8

# The attention projections of Kandinsky5Attention (self-attention of the text and visual blocks, cross-attention of the
# visual blocks); "out_layer" alone would also match the feed-forwards, modulations and the output layer.
LORA_TARGETS = ("to_query", "to_key", "to_value", "self_attention.out_layer", "cross_attention.out_layer")


def attention_shape(config: Config) -> tuple[int, int]:
    """(heads, head dim): Kandinsky5Attention's head dim is the RoPE axes' sum, its heads model_dim / head dim."""
    head_dim = sum(int(a) for a in config["axes_dims"])
    return int(config["model_dim"]) // head_dim, head_dim


def scale_factor(height: int, width: int) -> tuple[float, float, float]:
    """Kandinsky5T2VPipeline._get_scale_factor of the clip's size in pixels (the latent grid times VAE_SPATIAL): the
    RoPE's (t, h, w) divisors, (1, 2, 2) with both sides in [480, 854], else (1, 3.16, 3.16)."""
    from diffusers.pipelines.kandinsky5.pipeline_kandinsky import Kandinsky5T2VPipeline

    return Kandinsky5T2VPipeline._get_scale_factor(None, height * VAE_SPATIAL, width * VAE_SPATIAL)


def text(batch: Batch) -> torch.Tensor:
    """The Qwen2.5-VL states (B, L, D) unpadded, as the pipeline passes them for one prompt: the transformer takes no
    text mask, so every sample of a batch has the same length (``shared_text_length``); a cache padded to a common
    length (``prompt_mask``) has its padding dropped."""
    embeds, mask = batch["prompt_embeds"], batch.get("prompt_mask")
    if mask is None:
        return embeds
    mask = mask.bool().reshape(-1, embeds.shape[1])
    if not bool((mask == mask[:1]).all()):
        raise ValueError("Kandinsky 5 takes no text mask: every prompt_mask of a batch must be the same")
    return embeds if bool(mask[0].all()) else embeds[:, mask[0].to(embeds.device)]


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    latents = noisy_latents["latents"]  # (B, C, F, H, W), the cached layout
    batch_size, _, frames, height, width = latents.shape
    device = latents.device
    hidden = latents.permute(0, 2, 3, 4, 1)  # the pipeline's channels-last (B, F, H, W, C)
    if model_config["visual_cond"]:  # prepare_latents: text-to-video appends a zero condition and a zero mask
        hidden = torch.cat([hidden, torch.zeros_like(hidden), hidden.new_zeros(batch_size, frames, height, width, 1)],
                           dim=-1)  # fmt: skip
    prompt = text(batch)
    return {
        "hidden_states": hidden,
        "encoder_hidden_states": prompt,
        "pooled_projections": batch["pooled_embeds"],
        "timestep": timesteps["latents"].to(latents.dtype),  # the pipeline's `timestep.to(dtype)`
        # the pipeline's positions: latent frames, and latent rows and columns // 2 (its 2x2 patch, hard-coded)
        "visual_rope_pos": [torch.arange(n, device=device) for n in (frames, height // 2, width // 2)],
        "text_rope_pos": torch.arange(prompt.shape[1], device=device),
        "scale_factor": scale_factor(height, width),
        "sparse_params": None,  # dense attention (see the package docstring)
    }


def unpack_output(out: Any, latents_shapes: Shapes, *, model_config: Config) -> dict[str, torch.Tensor]:
    """The channels-last prediction (B, F, H, W, C) in the cached (B, C, F, H, W) layout."""
    from train.models.spec import output_tensors

    return {"latents": output_tensors(out)[0].permute(0, 4, 1, 2, 3)}


SPEC = FamilySpec(
    name="kandinsky5",
    classes=Classes("Kandinsky5Transformer3DModel", "Kandinsky5T2VPipeline", "AutoencoderKLHunyuanVideo"),
    latent_kind="video",
    shift=ShiftSpec.static(SCHEDULER_CONFIG),
    build_inputs=build_inputs,
    batch_keys=("latents", "prompt_embeds", "pooled_embeds"),
    lora_targets=LORA_TARGETS,
    unpack_output=unpack_output,
    shared_text_length=True,
    attention_shape=attention_shape,
    prepare_transformer=float32_rope,
)
