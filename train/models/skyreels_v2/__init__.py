"""SkyReels-V2 (SkyReelsV2Transformer3DModel): text-to-video and diffusion forcing (SkyReelsV2Pipeline /
SkyReelsV2DiffusionForcingPipeline).

Cache: Wan's, as the SkyReels-V2 pipelines copy WanPipeline's preparation: ``latents`` (C, F, H, W) normalised
``(z - latents_mean) / latents_std`` of AutoencoderKLWan; ``prompt_embeds`` (512, 4096) UMT5 states cut to the prompt
length and zero-padded (no text mask is passed); ``prompt_mask`` (not read); ``fps_index`` (1,) the pipelines'
``fps_embeds`` of the clip's rate (0 for 16 fps, else 1; absent in synthetic data: 1, the pipelines' default 24 fps).

Forward kwargs, as the pipelines' denoising loops: ``hidden_states`` = the noisy latents (patchified inside),
``encoder_hidden_states``, ``fps`` (a list of fps indices; only with ``inject_sample_info``, the DF checkpoints) and
``timestep``:
- diffusion forcing (the family default, ``train.frame_sigmas`` non_decreasing or independent): ``timestep`` (B, F)
  = ``sigma_f * 1000`` per latent frame and ``enable_diffusion_forcing=True``, as SkyReelsV2DiffusionForcingPipeline
  passes its step-matrix row. Training sigmas: per frame, B * F draws of the recipe's density, shifted, sorted along
  the frames so that later frames are at least as noisy, the non-decreasing schedule SkyReels-V2 trains its
  diffusion-forcing models with and that the pipeline's ``generate_timestep_matrix`` walks (earlier frames less
  noisy; a synchronous ``ar_step=0`` run is the all-equal corner). Each frame's loss is weighted by its own sigma's
  weight (``train.loss_weighting``).
- text-to-video checkpoints (SkyReels-V2-T2V-14B-*): ``train.frame_sigmas: shared``: ``timestep`` (B,) = ``sigma *
  1000``, as SkyReelsV2Pipeline.

Not covered: image-to-video (SkyReels-V2-I2V-*: CLIP image tokens + condition channels) and the DF pipelines' clean
prefix frames (video extension); ``num_frame_per_block > 1`` (block-causal attention mask, which the CP attention does
not split). The DF forward takes one fps index per batch (a diffusers limit): a batch mixing 16 fps clips with
others is refused.
"""

from .encoder import SkyReelsV2Encoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
