"""Krea 2 (Krea2Transformer2DModel / Krea2Pipeline), text-to-image: one single-stream transformer over a joint
[text | image] sequence, its text a stack of tapped Qwen3-VL layers fused inside the transformer.

Cache: ``latents`` (C, 1, H, W) as Krea2Pipeline decodes them (``(z - latents_mean) / latents_std`` of
AutoencoderKLQwenImage: 16 channels, x8, a frame axis of 1); ``prompt_embeds`` (L, num_text_layers, D) with
``prompt_mask`` (L,) bool: ``encode_prompt`` of the caption alone, L = ``max_sequence_length`` (data.max_text_tokens,
default the pipeline's 512), a fixed-length block ``[caption | PAD | assistant suffix]`` (the 34 system-prefix tokens
dropped; the suffix sits after the padding with positions that skip it), the hidden states of the pipeline's
``text_encoder_select_layers`` (the real ones: 12 of Qwen3-VL-4B's 36 layers, width 2560) stacked per token; the mask is
False on the padding in the middle of the block.

Forward kwargs, as Krea2Pipeline's denoising loop: ``hidden_states`` (B, H/2 * W/2, 4C) (``_pack_latents``, patch 2),
``encoder_hidden_states`` the cached stack, ``timestep = sigma`` (the pipeline's ``t / 1000``), ``position_ids``
(L + H/2 * W/2, 3) (``prepare_position_ids``: text at the origin, image tokens at (0, h, w)) and
``encoder_attention_mask`` the cached bool mask. The transformer builds the joint sequence and its (B, 1, 1, L + S)
key mask inline and returns the image tokens only. Under CP the plan splits the joint sequence at the first block, its
RoPE tables and key mask like it, runs the text fusion on every rank and the output layer after the gather
(cp_plans/krea2.yaml, ``replicated_tail``).

Not covered: Krea 2 Turbo's fixed ``mu = 1.15`` (``is_distilled``: an inference schedule of the distilled checkpoint;
LoRAs train on the Raw base and apply to Turbo), CFG (``guidance_scale`` with a negative prompt), LoRAs in Krea's own
key names (diffusers' keys only), and editing: diffusers 0.42.1 has no Krea 2 edit pipeline and the transformer takes
no reference image, so there is no diffusers oracle to build one against.
"""

from .encoder import Krea2Encoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
