"""MiniMax-H3's data encoder: video latents, the soundtrack's audio latents and Qwen3-VL prompt embeddings, through
the modular pipeline's own components, helpers and blocks."""

from __future__ import annotations

import math

import torch

from train.data.media import Geometry
from train.models.encoder import (
    FamilyEncoder,
    causal_frame_cells,
    load_processor_without_video,
    transformer_patch,
)


def load_qwen3vl_processor_without_torchvision(path: str, subfolder: str = "processor", revision: str | None = None):
    """The checkpoint's Qwen3VLProcessor (its tokenizer and image processor, read from its own files) less the video
    processor, for machines without torchvision, where transformers cannot build Qwen3VLVideoProcessor. MiniMax-H3's
    text-only (t2va) encoding uses the processor for `create_mm_token_type_ids` alone, which reads token ids only."""
    return load_processor_without_video("Qwen3VLProcessor", path, subfolder, revision)


class MiniMaxH3Encoder(FamilyEncoder):
    """MiniMax-H3, text-to-video+audio (t2va), through its modular pipeline's own components and helpers.

    - `latents` (24, 5n + 2, H/16, W/16): clips of 17n + 5 frames in the pixel convention of the pipeline's
      `encode_vae_condition` (uint8 / 255, ImageNet mean/std), posterior sampled with the item's generator (or its
      mean), normalised `(z - latents_mean) / latents_std` (the inverse of `MiniMaxH3VideoDecodeStep`). Unlike a
      conditioning keyframe, the target is not rounded to float16 and not sampled under the fixed keyframe seed.
    - `audio_latents` (2, 32, N): the soundtrack (`train.data.media.load_audio`: the audio VAE's rate, stereo, from the
      clip's first frame) over N = `audio_latent_num_frames(F, fps)` latents, i.e. exactly N hops, encoded as two mono
      batch items and normalised per channel, as `MiniMaxH3Ref2VAReferenceEncoderStep` encodes a soundtrack (posterior
      mean, never sampled) in the `(audio_channels, latent_channels, N)` layout `MiniMaxH3AudioDecodeStep` decodes. A
      clip without an audio stream is a bad item (`no_audio`).
    - `prompt_embeds` (L, D): `MiniMaxH3TextEncoderStep` itself (the prompt verbatim, no special tokens, Qwen3-VL
      hidden_states[`text_encoder_layer`]), unpadded; `data.max_text_tokens` keeps the first L rows (the encoder is
      causal: the same rows a truncated prompt gives), null keeps them all. The empty caption has no token: (0, D).
      `prompt_mask` is all true.

    The released model runs at 24 fps (`MiniMaxH3ModularPipeline.fps`): set data.fps to 24. Loading needs torchvision
    for transformers' Qwen3VLProcessor; without it the processor is rebuilt from the checkpoint's files less its video
    processor (`load_qwen3vl_processor_without_torchvision`), which the text-only presentation never uses.
    """

    name = "minimax_h3"
    default_geometry = Geometry("minimax_h3", "video", 32, 17, 5)
    latent_strides = (24, 4, 16)

    def latent_shapes(self, frames, height, width, fps):
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
            audio_latent_num_frames,
            video_latent_num_frames,
        )

        # the video VAE encodes clips of 17 frames into 5 latent frames; audio latents at the released 24 fps
        video = (24, video_latent_num_frames(frames, 17, 5), height // 16, width // 16)
        return {"latents": video, "audio_latents": (2, 32, audio_latent_num_frames(frames, fps or 24.0))}

    def latent_frame_cells(self, frames, latent_frames):
        # AutoencoderKLMiniMaxH3._encode: clip_length-frame chunks (the last one padded), each causal at the temporal
        # ratio, then the trailing token_drop latent frames cut: 17n + 5 frames -> 5n + 2 latent frames
        vae = self.pipe.vae
        return causal_frame_cells(frames, vae.temporal_compression_ratio, vae.config.clip_length)[:latent_frames]

    def text_tokens(self, max_text_tokens: int | None) -> int | None:
        return max_text_tokens  # None: the whole prompt, as the pipeline encodes it (it neither pads nor truncates)

    def _geometry(self, vae_config, tr_config):
        # MiniMaxH3ModularPipeline.canvas_multiple, and align_num_frames' clip_length * n + tokens_chunk_size
        patch = transformer_patch(tr_config, "patch_size", (1, 2, 2))
        spatial = math.prod(vae_config.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1)))
        clip_length = vae_config.get("clip_length", 17)
        temporal = math.prod(vae_config.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1)))
        return spatial * max(patch[1], patch[2]), clip_length, math.ceil(clip_length / temporal)

    def load(self, pretrained_path, *, revision=None, device="cpu", text_dtype=torch.float32):
        from diffusers import MiniMaxH3ModularPipeline
        from diffusers.utils import logging as dlogging
        from transformers.utils import is_torchvision_available
        from transformers.utils import logging as tlogging

        dlogging.disable_progress_bar()
        tlogging.disable_progress_bar()
        pipe = MiniMaxH3ModularPipeline.from_pretrained(pretrained_path, revision=revision, workflow="t2va")
        models = ["text_encoder", "vae", "audio_vae"]
        dtype = {"default": text_dtype, "vae": torch.float32, "audio_vae": torch.float32}
        pipe.load_components(names=models, dtype=dtype)
        pipe.load_components(names=["tokenizer", "processor"] if is_torchvision_available() else ["tokenizer"])
        if getattr(pipe, "processor", None) is None and not is_torchvision_available():
            spec = pipe._component_specs["processor"]
            pipe.update_components(
                processor=load_qwen3vl_processor_without_torchvision(
                    spec.pretrained_model_name_or_path or pretrained_path, spec.subfolder or "processor", spec.revision
                )
            )
        missing = [n for n in (*models, "tokenizer", "processor") if getattr(pipe, n, None) is None]
        if missing:  # load_components only logs what it could not load
            raise OSError(f"{pretrained_path}: could not load MiniMax-H3 component(s) {missing} (see the log above)")
        self.pipe, self.device = pipe, torch.device(device)
        pipe.to(self.device)

    # ------------------------------------------------------------------------------------------------- encoding

    def encode_text(self, caption, max_tokens):
        from diffusers.modular_pipelines import PipelineState
        from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

        pipe = self.pipe
        if not pipe.tokenizer(caption, add_special_tokens=False)["input_ids"]:  # "" has no token to encode
            width = pipe.text_encoder.config.text_config.hidden_size
            embeds = torch.zeros(0, width, dtype=pipe.text_encoder.dtype)
        else:
            state = PipelineState()
            state.set("prompt", caption)
            MiniMaxH3TextEncoderStep()(pipe, state)
            embeds = state.get("prompt_embeds")[0]
        if max_tokens is not None:
            embeds = embeds[:max_tokens]
        return {"prompt_embeds": embeds, "prompt_mask": torch.ones(embeds.shape[0], dtype=torch.bool)}

    def encode_media(self, pixels, generator, mode, fps):
        pipe, vae = self.pipe, self.pipe.vae
        # encode_vae_condition's pixel convention, from the uint8 clip the [-1, 1] input was made of
        u8 = pixels.add(1.0).mul(127.5).round().clamp(0, 255).unsqueeze(0).to(self.device)
        pixel_mean = torch.tensor(pipe.pixel_mean, device=self.device).view(1, -1, 1, 1, 1)
        pixel_std = torch.tensor(pipe.pixel_std, device=self.device).view(1, -1, 1, 1, 1)
        z = self._vae_encode((u8.div(255.0) - pixel_mean) / pixel_std, generator, mode)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        return {"latents": ((z - mean) / std)[0]}

    def num_audio_latents(self, num_frames: int, fps: float) -> int:
        """Audio latents of a clip of num_frames at fps: the pipeline's `audio_latent_num_frames` at the VAE's rate."""
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

        audio_vae = self.pipe.audio_vae
        return audio_latent_num_frames(num_frames, fps, audio_vae.config.sampling_rate / audio_vae.hop_length)

    def load_extra(self, src, info, bucket, fps, reference=None):
        from train.data.media import load_audio

        fps = fps or info.fps or self.pipe.fps
        rate, hop = self.pipe.audio_sampling_rate, self.pipe.audio_vae.hop_length
        num_latents = self.num_audio_latents(bucket.frames, fps)
        # slack for a track that ends up to a frame (+ a hop) before the window does; more is `too_short`
        return load_audio(src, num_latents * hop, rate, max_pad=math.ceil(rate / fps) + hop)

    def encode_extra(self, extra, generator, mode, fps):
        vae = self.pipe.audio_vae
        posterior = vae.encode(extra.to(self.device, torch.float32)[:, None], return_dict=False)[0]
        z = posterior.mode().float()  # (2, 32, N): the stereo channels are two batch items of the mono audio VAE
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1).to(z.device)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1).to(z.device)
        return {"audio_latents": (z - mean) / std}
