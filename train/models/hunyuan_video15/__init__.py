"""HunyuanVideo 1.5 text-to-video (HunyuanVideo15Transformer3DModel / HunyuanVideo15Pipeline). diffusers ships no CP
plan for it: cp_plans/hunyuan_video15.yaml.

Cache: ``latents`` (C, F, H, W) as HunyuanVideo15Pipeline scales them (``z * scaling_factor`` of
AutoencoderKLHunyuanVideo15: the pipeline decodes ``latents / scaling_factor``); ``prompt_embeds`` (1000, 3584)
Qwen2.5-VL states (``hidden_states[-3]``) of the chat template with its first 108 tokens cropped and ``prompt_mask``
(1000,) bool; ``byt5_embeds`` (256, 1472) ByT5 states of the caption's quoted glyph text and ``byt5_mask`` (256,)
(all zero when nothing is quoted), all as ``encode_prompt`` returns them.

Forward kwargs, as HunyuanVideo15Pipeline's denoising loop (text-to-video): ``hidden_states`` = the latents with the
pipeline's zero conditioning latents and zero mask channel appended (C + C + 1 = in_channels), ``image_embeds`` =
zeros (B, 729, image_embed_dim), ``timestep = sigma * 1000``, the two text states with their masks in the latents'
dtype. Sigmas: the scheduler's static shift (5.0, the 480p setting).

Context parallelism: forward() packs [valid image | valid ByT5 | valid Qwen | padding] per sample, and its processor
turns that (B, S_text) mask into a (B, 1, S, S) query x key mask from the LOCAL sequence length, which Ulysses can't
assemble. The plan swaps in :class:`attention.HunyuanVideo15KeyMaskAttnProcessor` (key mask (B, 1, 1, S)) before CP
attaches: the same video output and gradients (a padded token's own state never reaches the video tokens), and a mask
that splits along the keys, so padded masks train exactly under CP at any batch size. The token refiner
(``context_embedder``) attends over the whole, replicated Qwen text on every rank before the split. The image embedder
and the refiner's key bias get exactly-zero gradients (:func:`unused_params`).

Not covered: image-to-video (HunyuanVideo15ImageToVideoPipeline: SigLIP image states and conditioning latents), the
meanflow-distilled checkpoints, the super-resolution stage.
"""

from .encoder import HunyuanVideo15Encoder as Encoder
from .spec import SPEC, unused_params
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny", "unused_params"]
