"""Qwen-Image-Edit (QwenImageTransformer2DModel / QwenImageEditPipeline): Qwen-Image with the input image's latents
in the sequence and the prompt encoded together with the image.

Cache: ``latents`` (C, 1, H, W) the edited (target) image, as Qwen-Image's; ``reference_latents`` (C, 1, H', W') the
input image as ``QwenImageEditPipeline.__call__`` prepares it: resized to ``calculate_dimensions(1024 * 1024, aspect)``
(about 1 MP, sides multiples of 32, whatever the target size), VAE posterior mode (``_encode_vae_image``: argmax, not
sampled), ``(z - latents_mean) / latents_std``; ``prompt_embeds`` (L, 3584) with ``prompt_mask`` (L,) from
``encode_prompt(prompt, image=<the resized input image>)``: the edit template with the image's Qwen2.5-VL vision tokens
(its processor sizes the image; no max_sequence_length: data.max_text_tokens does not truncate). The empty caption
(caption dropout) is encoded with a mid-gray 1024 x 1024 input image (the template needs one; the cache has one empty
prompt for all items). Reference images come from ``data.reference_column``; an item without a
readable one is bad (``no_reference`` / ``bad_reference``).

Forward kwargs, as the edit pipeline's denoising loop: ``hidden_states = cat([target packed 2x2, reference packed
2x2], dim=1)``, ``img_shapes = [[(1, H/2, W/2), (1, H'/2, W'/2)]] * B`` (the RoPE covers both images), the text mask as
Qwen-Image's, ``timestep = sigma`` (the reference tokens share it), no guidance (``guidance_embeds`` false). The output
is cut to the first ``H/2 * W/2`` tokens (``noise_pred[:, :latents.size(1)]``): the loss covers the target only. The
dynamic shift's ``image_seq_len`` is the target's token count, as in the pipeline. A batch needs one reference size
(``img_shapes`` is read from the first sample): mix reference aspect ratios only with batch_size 1.

Under CP the Qwen-Image plan (cp_plans/qwenimage.yaml) shards the concatenated sequence and the RoPE table built for
both images alike, and gathers the whole sequence before the cut.

Not covered: Qwen-Image-Edit-2509/2511 (several input images, ``zero_cond_t``): family ``qwenimage_edit_plus``.
"""

from train.models.qwenimage import unused_params  # the same transformer: the same never-used parameters

from .encoder import QwenImageEditEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny", "unused_params"]
