"""FLUX.1 (FluxTransformer2DModel / FluxPipeline).

Cache: ``latents`` (C, H, W) as FluxPipeline normalises them (``(z - shift_factor) * scaling_factor``, 16 channels,
H and W even), ``prompt_embeds`` (L, 4096) T5, ``pooled_embeds`` (768,) CLIP pooled, ``prompt_mask`` (the T5
tokenizer's, not read by the trainer: FluxPipeline lets the padding tokens be attended). Optional ``guidance`` (scalar
per sample) overrides the pipeline's default guidance scale for guidance-distilled checkpoints.

Forward kwargs, as FluxPipeline's denoising loop passes them (minus CFG): ``hidden_states`` packed 2x2
(``FluxPipeline._pack_latents``), ``img_ids`` (``FluxPipeline._prepare_latent_image_ids``), ``txt_ids`` (zeros, as
``encode_prompt``), ``pooled_projections``, ``guidance`` (``guidance_embeds`` checkpoints), ``timestep = sigma``.

Not covered: FLUX.1 Kontext / Fill / controlnet inputs.
"""

from .encoder import FluxEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
