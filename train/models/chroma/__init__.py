"""Chroma (ChromaTransformer2DModel / ChromaPipeline): lodestones/Chroma1-HD, FLUX.1's layout with T5 text only.

Cache: ``latents`` (C, H, W) as ChromaPipeline normalises them (FLUX.1's VAE: ``(z - shift_factor) * scaling_factor``,
16 channels, H and W even); ``prompt_embeds`` (L, 4096) T5 states of ``_get_t5_prompt_embeds`` (the encoder run WITH
the tokenizer's mask, unlike FLUX.1), padded to L = 512; ``prompt_mask`` (L,) the tokenizer's mask.

Forward kwargs, as ChromaPipeline's denoising loop passes them (minus CFG): ``hidden_states`` packed 2x2
(``_pack_latents``), ``img_ids`` (``_prepare_latent_image_ids``), ``txt_ids`` (zeros), ``timestep = sigma``
(``t / 1000``) and ``attention_mask`` (B, L + S) = ``_prepare_attention_mask``: the text mask of
``_get_t5_prompt_embeds``, 1 up to and including the first padding token, in the text's dtype, then ones for the S
image tokens. Its blocks take the outer product (B, 1, L + S, L + S) over the joint [text | image] sequence. The text
part is float 0/1, so SDPA ADDS it to the scores: pairs of kept tokens get +1, the others 0 (diffusers 0.42.1's
pipeline; a soft mask, trained as the pipeline computes it). Under CP the plan's ``joint_key_mask`` puts its rows and
columns in the order the ranks hold the tokens.

Not covered: img2img / inpainting inputs, IP-Adapter image embeddings. diffusers' own gradient checkpointing of the
single-stream blocks drops the mask (``_gradient_checkpointing_func(block, hidden_states, temb, image_rotary_emb)``):
the trainer checkpoints per block (train/parallel.py), which keeps it.
"""

from .encoder import ChromaEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
