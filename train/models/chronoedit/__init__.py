"""ChronoEdit (ChronoEditTransformer3DModel / ChronoEditPipeline): Wan image-to-video used as an image editor.

Cache: ``latents`` (C, F, H, W) target video latents normalised as the pipeline does (AutoencoderKLWan mean/std; the
input image is frame 0, the edited image the last frame); ``condition_latents`` (C, F, H, W): the normalised VAE
latents of the conditioning video ``[input image, zeros...]`` (what ``ChronoEditPipeline.prepare_latents`` encodes);
``image_embeds`` (257, 1280): CLIP vision ``hidden_states[-2]`` of the input image (``encode_image``);
``prompt_embeds`` (512, 4096) UMT5 states, zero-padded to 512 as ``encode_prompt`` returns them (no text mask; the Wan
processors require exactly 512 text tokens when image embeddings are prepended).

Forward kwargs, as ChronoEditPipeline's denoising loop: ``hidden_states = cat([latents, mask, condition_latents],
dim=1)`` where ``mask`` (B, 4, F, H, W) is the first-frame mask ``prepare_latents`` builds (1 on latent frame 0, 0
elsewhere), ``encoder_hidden_states``, ``encoder_hidden_states_image``, ``timestep = sigma * 1000``.

Not covered: temporal-reasoning inference (dropping intermediate frames mid-schedule) is an inference-time procedure
with no training counterpart. The loss covers every latent frame, including frame 0 (the input image).
"""

from .encoder import ChronoEditEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
