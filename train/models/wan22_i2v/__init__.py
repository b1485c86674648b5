"""Wan 2.2 I2V A14B, two experts (WanTransformer3DModel x 2 / WanImageToVideoPipeline):
Wan-AI/Wan2.2-I2V-A14B-Diffusers. What differs from Wan 2.1 I2V (train/models/wan_i2v) and Wan 2.2 T2V A14B
(train/models/wan22), whose pieces it reuses: no CLIP image encoder (the transformers have no ``image_dim``, so the
pipeline passes no image embeddings and the text has no fixed length), two experts split at ``boundary_ratio`` 0.9.

Cache: ``latents`` (16, F, H, W) normalised with the Wan 2.1 VAE's mean/std; frame 0 of the clip is the input image.
``condition_latents`` (16, F, H, W): the normalised VAE latents (posterior mode) of ``[first frame, zeros...]`` that
``WanImageToVideoPipeline.prepare_latents`` encodes; ``prompt_embeds`` (512, 4096) UMT5 states zero-padded to 512 as
``encode_prompt`` returns them (no text mask); ``prompt_mask``.

Forward kwargs, as WanImageToVideoPipeline's denoising loop: ``hidden_states = cat([latents, mask,
condition_latents], dim=1)`` (mask: (B, 4, F, H, W), 1 on latent frame 0), ``encoder_hidden_states``, ``timestep =
sigma * 1000`` (B,), given to one expert: ``transformer`` (high noise) while the timestep is at least
``boundary_ratio * 1000``, ``transformer_2`` (low noise) below it. ``boundary_ratio`` is the pipeline's
model_index.json value, shipped as configs/Wan-AI--Wan2.2-I2V-A14B-Diffusers--model_index.json.

A run trains ONE expert (``model.subfolder``), its sigmas drawn from its side of the boundary, as wan22. A LoRA
export of a ``transformer_2`` run loads with ``pipe.load_lora_weights(dir, load_into_transformer_2=True)``.

Not covered: training both experts in one run; first-last-frame conditioning (``last_image``). Every latent frame is
noised and in the loss, frame 0 included (as Wan 2.1 I2V). The flow shift is Wan 2.2's i2v_A14B sample_shift 5.0
(the Diffusers folder's scheduler_config.json was not in the sources searched: set ``model.flow_shift`` if it
differs).
"""

from .encoder import Wan22I2VEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
