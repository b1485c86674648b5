"""HunyuanImage 2.1's training spec: the latents as the pipeline passes them (patchified 1x1 inside), the Qwen2.5-VL and
ByT5 (glyph) text states with their integer masks, no guidance embedding, and the static flow shift of its sampler."""

from __future__ import annotations

from typing import Any

from train.models import Batch, Config, Streams
from train.models.spec import Classes, FamilySpec, Patch, ShiftSpec, frozen

# hunyuanvideo-community/HunyuanImage-2.1-Diffusers scheduler/scheduler_config.json was not in the sources searched:
# a FlowMatchEulerDiscreteScheduler with the static shift 5 of the official sampler (Tencent-Hunyuan/HunyuanImage-2.1
# HunyuanImagePipelineConfig: shift 5 for the base model, 4 for the distilled one) is assumed. Set model.flow_shift for
# a checkpoint whose scheduler differs.
SCHEDULER_CONFIG = frozen(num_train_timesteps=1000, shift=5.0, use_dynamic_shifting=False)


def unused_params(model_config: Config) -> tuple[str, ...]:
    """Regexes (``re.fullmatch`` on parameter names) of the parameters whose gradient is exactly zero: the token
    refiner's key bias. Its attention has no q/k norm and no RoPE, so the bias adds ``q . b`` to every logit of a query
    alike and the softmax cancels it (HunyuanVideo's refiner, the same block)."""
    return (r"context_embedder\.token_refiner\.refiner_blocks\.\d+\.attn\.to_k\.bias",)


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    if model_config["use_meanflow"] or model_config["guidance_embeds"]:
        raise ValueError(
            "hunyuanimage trains the base HunyuanImage-2.1 transformer (no guidance embedding, no meanflow); this "
            "config is the distilled or the refiner checkpoint's (guidance_embeds / use_meanflow), which the family "
            "does not cover: point model.pretrained_path at hunyuanvideo-community/HunyuanImage-2.1-Diffusers"
        )
    latents = noisy_latents["latents"]  # (B, C, H, W): the pipeline's layout, patchified inside the transformer
    return {
        "hidden_states": latents,
        # the pipeline: t.expand(B).to(latents.dtype), t = sigma * 1000 from the scheduler
        "timestep": timesteps["latents"].to(latents.dtype),
        # encode_prompt's masks are the tokenizers' int64 attention masks (the transformer takes .bool() of them)
        "encoder_hidden_states": batch["prompt_embeds"],
        "encoder_attention_mask": batch["prompt_mask"].long(),
        "encoder_hidden_states_2": batch["byt5_embeds"],
        "encoder_attention_mask_2": batch["byt5_mask"].long(),
    }


SPEC = FamilySpec(
    name="hunyuanimage",
    classes=Classes("HunyuanImageTransformer2DModel", "HunyuanImagePipeline", "AutoencoderKLHunyuanImage"),
    latent_kind="image",
    # LoRA: the attention projections (the default) of the dual-stream blocks' image stream, the single-stream blocks
    # (no to_out: their output projection is a fused MLP linear) and the token refiner (HunyuanVideo's targets)
    shift=ShiftSpec.static(SCHEDULER_CONFIG),
    build_inputs=build_inputs,
    patch=Patch("patch_size", frozen(patch_size=(1, 1))),  # HunyuanImageTransformer2DModel's default, the released one
    batch_keys=("latents", "prompt_embeds", "prompt_mask", "byt5_embeds", "byt5_mask"),
)
