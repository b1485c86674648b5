"""Wan 2.1 image-to-video (WanTransformer3DModel / WanImageToVideoPipeline): Wan-AI/Wan2.1-I2V-14B-480P and -720P.

Cache: ``latents`` (C, F, H, W) video latents normalised as the pipeline does (AutoencoderKLWan mean/std); frame 0 of
the clip is the input image. ``condition_latents`` (C, F, H, W): the normalised VAE latents (posterior mode) of the
conditioning video ``[first frame, zeros...]`` that ``WanImageToVideoPipeline.prepare_latents`` encodes;
``image_embeds`` (257, 1280): CLIP vision ``hidden_states[-2]`` of the first frame (``encode_image``);
``prompt_embeds`` (512, 4096) UMT5 states, zero-padded to 512 as ``encode_prompt`` returns them (no text mask; the Wan
I2V processors take every token past 512 as image context, so the text is exactly 512 tokens); ``prompt_mask``.

Forward kwargs, as WanImageToVideoPipeline's denoising loop: ``hidden_states = cat([latents, mask,
condition_latents], dim=1)`` where ``mask`` (B, 4, F, H, W) is the first-frame mask ``prepare_latents`` builds (1 on
latent frame 0, 0 elsewhere), ``encoder_hidden_states``, ``encoder_hidden_states_image``, ``timestep = sigma *
1000`` (B,).

Not covered: first-last-frame conditioning (``last_image``, Wan2.1-FLF2V). Every latent frame is noised and in the
loss, frame 0 included (Wan 2.1 I2V regenerates the first frame from the channel condition). The flow shift is the
480p default (3.0); set ``model.flow_shift`` 5.0 for the 720P checkpoint. ChronoEdit (train/models/chronoedit) reuses
this spec's inputs and this encoder.
"""

from .encoder import WanI2VEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
