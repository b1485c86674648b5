"""Wan 2.1 VACE (WanVACETransformer3DModel / WanVACEPipeline): Wan-AI/Wan2.1-VACE-1.3B-diffusers and -14B-diffusers,
Wan 2.1 text-to-video with a control stream (VACE blocks whose hints are added to the main blocks in ``vace_layers``).

Cache: Wan's ``latents`` (16, F, H, W), ``prompt_embeds`` (512, 4096) and ``prompt_mask`` (train/models/wan), plus
``control_latents`` (96, F, H, W): the ``conditioning_latents`` WanVACEPipeline computes from the item's control video
(data.reference_column: a video of the media's frame count, or one image held for every frame) with its default
``mask=None`` (all ones: every pixel generated) and no reference images: ``preprocess_conditions``, then
``prepare_video_latents`` (the normalised VAE modes of the inactive ``video * (1 - mask)`` = zeros and the reactive
``video * mask`` = the control video, 16 channels each), then ``prepare_masks`` (the mask cut into its 8x8 pixel cells,
64 channels on the latent grid, resampled to the latent frames with nearest-exact), concatenated in channels. The
encoder calls the pipeline's own methods (``WanVACEEncoder.control_latents``), which also take a partial mask and
reference images.

Forward kwargs, as WanVACEPipeline's denoising loop: ``hidden_states`` = the noisy latents, ``encoder_hidden_states``,
``timestep = sigma * 1000``, ``control_hidden_states`` = ``control_latents`` in the transformer's dtype and
``control_hidden_states_scale`` = ones (``conditioning_scale`` 1.0, one per VACE layer). Under CP the plan
(cp_plans/wanvace.yaml) splits the control tokens where they enter the control stream.

Not covered by train.prepare: a per-item mask (inpainting / outpainting data) and reference images (subject
references): the data path supplies one control video only. ``control_latents`` reproduces both (tested against the
pipeline); with R reference images the pipeline denoises R more latent frames in front, so such an item's ``latents``
would need the references' latents prepended (DiffSynth's VACE training does the same), and the loss covers them.
Wan 2.2 VACE-Fun (two experts), ``conditioning_scale`` other than 1 and per-item control scales are not covered. The
flow shift is Wan's 480p default 3.0; set ``model.flow_shift`` 5.0 for 720p.
"""

from .encoder import WanVACEEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
