"""HunyuanImage 2.1 text-to-image (HunyuanImageTransformer2DModel / HunyuanImagePipeline):
hunyuanvideo-community/HunyuanImage-2.1-Diffusers, the base (non-distilled) model diffusion-pipe trains LoRAs on.

Cache: ``latents`` (C, H, W) as HunyuanImagePipeline scales them (``z * scaling_factor`` of the x32
AutoencoderKLHunyuanImage, 64 channels: the pipeline decodes ``latents / scaling_factor``); ``prompt_embeds`` (1000,
3584) Qwen2.5-VL states (``hidden_states[-3]``) of the prompt template with its first 34 tokens dropped
(``prompt_template_encode_start_idx``: the template's system message and user header, as Qwen2.5-VL's tokenizer counts
them) and ``prompt_mask`` (1000,) the tokenizer's mask after the same drop; ``byt5_embeds`` (128, 1472) ByT5 states of
the caption's quoted glyph text (``extract_glyph_text``: '...', "...", ‘...’, “...” joined as ``Text "...". ``) and
``byt5_mask`` (128,) (both all zero when nothing is quoted), all as ``encode_prompt`` returns them.

Forward kwargs, as HunyuanImagePipeline's denoising loop passes them for the conditional prediction:
``hidden_states`` = the latents unchanged (patchified 1x1 inside), ``timestep = sigma * 1000`` in the latents' dtype,
the two text states with their masks as the tokenizers' int64 masks, no ``guidance`` and no ``timestep_r`` (the base
model has no guidance embedding and no meanflow). The transformer's prediction is unpatchified inside. Sigmas: the
scheduler's static shift 5.0 (see ``spec.SCHEDULER_CONFIG``). The pipeline's guider (CFG 3.5 with adaptive projected
guidance from step 5) runs the same forward with the empty negative prompt: sampling, not training.

Context parallelism: forward() refines the Qwen text (``context_embedder``, a token refiner whose self-attention covers
the whole text) and projects the ByT5 text, both on every rank before the split, then packs [valid ByT5 | valid Qwen
| padding] per sample and builds one [image | text] key mask over the whole sequence; the plan
(cp_plans/hunyuanimage.yaml) splits the image tokens and the packed text and declares the mask's two segments
(``joint_key_mask``), so padded prompts of different lengths train exactly under CP. The refiner's key bias has an
exactly-zero gradient (:func:`unused_params`).

Not covered: the distilled checkpoint (guidance embedding and meanflow's ``timestep_r``, the next step of an inference
schedule, which flow-matching training has no value for; refused by ``build_inputs``), the refiner model
(HunyuanImageRefinerPipeline: its own x16 VAE and 3-D latents), prompt rewriting (the official PromptEnhancer).
"""

from .encoder import HunyuanImageEncoder as Encoder
from .spec import SPEC, unused_params
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny", "unused_params"]
