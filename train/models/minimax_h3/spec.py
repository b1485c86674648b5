"""MiniMax-H3's training spec: the packed [text | audio | video] layout and per-row timesteps of its t2va loop."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from train.models import Batch, Config, Shapes, Streams
from train.models.minimax_h3.lora_format import FORMAT
from train.models.spec import (
    Classes,
    FamilySpec,
    Patch,
    ShiftSpec,
    frozen,
    one_minus_sigma,
    output_tensors,
    patched_tokens,
    uniform_value,
)

# MiniMaxH3Scheduler defaults of the two schedulers the pipeline holds (`scheduler`, `audio_scheduler`).
VIDEO_SCHEDULER_CONFIG = frozen(shift=12.0)
AUDIO_SCHEDULER_CONFIG = frozen(shift=3.0)
# MiniMaxH3ModularPipeline.keyframe_noise_aug: the `t` conditioning rows are held at.
KEYFRAME_NOISE_AUG = 0.999
PATCH = Patch("patch_size", frozen(patch_size=(1, 2, 2)))  # MiniMaxH3Transformer3DModel's default


def _text(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Text rows (B, L, D) and their (L,) modality tags, with padding a ``prompt_mask`` marks removed."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MINIMAX_H3_TEXT_TAG

    text = batch["prompt_embeds"]
    tags = batch.get("text_token_tags")
    tags = torch.full(text.shape[1:2], MINIMAX_H3_TEXT_TAG, dtype=torch.long) if tags is None else tags
    if tags.ndim == 2:
        if not bool((tags == tags[:1]).all()):
            raise ValueError("text_token_tags must be the same for every sample of a MiniMax-H3 batch")
        tags = tags[0]
    mask = batch.get("prompt_mask")
    if mask is not None:
        mask = mask.bool().reshape(-1, text.shape[1])
        if not bool((mask == mask[:1]).all()):
            raise ValueError("MiniMax-H3 packs one unpadded layout per batch: every prompt_mask must be the same")
        keep = mask[0]
        if not bool(keep.all()):
            text, tags = text[:, keep.to(text.device)], tags[keep.to(tags.device)]
    return text, tags.cpu()


def pack_audio(audio_latents: torch.Tensor) -> torch.Tensor:
    """(B, audio_channels, latent_channels, N) -> channel-major rows (B, audio_channels * N, latent_channels).

    Per sample this is ``MiniMaxH3PrepareLatentsStep``'s ``audio_latents.permute(0, 2, 1).reshape(-1, channels)``.
    """
    batch_size, audio_channels, channels, num_latents = audio_latents.shape
    return audio_latents.permute(0, 1, 3, 2).reshape(batch_size, audio_channels * num_latents, channels)


def unpack_audio(rows: torch.Tensor, num_latents: int) -> torch.Tensor:
    """Inverse of :func:`pack_audio` (as ``MiniMaxH3AfterDenoiseStep``)."""
    batch_size, _, channels = rows.shape
    return rows.reshape(batch_size, -1, num_latents, channels).permute(0, 1, 3, 2)


def unpatchify_video(rows: torch.Tensor, shape: Sequence[int], patch_size: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of ``patchify_video_latents`` for (B, rows, C * prod(patch)) rows (as ``MiniMaxH3AfterDenoiseStep``)."""
    batch_size, channels, frames, height, width = shape
    patch_t, patch_h, patch_w = patch_size
    rows = rows.reshape(
        batch_size, frames // patch_t, height // patch_h, width // patch_w, channels, patch_t, patch_h, patch_w
    )
    return rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(batch_size, channels, frames, height, width)


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
        patchify_video_latents,
    )
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        MINIMAX_H3_AUDIO_CHANNELS,
        MINIMAX_H3_AUDIO_TAG,
        MINIMAX_H3_VIDEO_TAG,
    )
    from diffusers.utils.torch_utils import maybe_adjust_dtype_for_device

    video = noisy_latents["latents"]
    audio = noisy_latents["audio_latents"]
    batch_size, _, frames, height, width = video.shape
    audio_channels, num_audio_latents = audio.shape[1], audio.shape[3]
    if audio_channels != MINIMAX_H3_AUDIO_CHANNELS:
        raise ValueError(f"audio_latents must hold {MINIMAX_H3_AUDIO_CHANNELS} channels, got {tuple(audio.shape)}")
    patch_size = PATCH.of(model_config)
    video_rows_dim = video.shape[1] * math.prod(patch_size)
    device = video.device
    text, text_tags = _text(batch)

    position_ids, token_tags, video_indices, audio_indices, text_indices, cond_video_rows, cond_audio_rows = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            text_tags,
            frames,
            height,
            width,
            num_audio_latents,
            patch_size,
            audio_channels,
            MINIMAX_H3_AUDIO_TAG,
            MINIMAX_H3_VIDEO_TAG,
        )
    )
    video_t = uniform_value(timesteps["latents"], "MiniMax-H3 video timestep")
    audio_t = uniform_value(timesteps["audio_latents"], "MiniMax-H3 audio timestep")
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_indices,
        audio_indices,
        cond_video_rows,
        cond_audio_rows,
        text_indices.numel(),
        video_t,
        audio_t,
        max(video_t, KEYFRAME_NOISE_AUG),
        1.0,
    )
    return {
        "hidden_states": patchify_video_latents(video, patch_size).reshape(batch_size, -1, video_rows_dim),
        "audio_hidden_states": pack_audio(audio),
        "encoder_hidden_states": text,
        "timestep": timestep.to(device),
        "timestep_indices": timestep_indices.to(device),
        "token_tags": token_tags.to(device),
        "position_ids": position_ids.to(device, maybe_adjust_dtype_for_device(position_ids.dtype, device)),
        "video_indices": video_indices.to(device),
        "audio_indices": audio_indices.to(device),
        "text_indices": text_indices.to(device),
    }


def unpack_output(out: Any, latents_shapes: Shapes, *, model_config: Config) -> dict[str, torch.Tensor]:
    video_rows, audio_rows = output_tensors(out)[:2]
    return {
        "latents": unpatchify_video(video_rows, latents_shapes["latents"], PATCH.of(model_config)),
        "audio_latents": unpack_audio(audio_rows, latents_shapes["audio_latents"][-1]),
    }


def count_tokens(latents_shapes: Mapping[str, tuple[int, ...]], model_config: Config) -> int:
    """Video rows after the patch plus audio rows (one per stereo channel and audio latent), per sample."""
    audio_channels, _, num_audio_latents = latents_shapes["audio_latents"]
    return patched_tokens(latents_shapes["latents"], PATCH.of(model_config)) + audio_channels * num_audio_latents


SPEC = FamilySpec(
    lora_format=FORMAT,
    name="minimax_h3",
    classes=Classes("MiniMaxH3Transformer3DModel", "MiniMaxH3ModularPipeline", "AutoencoderKLMiniMaxH3"),
    latent_kind="video",
    # LoRA: the attention projections (the default) of the main blocks and of the text token refiner.
    shift=ShiftSpec.static(VIDEO_SCHEDULER_CONFIG, "MiniMaxH3Scheduler"),
    extra_streams=frozen(audio_latents=ShiftSpec.static(AUDIO_SCHEDULER_CONFIG, "MiniMaxH3Scheduler")),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=one_minus_sigma,
    patch=PATCH,
    count_tokens=count_tokens,  # video patches + audio rows
    batch_keys=("latents", "audio_latents", "prompt_embeds"),
    shared_timestep=True,
    shared_text_length=True,
    velocity_sign=-1.0,
)
