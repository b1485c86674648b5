"""HunyuanVideo's training spec: the latents as the pipeline passes them, Llama states with their mask, pooled CLIP
embeddings, the distilled guidance embedding, and the static flow shift of its scheduler."""

from __future__ import annotations

from typing import Any

import torch

from train.models import Batch, Config, Streams
from train.models.spec import Classes, FamilySpec, Patch, ShiftSpec, frozen

# hunyuanvideo-community/HunyuanVideo scheduler/scheduler_config.json (relevant keys).
SCHEDULER_CONFIG = frozen(num_train_timesteps=1000, shift=7.0, use_dynamic_shifting=False)

# The guidance value the distilled guidance embedding is trained at (the transformer gets it times 1000, as
# HunyuanVideoPipeline passes `guidance_scale * 1000`). 1.0 is what public HunyuanVideo LoRA trainers pass
# (finetrainers' HunyuanVideo spec: `guidance=1.0`); the pipeline samples at its __call__ default 6.0. A cache may carry
# its own per-sample `guidance` (the unscaled value).
GUIDANCE_SCALE = 1.0


def unused_params(model_config: Config) -> tuple[str, ...]:
    """Regexes (``re.fullmatch`` on parameter names) of the parameters whose gradient is exactly zero: the token
    refiner's key bias. Its attention has no q/k norm, so the bias adds ``q . b`` to every logit of a query alike and
    the softmax cancels it."""
    return (r"context_embedder\.token_refiner\.refiner_blocks\.\d+\.attn\.to_k\.bias",)


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    latents = noisy_latents["latents"]  # (B, C, F, H, W): the pipeline's layout, patchified inside the transformer
    batch_size, dtype = latents.shape[0], latents.dtype
    guidance = batch.get("guidance")
    if guidance is None:
        guidance = torch.full([1], GUIDANCE_SCALE, device=latents.device)
    return {
        "hidden_states": latents,
        "timestep": timesteps["latents"],
        "encoder_hidden_states": batch["prompt_embeds"],
        # the pipeline casts the tokenizer's 0/1 mask to the transformer dtype
        "encoder_attention_mask": batch["prompt_mask"].to(dtype),
        "pooled_projections": batch["pooled_embeds"],
        "guidance": guidance.to(device=latents.device, dtype=dtype).reshape(-1).expand(batch_size) * 1000.0,
    }


SPEC = FamilySpec(
    name="hunyuan_video",
    classes=Classes("HunyuanVideoTransformer3DModel", "HunyuanVideoPipeline", "AutoencoderKLHunyuanVideo"),
    latent_kind="video",
    # LoRA: finetrainers' HunyuanVideo targets, the attention projections (the default) of the dual- and single-stream
    # blocks and of the token refiner, whose attention uses the same names.
    shift=ShiftSpec.static(SCHEDULER_CONFIG),
    build_inputs=build_inputs,
    patch=Patch.time_space(patch_size_t=1, patch_size=2),  # HunyuanVideoTransformer3DModel's defaults
    batch_keys=("latents", "prompt_embeds", "prompt_mask", "pooled_embeds"),
)
