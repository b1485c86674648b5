"""LTX-Video image-to-video (LTXVideoTransformer3DModel / LTXImageToVideoPipeline): Lightricks/LTX-Video (0.9.x).

Cache: as the ``ltx`` family (``latents`` (C, F, H, W) normalised as LTXPipeline does, ``prompt_embeds`` (128, 4096)
with ``prompt_mask`` (128,) bool, ``frame_rate``), except that latent frame 0 is the pipeline's condition: the clip's
first frame through ``video_processor.preprocess`` and encoded alone, normalised as
``LTXImageToVideoPipeline.prepare_latents`` does (``_normalize_latents`` with the VAE's mean/std).

Forward kwargs, as LTXImageToVideoPipeline's denoising loop: LTX's (``hidden_states`` packed, the text and its mask,
the post-patch grid, ``rope_interpolation_scale``), with latent frame 0 clean (the spec's ``condition_mask``: the
trainer does not noise it and leaves it out of the loss; the pipeline's ``image latents * mask + noise * (1 - mask)``)
and a per-token ``timestep`` (B, S) = ``t * (1 - conditioning_mask)``: the per-element timestep packed exactly like the
latents (``_pack_latents``, as the pipeline packs its conditioning mask). Under CP the LTX plan splits that (B, S)
timestep like the tokens (the text-to-video (B,) timestep stays whole).

Training is always image-to-video (frame 0 conditioned). Not covered: LTXConditionPipeline (conditioning on frames
other than the first, or on videos); the pipeline's ``decode_timestep`` / noise injection at decode.
"""

from .encoder import LTXImageToVideoEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
