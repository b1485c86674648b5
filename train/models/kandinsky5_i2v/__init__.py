"""Kandinsky 5.0 image-to-video (Kandinsky5Transformer3DModel / Kandinsky5I2VPipeline): kandinskylab's
Kandinsky-5.0-I2V-Lite-5s-Diffusers (2B, shipped config) and -I2V-Pro-sft-5s-Diffusers (19B; the same class: set
model.pretrained_path, no shipped config). Everything not stated here is the ``kandinsky5`` family's (T2V): its encoder,
text, attention processor, CP plan, tiny components and flow shift.

Cache: as ``kandinsky5`` (``latents`` (C, F, H, W) ``z * scaling_factor`` of AutoencoderKLHunyuanVideo;
``prompt_embeds`` (L, 3584) unpadded Qwen2.5-VL states, ``prompt_mask`` (L,) all true, ``pooled_embeds`` (768,) CLIP;
the I2V pipeline's prompt template and ``encode_prompt`` are the T2V pipeline's, line for line), except that latent
frame 0 is the pipeline's image latents: the clip's first frame through ``video_processor.preprocess``, encoded alone
as a one-frame video, times ``scaling_factor`` (``prepare_latents``; the VAE's GroupNorms pool over time, so the
clip's own latent frame 0 is not that). The pipeline samples the image's posterior: ``prepare``'s ``mode`` applies to
frame 0 as to the clip.

Forward kwargs, as Kandinsky5I2VPipeline's denoising loop (minus CFG): T2V's (``hidden_states`` (B, F, H, W, C)
channels-last, ``encoder_hidden_states``, ``pooled_projections``, the RoPE positions and ``scale_factor``,
``sparse_params=None``), with latent frame 0 clean (the spec's ``condition_mask``: the trainer does not noise it and
leaves it out of the loss; the loop steps ``latents[:, 1:]`` only) and, with ``visual_cond`` (every released
checkpoint), the zero condition and a mask channel of 1 on latent frame 0, 0 elsewhere. ``timestep = sigma * 1000``
(B,) is one value for every frame, the clean one included, as the pipeline passes it. The loss is on frames 1..F-1.

Not covered: the pipeline's ``normalize_first_frame`` (a decode-time statistics fix of the first 4 latent frames
against the next 5; with fewer than 5 latent frames it gives NaN, so validation refuses fewer than 17 frames),
``visual_cond`` images other than the zeros the pipeline passes, NABLA sparse attention, CFG and negative prompts in
training, and what ``kandinsky5`` does not cover.
"""

from .encoder import Kandinsky5I2VEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
