"""HunyuanVideo 1.5's text-to-video training spec: the latents with the pipeline's zero conditioning channels, the
Qwen2.5-VL and ByT5 (glyph) text states with their masks, the zero vision states of text-to-video, and the static flow
shift of its scheduler."""

from __future__ import annotations

from typing import Any

import torch

from train.models import Batch, Config, Streams
from train.models.spec import Classes, FamilySpec, Patch, ShiftSpec, frozen

# The 480p text-to-video checkpoint's scheduler: FlowMatchEulerDiscreteScheduler with a static shift (the official
# HunyuanVideo-1.5 sampling shift for 480p; 720p samples at a larger one). A recipe may override train.shift.
SCHEDULER_CONFIG = frozen(num_train_timesteps=1000, shift=5.0, use_dynamic_shifting=False)

# HunyuanVideo15Pipeline.__call__: image_embeds = zeros(B, vision_num_semantic_tokens, image_embed_dim) for
# text-to-video (SigLIP's 729 semantic tokens); the transformer masks them all (is_t2v).
VISION_TOKENS = 729


def unused_params(model_config: Config) -> tuple[str, ...]:
    """Regexes (``re.fullmatch`` on parameter names) of the parameters whose gradient is exactly zero or never formed
    in text-to-video: the image embedder (forward multiplies its output by 0 when image_embeds are all zero, and masks
    those tokens), the token refiner's key bias (its attention has no q/k norm, so the bias adds ``q . b`` to every
    logit of a query alike and the softmax cancels it), and the last block's text queries and text-stream output
    layers (the model output reads only the video stream)."""
    last = int(model_config["num_layers"]) - 1
    return (
        r"image_embedder\..*",
        r"context_embedder\.token_refiner\.refiner_blocks\.\d+\.attn\.to_k\.bias",
        rf"transformer_blocks\.{last}\.(attn\.(add_q_proj|norm_added_q|to_add_out)|ff_context)\..*",
    )


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    latents = noisy_latents["latents"]  # (B, C, F, H, W)
    b, _, f, h, w = latents.shape
    dtype, device = latents.dtype, latents.device
    # prepare_cond_latents_and_mask for text-to-video: zero conditioning latents (C) and a zero mask channel (1)
    cond_channels = int(model_config["in_channels"]) - 2 * latents.shape[1] - 1
    if cond_channels != 0:
        raise ValueError(f"in_channels {model_config['in_channels']} is not 2 x {latents.shape[1]} latent channels + 1")
    zeros = torch.zeros(b, latents.shape[1] + 1, f, h, w, dtype=dtype, device=device)
    return {
        "hidden_states": torch.cat([latents, zeros], dim=1),
        "image_embeds": torch.zeros(b, VISION_TOKENS, int(model_config["image_embed_dim"]), dtype=dtype, device=device),
        "timestep": timesteps["latents"].to(dtype),
        # encode_prompt casts the masks to the transformer dtype
        "encoder_hidden_states": batch["prompt_embeds"],
        "encoder_attention_mask": batch["prompt_mask"].to(dtype),
        "encoder_hidden_states_2": batch["byt5_embeds"],
        "encoder_attention_mask_2": batch["byt5_mask"].to(dtype),
    }


SPEC = FamilySpec(
    name="hunyuan_video15",
    classes=Classes("HunyuanVideo15Transformer3DModel", "HunyuanVideo15Pipeline", "AutoencoderKLHunyuanVideo15"),
    latent_kind="video",
    # LoRA: the attention projections (the default) of the video stream of the dual-stream blocks and of the token
    # refiner (HunyuanVideo's)
    shift=ShiftSpec.static(SCHEDULER_CONFIG),
    build_inputs=build_inputs,
    patch=Patch.time_space(patch_size_t=1, patch_size=1),  # HunyuanVideo15Transformer3DModel's defaults
    batch_keys=("latents", "prompt_embeds", "prompt_mask", "byt5_embeds", "byt5_mask"),
    # the padded masks are fed under CP too: cp_plans/hunyuan_video15.yaml swaps in a key-mask processor
    # (train/models/hunyuan_video15/attention.py) whose (B, 1, 1, S) mask Ulysses splits along the keys
)
