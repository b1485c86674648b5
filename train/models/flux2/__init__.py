"""FLUX.2 (Flux2Transformer2DModel / Flux2Pipeline).

Cache: ``latents`` (C, H, W) as Flux2Pipeline normalises them: the VAE latents 2x2-patchified
(``Flux2Pipeline._patchify_latents``, 128 channels) and then batch-norm normalised with the VAE's running stats;
``prompt_embeds`` (L, D) Mistral hidden states (stacked layers 10/20/30), ``prompt_mask`` (the chat template's, not read
by the trainer: Flux2Pipeline passes no text mask). Optional ``guidance`` overrides the default guidance scale.

Forward kwargs, as Flux2Pipeline's denoising loop (text-to-image, no reference images): ``hidden_states``
(``Flux2Pipeline._pack_latents``), ``img_ids`` (``_prepare_latent_ids``), ``txt_ids`` (``_prepare_text_ids``),
``guidance`` (``guidance_embeds`` checkpoints; Klein checkpoints have none), ``timestep = sigma``.

Not covered: reference-image (image-to-image / multi-reference) conditioning. The dynamic shift's mu depends on the
inference step count in Flux2Pipeline; training uses the pipeline default (50).
"""

from .encoder import Flux2Encoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
