"""Kandinsky 5.0 T2V (Kandinsky5Transformer3DModel / Kandinsky5T2VPipeline): kandinskylab/Kandinsky-5.0-T2V-Lite
(2B; its sft / pretrain / nocfg / distilled16steps 5 s checkpoints share one architecture). Trained by FastVideo and
musubi-tuner.

Cache: ``latents`` (C, F, H, W) as Kandinsky5T2VPipeline scales them (``z * scaling_factor`` of
AutoencoderKLHunyuanVideo: the pipeline decodes ``latents / scaling_factor``; it holds them channels-last, the spec
permutes); ``prompt_embeds``
(L, 3584) the Qwen2.5-VL states of ``encode_prompt`` (``prompt_clean``, the pipeline's prompt template,
``hidden_states[-1]`` with the template's first ``prompt_template_encode_start_idx`` = 128 tokens cropped, at most
``max_sequence_length`` = 512 after the crop), unpadded: one prompt spans its ``cu_seqlens`` whole; ``prompt_mask``
(L,) all true; ``pooled_embeds`` (768,) CLIP's ``pooler_output`` (77 tokens, max-length padded).

Forward kwargs, as Kandinsky5T2VPipeline's denoising loop (minus CFG): ``hidden_states`` (B, F, H, W, C) channels-last,
with ``visual_cond`` (the Lite checkpoints) the zero condition and zero mask ``prepare_latents`` appends for
text-to-video (2C + 1 channels); ``encoder_hidden_states`` the unpadded text; ``pooled_projections``; ``timestep =
sigma * 1000`` in the latents' dtype; ``visual_rope_pos`` (arange of the latent frames, rows // 2, columns // 2);
``text_rope_pos = arange(L)``; ``scale_factor`` = the pipeline's ``_get_scale_factor`` of the clip's pixel size
((1, 2, 2) for sides in [480, 854], else (1, 3.16, 3.16)); ``sparse_params=None``. Sigmas: a static shift 5.0 (see
spec.SCHEDULER_CONFIG). The transformer returns channels-last velocity ``noise - x0``.

Text: the transformer takes no text mask, so the pipeline's single-prompt text is unpadded and every sample of a batch
needs the same text length (``shared_text_length``: refused at startup otherwise; batch 1 with grad_accum, as
MiniMax-H3). The pipeline itself pads a batch of prompts to the longest and attends to the padding: not reproduced.

Attention: the family trains with :class:`attention.Float32RopeProcessor` (``SPEC.prepare_transformer``, applied
wherever the transformer is built or loaded for training: the trainer, the serial oracle, the tiny builders), the stock
processor without its bfloat16 rounding of the rotated queries and keys. In bfloat16 both compute the same, bit for
bit, so a LoRA trained in bf16 behaves in the stock pipeline as in training; in float32 the stock rounding would put
every gradient through bfloat16 and CP could not match the serial run (attention.py). Validation samples run the
training transformer, so they use it too; the diffusers pipeline a user loads keeps its stock processor.

Context parallelism: cp_plans/kandinsky5.yaml splits the visual tokens at the first visual block and gathers them
after the last; the output layer runs on the whole sequence on every rank (``replicated_tail``); the text blocks
attend locally over the whole text.

Not covered: NABLA sparse attention (the 10 s checkpoints' ``attention_type: nabla``: ``sparse_params`` is None, dense
attention, for training; the processor still applies NABLA when a pipeline passes it), image-to-video
(Kandinsky5I2VPipeline: the ``kandinsky5_i2v`` family, which reuses this one), text-to-image, the Pro (19B)
checkpoints (the same class: set model.pretrained_path; no shipped config), CFG and negative prompts in training.
"""

from .encoder import Kandinsky5Encoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
