"""Z-Image (ZImageTransformer2DModel / ZImagePipeline): Tongyi-MAI/Z-Image and its distilled Z-Image-Turbo, one
single-stream transformer over [image | caption] with Qwen3 caption features.

Cache: ``latents`` (C, H, W) as ZImagePipeline normalises them (FLUX.1's VAE: ``(z - shift_factor) *
scaling_factor``, 16 channels, H and W even); ``prompt_embeds`` (L, 2560) and ``prompt_mask`` (L,): the tensors of
``ZImagePipeline._encode_prompt`` (Qwen3 on the chat-templated prompt, ``hidden_states[-2]``, each prompt's padding
dropped: ``prompt_embeds[i][prompt_masks[i]]``), its k kept rows first, zeros after them, and a mask that is true on
the first k positions (the cache holds one length L; the pipeline's per-prompt tensor is
``prompt_embeds[prompt_mask]``).

Forward kwargs, as ZImagePipeline's denoising loop passes them (minus CFG): ``x`` a list of per-sample (C, 1, H, W)
latents (``latents.unsqueeze(2).unbind(0)``), ``t = (1000 - timestep) / 1000 = 1 - sigma`` (1 = clean), ``cap_feats``
a list of per-sample (k_i, 2560) caption features of different lengths. The model returns a list of (C, 1, H, W)
tensors, which the pipeline stacks, squeezes and NEGATES before its scheduler step: the model predicts
``x0 - noise`` (``velocity_sign = -1``). The transformer pads the image tokens and each caption to a multiple of 32,
builds one unified sequence per sample and pads the batch to its longest (its key mask); under CP the plan splits that
sequence at ``layers.0`` (cp_plans/zimage.yaml).

Not covered: CFG (the negative prompt's batch half), img2img / inpainting / controlnet / Omni (SigLIP) inputs.
"""

from .encoder import ZImageEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
