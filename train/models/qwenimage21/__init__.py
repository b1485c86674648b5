"""Qwen-Image 2.1 (QwenImage21Transformer2DModel / QwenImage21Pipeline), text-to-image: one single-stream transformer
over a joint [text | image] sequence, attending block-causally (the text causal, the image block bidirectional and
over every text key), Qwen3-VL text.

Cache: ``latents`` (C, 1, H, W) as QwenImage21Pipeline normalises them (``(z - latents_mean) / latents_std`` of
AutoencoderKLQwenImage21: 64 channels, x16, a frame axis of 1; the VAE reads RGBA, and an RGB image is encoded opaque,
as the pipeline's ``convert("RGBA")`` makes it); ``prompt_embeds`` (L, 4096) with ``prompt_mask`` (L,) all true:
``encode_prompt`` of the caption alone (the text-to-image template, Qwen3-VL's last decoder layer before its final
norm, the system turn dropped), L its own length; batching right-pads them.

Forward kwargs, as QwenImage21Pipeline's denoising loop with ``use_kv_cache=False`` (every step runs the whole joint
sequence, as training does): ``hidden_states`` (B, H*W, C) (``_pack_latents``: patch size 1, a spatial flatten),
``timestep = sigma``, ``encoder_hidden_states`` the batch's text trimmed to its longest prompt (``encode_prompt`` pads
a batch to its longest prompt; padding is not neutral here, it moves the image block's rope frame position), its int64
``encoder_hidden_states_mask`` (``None`` when nothing is padded, as ``encode_prompt`` returns it), ``img_shapes =
[[(1, H, W)]] * B``, ``img_mask`` ``encode_prompt``'s image_pad_mask (no image slot in a text-to-image prompt) with one
slot per 2x2 group of target tokens appended (``append_target_slots``). The transformer returns the whole joint
sequence; the prediction is its last H*W tokens (the pipeline's ``noise_pred[:, -H*W:]``): the loss never sees the
text rows. Under CP the plan splits the joint sequence where forward() has built it (cp_plans/qwenimage21.yaml).

Not covered: image-conditioned generation and editing (condition images in the Qwen3-VL prompt and their latent blocks
before the target), CFG (``true_cfg_scale`` with a negative prompt), the pipeline's prefix KV cache (an inference
shortcut, refused under CP: validation samples run without it, ``SPEC.validation_kwargs``), Turbo's
``sample_sigmas`` (an inference schedule), the alpha channel of RGBA training images (media is decoded as RGB).
"""

from .encoder import QwenImage21Encoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
