"""SkyReels-V2's training spec: the T2V pipeline's (B,) timestep or the diffusion-forcing pipeline's per-frame one."""

from __future__ import annotations

import dataclasses
from typing import Any

from train.models import Batch, Config, Streams
from train.models.spec import Classes
from train.models.wan import spec as wan

FPS_INDEX = {16: 0}  # the pipelines' `fps_embeds`: 0 for 16 fps, 1 for any other rate (24 is __call__'s default)
DEFAULT_FPS_INDEX = 1


def fps_index(fps: float) -> int:
    return FPS_INDEX.get(round(fps), DEFAULT_FPS_INDEX)


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    latents, t = noisy_latents["latents"], timesteps["latents"]
    kwargs: dict[str, Any] = {"hidden_states": latents, "encoder_hidden_states": batch["prompt_embeds"]}
    if t.ndim == 1:  # SkyReelsV2Pipeline: one timestep per sample
        kwargs["timestep"] = t
    else:  # SkyReelsV2DiffusionForcingPipeline: (B, F) per latent frame, from per-frame sigmas (B, 1, F, 1, 1)
        B, F = latents.shape[0], latents.shape[2]
        kwargs["timestep"] = t.expand(B, 1, F, 1, 1).reshape(B, F)
        kwargs["enable_diffusion_forcing"] = True
    if model_config.get("inject_sample_info"):
        index = batch.get("fps_index")  # optional cache key; synthetic data: the pipeline's default 24 fps
        fps = [DEFAULT_FPS_INDEX] * latents.shape[0] if index is None else index.long().view(-1).tolist()
        # One index for the whole batch when the samples share it: the diffusion-forcing forward repeats the fps
        # projection per frame, not per sample ((B * F, 6, D)), so only a single index broadcasts over B > 1.
        if len(set(fps)) == 1:
            fps = fps[:1]
        elif "enable_diffusion_forcing" in kwargs:
            from train.errors import UserError

            raise UserError("SkyReels-V2's diffusion-forcing forward takes one fps embedding per batch, and this "
                            f"batch mixes fps indices {fps} (16 fps and other rates); set train.batch_size: 1 or "
                            "prepare the clips at one fps")  # fmt: skip
        kwargs["fps"] = fps
    return kwargs


# Wan's block (its LoRA targets, patches and output layout) and UMT5 text.
SPEC = dataclasses.replace(
    wan.SPEC,
    name="skyreels_v2",
    classes=Classes("SkyReelsV2Transformer3DModel", "SkyReelsV2DiffusionForcingPipeline", "AutoencoderKLWan"),
    # Skywork/SkyReels-V2-{DF,T2V}-*-Diffusers: UniPC with flow sigmas. The shift is 8.0, the SkyReels-V2
    # text-to-video / diffusion-forcing setting of the diffusers docs' examples (5.0 for image-to-video); set
    # model.flow_shift for another.
    shift=wan.unipc_flow_shift(8.0),
    build_inputs=build_inputs,
    # Diffusion forcing with SkyReels-V2's non-decreasing noise schedule (later frames at least as noisy); the T2V
    # checkpoints train with train.frame_sigmas: shared.
    frame_sigmas="non_decreasing",
)
