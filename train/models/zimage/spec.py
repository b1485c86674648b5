"""Z-Image's training spec: per-sample lists of latents and caption features, ``t = 1 - sigma``, the model predicts
``x0 - noise`` (ZImagePipeline negates it), FLUX.1's 2x2 patch, a static shift."""

from __future__ import annotations

from typing import Any

import torch

from train.models import Batch, Config, Shapes, Streams
from train.models.spec import (
    FLOW_MATCH_EULER,
    PRIMARY_STREAM,
    Classes,
    FamilySpec,
    Patch,
    ShiftSpec,
    frozen,
    one_minus_sigma,
    output_tensors,
)
from train.models.zimage.lora_format import FORMAT


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    latents = noisy_latents["latents"]  # (B, C, H, W)
    mask = batch["prompt_mask"].to(latents.device).bool()
    return {
        "x": list(latents.unsqueeze(2).unbind(dim=0)),  # the pipeline's latent_model_input_list
        "t": timesteps["latents"],
        "cap_feats": [embeds[keep] for embeds, keep in zip(batch["prompt_embeds"], mask, strict=True)],
    }


def unpack_output(out: Any, latents_shapes: Shapes, *, model_config: Config) -> dict[str, torch.Tensor]:
    """The model's per-sample (C, 1, H, W) list (or those already stacked), stacked and squeezed as the pipeline does:
    (B, C, H, W)."""
    samples = [t.reshape(-1, *t.shape[-4:]) for t in output_tensors(out)]
    return {PRIMARY_STREAM: torch.cat(samples).squeeze(2)}


def attention_shape(config: Config) -> tuple[int, int]:
    return int(config["n_heads"]), int(config["dim"]) // int(config["n_heads"])


SPEC = FamilySpec(
    lora_format=FORMAT,
    name="zimage",
    classes=Classes("ZImageTransformer2DModel", "ZImagePipeline", "AutoencoderKL"),
    latent_kind="image",
    # Tongyi-MAI/Z-Image's scheduler/scheduler_config.json: shift 6.0, no dynamic shifting (ZImagePipeline computes a
    # mu the scheduler then ignores). Z-Image-Turbo's states shift 3.0: set model.flow_shift 3.0 to train it.
    shift=ShiftSpec.static(frozen(FLOW_MATCH_EULER, shift=6.0)),
    build_inputs=build_inputs,
    batch_keys=("latents", "prompt_embeds", "prompt_mask"),
    timestep_from_sigma=one_minus_sigma,
    unpack_output=unpack_output,
    patch=Patch((2, 2)),  # the forward's default patch_size 2 (all_patch_size (2,)), f_patch_size 1
    velocity_sign=-1.0,
    attention_shape=attention_shape,
)
