"""SkyReels-V2's training spec: the T2V pipeline's (B,) timestep or the diffusion-forcing pipeline's per-frame one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from train.models.spec import FamilySpec, ShiftSpec, frozen, output_tensors, patched_tokens, sigma_times_1000

# Skywork/SkyReels-V2-{DF,T2V}-*-Diffusers scheduler/scheduler_config.json (relevant keys): UniPC with flow sigmas. The
# shift is 8.0, the SkyReels-V2 text-to-video / diffusion-forcing setting of the diffusers docs' examples (5.0 for
# image-to-video); set model.flow_shift for another.
SCHEDULER_CONFIG = frozen(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=8.0,
)
FPS_INDEX = {16: 0}  # the pipelines' `fps_embeds`: 0 for 16 fps, 1 for any other rate (24 is __call__'s default)
DEFAULT_FPS_INDEX = 1


def fps_index(fps: float) -> int:
    return FPS_INDEX.get(round(fps), DEFAULT_FPS_INDEX)


def build_inputs(
    batch: Mapping[str, Any],
    noisy_latents: Mapping[str, torch.Tensor],
    timesteps: Mapping[str, torch.Tensor],
    *,
    model_config: Mapping[str, Any],
) -> dict[str, Any]:
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


def unpack_output(
    out: Any, latents_shapes: Mapping[str, torch.Size], *, model_config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    return {"latents": output_tensors(out)[0]}


def count_tokens(latents_shapes: Mapping[str, tuple[int, ...]], model_config: Mapping[str, Any]) -> int:
    return patched_tokens(latents_shapes["latents"], model_config["patch_size"])  # (1, 2, 2) patches of (F, H, W)


SPEC = FamilySpec(
    name="skyreels_v2",
    transformer_class="SkyReelsV2Transformer3DModel",
    pipeline_class="SkyReelsV2DiffusionForcingPipeline",
    vae_class="AutoencoderKLWan",
    latent_kind="video",
    # Self- and cross-attention projections (`attn1` / `attn2`), as for Wan (the same block).
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
    # Diffusion forcing with SkyReels-V2's non-decreasing noise schedule (later frames at least as noisy); the T2V
    # checkpoints train with train.frame_sigmas: shared.
    frame_sigmas="non_decreasing",
)
