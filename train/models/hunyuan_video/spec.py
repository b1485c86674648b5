"""HunyuanVideo's training spec: the latents as the pipeline passes them, Llama states with their mask, pooled CLIP
embeddings, the distilled guidance embedding, and the static flow shift of its scheduler."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from train.models.spec import FamilySpec, ShiftSpec, frozen, output_tensors, patched_tokens, sigma_times_1000

# hunyuanvideo-community/HunyuanVideo scheduler/scheduler_config.json (relevant keys).
SCHEDULER_CONFIG = frozen(num_train_timesteps=1000, shift=7.0, use_dynamic_shifting=False)

# The guidance value the distilled guidance embedding is trained at (the transformer gets it times 1000, as
# HunyuanVideoPipeline passes `guidance_scale * 1000`). 1.0 is what public HunyuanVideo LoRA trainers pass
# (finetrainers' HunyuanVideo spec: `guidance=1.0`); the pipeline samples at its __call__ default 6.0. A cache may carry
# its own per-sample `guidance` (the unscaled value).
GUIDANCE_SCALE = 1.0


def unused_params(model_config: Mapping[str, Any]) -> tuple[str, ...]:
    """Regexes (``re.fullmatch`` on parameter names) of the parameters whose gradient is exactly zero: the token
    refiner's key bias. Its attention has no q/k norm, so the bias adds ``q . b`` to every logit of a query alike and
    the softmax cancels it."""
    return (r"context_embedder\.token_refiner\.refiner_blocks\.\d+\.attn\.to_k\.bias",)


def build_inputs(
    batch: Mapping[str, Any],
    noisy_latents: Mapping[str, torch.Tensor],
    timesteps: Mapping[str, torch.Tensor],
    *,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
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


def unpack_output(
    out: Any, latents_shapes: Mapping[str, torch.Size], *, model_config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    return {"latents": output_tensors(out)[0]}


def count_tokens(latents_shapes: Mapping[str, tuple[int, ...]], model_config: Mapping[str, Any]) -> int:
    p, p_t = int(model_config.get("patch_size", 2)), int(model_config.get("patch_size_t", 1))
    return patched_tokens(latents_shapes["latents"], (p_t, p, p))


SPEC = FamilySpec(
    name="hunyuan_video",
    transformer_class="HunyuanVideoTransformer3DModel",
    pipeline_class="HunyuanVideoPipeline",
    vae_class="AutoencoderKLHunyuanVideo",
    latent_kind="video",
    # finetrainers' HunyuanVideo LoRA targets: the attention projections of the dual- and single-stream blocks (and
    # of the token refiner, whose attention uses the same names).
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    shift=ShiftSpec(
        kind="static",
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        scheduler_config=SCHEDULER_CONFIG,
        shift=SCHEDULER_CONFIG["shift"],
    ),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_times_1000,
    count_tokens=count_tokens,
    batch_keys=("latents", "prompt_embeds", "prompt_mask", "pooled_embeds"),
    # forward() turns the text mask into a [video | text] key mask of the global sequence, which Ulysses' rank-major key
    # order [video_0 text_0 | video_1 text_1 | ...] does not match; under CP the text is cut to the longest prompt of
    # the batch and the mask is all ones (exact for a batch of one or prompts of one length).
    text_mask_fed_in_cp=False,
    text_mask_required=True,  # forward() calls encoder_attention_mask.sum(): never None
    text_mask_kwarg="encoder_attention_mask",
)
