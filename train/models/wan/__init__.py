"""Wan 2.1 text-to-video (WanTransformer3DModel / WanPipeline).

Cache: ``latents`` (C, F, H, W) as WanPipeline normalises them (``(z - latents_mean) / latents_std`` of
AutoencoderKLWan); ``prompt_embeds`` (512, 4096) UMT5 states as ``encode_prompt`` returns them: cut to the prompt
length and zero-padded to ``max_sequence_length`` (the pipeline passes no text mask); ``prompt_mask`` (the tokenizer's,
not read by the trainer).

Forward kwargs, as WanPipeline's denoising loop: ``hidden_states`` = the latents unchanged (the transformer patchifies
them itself), ``encoder_hidden_states``, ``timestep = sigma * 1000``.

Not covered: Wan 2.2 A14B (two experts switched at boundary_ratio) and TI2V-5B (expand_timesteps: per-token
timesteps). The flow shift is the 480p default (3.0); set ``model.flow_shift`` for another (e.g. 5.0 for 720p).
"""

from .encoder import WanEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
