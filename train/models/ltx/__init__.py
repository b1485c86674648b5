"""LTX-Video (LTXVideoTransformer3DModel / LTXPipeline).

Cache: ``latents`` (C, F, H, W) as LTXPipeline normalises them (``LTXPipeline._normalize_latents`` with the VAE's
latents mean/std and scaling factor); ``prompt_embeds`` (128, 4096) T5 states with ``prompt_mask`` (128,) bool;
``frame_rate`` (per sample, all equal in a batch; optional, default the pipeline's 25 fps).

Forward kwargs, as LTXPipeline's denoising loop: ``hidden_states`` (``LTXPipeline._pack_latents``),
``encoder_hidden_states``, ``encoder_attention_mask``, ``num_frames`` / ``height`` / ``width`` (post-patch latent grid),
``rope_interpolation_scale = (vae_temporal_compression / frame_rate, vae_spatial_compression,
vae_spatial_compression)``, ``timestep = sigma * 1000``.

Context parallelism: the text mask is fed under CP too. LTXVideoAttnProcessor turns it into a per-head
(B, heads, 1, S_text) bias; the Ulysses attention gives each rank the rows of the heads it owns (train/cp/ulysses.py).

Image-to-video (LTXImageToVideoPipeline) is the ``ltx_i2v`` family. Not covered: LTXConditionPipeline.
"""

from .encoder import LTXEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
