"""Qwen-Image (QwenImageTransformer2DModel / QwenImagePipeline).

Cache: ``latents`` (C, 1, H, W) as QwenImagePipeline normalises them (``(z - latents_mean) / latents_std`` of
AutoencoderKLQwenImage, whose latents carry a frame axis of 1); ``prompt_embeds`` (L, 3584) with ``prompt_mask`` (L,)
bool, as ``encode_prompt`` returns them (template prefix dropped, right-padded).

Forward kwargs, as QwenImagePipeline's denoising loop: ``hidden_states`` packed 2x2 (``QwenImagePipeline._pack_latents``
on the (B, 1, C, H, W) layout the pipeline uses), ``img_shapes = [[(1, H/2, W/2)]] * B``,
``encoder_hidden_states_mask`` (``None`` when nothing is padded, as ``encode_prompt`` does), ``guidance``
(``guidance_embeds`` checkpoints only), ``timestep = sigma``.

The transformer is double-stream only and returns the image stream: in its LAST block the text-stream output (text
queries -> ``attn.to_add_out`` -> ``txt_mlp``) is computed and then discarded, so those parameters never get a gradient
(:func:`unused_params`; the tiny-model tests freeze them). The text keys/values and ``txt_mod`` of the last block do
reach the image stream.

Not covered: Qwen-Image-Edit (reference-image latents, zero_cond_t).
"""

from .encoder import QwenImageEncoder as Encoder
from .spec import SPEC, unused_params
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny", "unused_params"]
