"""Qwen-Image-Edit-Plus (Qwen-Image-Edit-2509 and -2511: QwenImageTransformer2DModel / QwenImageEditPlusPipeline):
Qwen-Image with 1-3 control images' latents in the sequence and the prompt encoded together with all of them.

Cache: ``latents`` (C, 1, H, W) the edited (target) image, as Qwen-Image's; ``reference_latents``,
``reference_latents_2``, ``reference_latents_3`` (C, 1, H'_k, W'_k), the item's control images in the order of
``data.reference_column`` (a list of up to 3 columns; an item lacking one keeps the others in order, so an item of k
images has the first k keys), each as ``QwenImageEditPlusPipeline.__call__`` prepares it: resized at its own aspect
ratio to ``calculate_dimensions(VAE_IMAGE_SIZE = 1024 * 1024, aspect)`` (about 1 MP, sides multiples of 32), VAE
posterior mode (``_encode_vae_image``), ``(z - latents_mean) / latents_std``; ``prompt_embeds`` (L, 3584) with
``prompt_mask`` (L,) from ``encode_prompt(prompt, image=[the images resized to calculate_dimensions(
CONDITION_IMAGE_SIZE = 384 * 384, aspect)])``: the edit template with "Picture k: <|vision_start|><vision tokens>
<|vision_end|>" per image before the caption (no max_sequence_length: data.max_text_tokens does not truncate). The
empty caption (caption dropout) is encoded with one mid-gray 1:1 control image (the cache has one empty prompt for all
items, whatever their image count). An item with no readable control image is bad (``no_reference`` /
``bad_reference``). Each sample records its layout (``controls 128x128 96x160``: the count and latent sizes of its
images, ``batch_layout``); the trainer cuts batches per bucket and layout, so every sample of a batch, and every CP
rank of it, has one sequence layout.

Forward kwargs, as the Plus pipeline's denoising loop: ``hidden_states = cat([target packed 2x2, image 1 packed 2x2,
image 2, ...], dim=1)``, ``img_shapes = [[(1, H/2, W/2), (1, H'_1/2, W'_1/2), ...]] * B`` (one entry per image: the
RoPE covers them all), the text mask as Qwen-Image's, ``timestep = sigma`` (the image tokens share it), no guidance.
The output is cut to the first ``H/2 * W/2`` tokens (``noise_pred[:, :latents.size(1)]``): the loss covers the
target only; the dynamic shift's ``image_seq_len`` is the target's token count, as in the pipeline. ``zero_cond_t``
(Qwen-Image-Edit-2511's config) needs no other kwargs: the transformer reads it from its config and, from the same
``img_shapes``, gives the image tokens timestep 0 (its ``modulate_index``: 0 on the target's tokens, 1 on the
images'), which the Qwen-Image CP plan (cp_plans/qwenimage.yaml) shards beside the tokens at every block.

Not covered: validation samples with more than one control image (a validation prompt gives one ``image``); mixing
control counts or sizes in one batch (they are bucketed apart instead); the pipeline's own batch size is 1.
"""

from train.models.qwenimage import unused_params  # the same transformer: the same never-used parameters

from .encoder import QwenImageEditPlusEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny", "unused_params"]
