"""LTX-2's training spec: both streams packed as LTX2Pipeline packs them, one timestep for both (the pipeline steps
the audio with a copy of the video scheduler), the rope coordinates its denoising loop precomputes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from train.models import Batch, Config, Shapes, Streams
from train.models.spec import (
    Classes,
    FamilySpec,
    Patch,
    ShiftSpec,
    frozen,
    output_tensors,
    patched_tokens,
    uniform_value,
)

# LTX2Pipeline.__call__'s default `frame_rate` (motion_speed 1: the conditioning frame rate is the frame rate).
FRAME_RATE = 24.0
PIPELINE = "diffusers.pipelines.ltx2.pipeline_ltx2"
PATCH = Patch.time_space(patch_size_t=1, patch_size=1)  # LTX2VideoTransformer3DModel's defaults
# The scheduler: LTX2Pipeline reads base/max image_seq_len and shifts from its scheduler config with these fallbacks
# (calculate_shift(latents.shape[1], 1024, 4096, 0.95, 2.05)), the values of Lightricks' LTX-Video/LTX-2 scheduler
# configs (dynamic shifting; shift_terminal 0.1 is inference-only, see ShiftSpec).
SHIFT = ShiftSpec.linear_mu(PIPELINE, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                            max_image_seq_len=4096, shift_terminal=0.1)  # fmt: skip


def _patch_sizes(model_config: Config) -> tuple[int, int]:
    patch_size_t, patch_size, _ = PATCH.of(model_config)
    return patch_size, patch_size_t


def _ropes(model_config: Config):
    """The transformer's video and audio self-attention RoPE modules (parameter-free), built from its config exactly
    as LTX2VideoTransformer3DModel.__init__ builds ``rope`` / ``audio_rope``: the pipeline precomputes the coordinates
    with their ``prepare_video_coords`` / ``prepare_audio_coords``."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

    c = {**dict(LTX2_DEFAULTS), **dict(model_config)}
    video = LTX2AudioVideoRotaryPosEmbed(
        dim=c["num_attention_heads"] * c["attention_head_dim"], patch_size=c["patch_size"],
        patch_size_t=c["patch_size_t"], scale_factors=tuple(c["vae_scale_factors"]), causal_offset=c["causal_offset"],
        modality="video", rope_type=c["rope_type"], num_attention_heads=c["num_attention_heads"],
    )  # fmt: skip
    audio = LTX2AudioVideoRotaryPosEmbed(
        dim=c["audio_num_attention_heads"] * c["audio_attention_head_dim"], patch_size=c["audio_patch_size"],
        patch_size_t=c["audio_patch_size_t"], sampling_rate=c["audio_sampling_rate"],
        hop_length=c["audio_hop_length"], scale_factors=[c["audio_scale_factor"]], causal_offset=c["causal_offset"],
        modality="audio", rope_type=c["rope_type"], num_attention_heads=c["audio_num_attention_heads"],
    )  # fmt: skip
    return video, audio


# LTX2VideoTransformer3DModel's defaults of the config keys the coordinates read (a config states what differs).
LTX2_DEFAULTS = frozen(
    patch_size=1, patch_size_t=1, vae_scale_factors=(8, 32, 32), causal_offset=1, rope_type="interleaved",
    audio_patch_size=1, audio_patch_size_t=1, audio_sampling_rate=16000, audio_hop_length=160, audio_scale_factor=4,
)  # fmt: skip


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    latents, audio = noisy_latents["latents"], noisy_latents["audio_latents"]
    batch_size, _, frames, height, width = latents.shape
    audio_frames = audio.shape[2]
    patch_size, patch_size_t = _patch_sizes(model_config)
    frame_rate = batch.get("frame_rate")
    fps = FRAME_RATE if frame_rate is None else uniform_value(torch.as_tensor(frame_rate), "frame_rate")
    video_rope, audio_rope = _ropes(model_config)
    # the pipeline's timestep t = sigma * 1000, one for both streams, passed as timestep and as sigma (LTX-2.3)
    timestep = timesteps["latents"]
    mask = batch["prompt_mask"].to(device=latents.device, dtype=torch.int64)  # the connectors' int64 mask
    return {
        "hidden_states": LTX2Pipeline._pack_latents(latents, patch_size, patch_size_t),
        "audio_hidden_states": LTX2Pipeline._pack_audio_latents(audio),
        "encoder_hidden_states": batch["prompt_embeds"],
        "audio_encoder_hidden_states": batch["audio_prompt_embeds"],
        "timestep": timestep,
        "sigma": timestep,
        "encoder_attention_mask": mask,
        "audio_encoder_attention_mask": mask,
        "num_frames": frames,
        "height": height,
        "width": width,
        "fps": fps,
        "audio_num_frames": audio_frames,
        "video_coords": video_rope.prepare_video_coords(batch_size, frames, height, width, latents.device, fps=fps),
        "audio_coords": audio_rope.prepare_audio_coords(batch_size, audio_frames, audio.device),
        "isolate_modalities": False,
        "use_cross_timestep": True,  # LTX2Pipeline.__call__'s default
    }


def unpack_output(out: Any, latents_shapes: Shapes, *, model_config: Config) -> dict[str, torch.Tensor]:
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    video, audio = output_tensors(out)[:2]
    _, _, frames, height, width = latents_shapes["latents"]
    _, _, audio_frames, mel_bins = latents_shapes["audio_latents"]
    patch_size, patch_size_t = _patch_sizes(model_config)
    return {
        "latents": LTX2Pipeline._unpack_latents(
            video, frames // patch_size_t, height // patch_size, width // patch_size, patch_size, patch_size_t
        ),
        "audio_latents": LTX2Pipeline._unpack_audio_latents(audio, audio_frames, mel_bins),
    }


def count_tokens(latents_shapes: Mapping[str, tuple[int, ...]], model_config: Config) -> int:
    """Video patches plus audio tokens (one per audio latent frame: the pipeline packs all mel bins into one)."""
    return patched_tokens(latents_shapes["latents"], PATCH.of(model_config)) + int(latents_shapes["audio_latents"][1])


def shift_seq_len(latents_shape: Sequence[int]) -> int:
    _, frames, height, width = latents_shape
    return frames * height * width  # LTX2Pipeline: calculate_shift(latents.shape[1]), the packed video tokens


SPEC = FamilySpec(
    name="ltx2",
    classes=Classes("LTX2VideoTransformer3DModel", "LTX2Pipeline", "AutoencoderKLLTX2Video"),
    latent_kind="video",
    shift=SHIFT,
    # the pipeline steps the audio with a deepcopy of the video scheduler set to the same sigmas and mu: the audio
    # stream's sigma is the video's (one base draw through the same shift at the video's sequence length)
    extra_streams=frozen(audio_latents=SHIFT),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    patch=PATCH,
    count_tokens=count_tokens,
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "audio_latents", "prompt_embeds", "audio_prompt_embeds", "prompt_mask"),
    # The defaults: LoRA on the attention projections of every attention (video/audio self, text, audio<->video);
    # timestep sigma * 1000; the loss the sum of the two streams' means (weight 1 each, see the package docstring).
)
