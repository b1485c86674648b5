"""Wan 2.2 TI2V-5B image-to-video (WanTransformer3DModel / WanImageToVideoPipeline with ``expand_timesteps=True``):
Wan-AI/Wan2.2-TI2V-5B-Diffusers.

Cache: ``latents`` (48, F, H, W) Wan 2.2 VAE latents (x16 spatial, x4 temporal) normalised as the pipeline does
(``(z - latents_mean) / latents_std``), whose frame 0 is the pipeline's condition: the posterior mode of the clip's
first frame encoded alone (``prepare_latents``); ``prompt_embeds`` (512, 4096) UMT5 states zero-padded as
``encode_prompt`` returns them (no text mask); ``prompt_mask`` (the tokenizer's, not read by the trainer).

Forward kwargs, as WanImageToVideoPipeline's denoising loop with ``expand_timesteps``: ``hidden_states`` = the latents
with frame 0 clean (the spec's ``condition_mask``: the trainer does not noise latent frame 0, gives it timestep 0 and
leaves it out of the loss), ``encoder_hidden_states``, and a per-token ``timestep`` (B, S) = ``sigma * 1000`` on every
token, 0 on frame 0's: the per-element timestep taken at each (1, 2, 2) patch, ``mask[:, ::p_h, ::p_w]`` flattened
in the transformer's token order. Under CP the Wan plan splits that (B, S) timestep exactly like the tokens.

Training is always image-to-video (frame 0 conditioned), the mode WanImageToVideoPipeline runs. Not covered:
text-to-video fine-tuning of the 5B checkpoint (WanPipeline with ``expand_timesteps``: every token at ``t``, frame 0
noised); a per-sample mix of the two modes.
"""

from .encoder import WanTI2VEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
