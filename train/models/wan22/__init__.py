"""Wan 2.2 A14B text-to-video, two experts (WanTransformer3DModel x 2 / WanPipeline): Wan-AI/Wan2.2-T2V-A14B-Diffusers.

Cache: as Wan 2.1 text-to-video (train/models/wan): ``latents`` (16, F, H, W) normalised with the Wan 2.1 VAE's
mean/std, ``prompt_embeds`` (512, 4096) UMT5 states zero-padded to 512, ``prompt_mask``.

Forward kwargs, as WanPipeline's denoising loop: ``hidden_states`` = the latents, ``encoder_hidden_states``,
``timestep = sigma * 1000`` (B,), given to one expert: ``transformer`` (high noise) while the timestep is at least
``boundary_ratio * 1000``, ``transformer_2`` (low noise) below it. ``boundary_ratio`` is the pipeline's
model_index.json value (0.875), shipped as configs/Wan-AI--Wan2.2-T2V-A14B-Diffusers--model_index.json.

A run trains ONE expert: ``model.subfolder`` (``transformer`` or ``transformer_2``) picks it and the trainer draws
sigmas only from its range (``sigma >= boundary_ratio`` for ``transformer``, below for ``transformer_2``; see
train.models.expert_sigma_range); ``model.boundary_ratio`` overrides the pipeline's. A LoRA export of a
``transformer_2`` run loads with ``pipe.load_lora_weights(dir, load_into_transformer_2=True)``.

Not covered: training both experts in one run. The flow shift is the Diffusers scheduler's 3.0 (Wan 2.2's own sampler
uses 12.0 for T2V-A14B: set ``model.flow_shift``).
"""

from .encoder import Wan22Encoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
