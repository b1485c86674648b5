"""HunyuanVideo text-to-video (HunyuanVideoTransformer3DModel / HunyuanVideoPipeline). diffusers ships no CP plan for
it: cp_plans/hunyuan_video.yaml.

Cache: ``latents`` (C, F, H, W) as HunyuanVideoPipeline scales them (``z * scaling_factor`` of
AutoencoderKLHunyuanVideo: the pipeline decodes ``latents / scaling_factor``); ``prompt_embeds`` (256, 4096) Llama
states of the prompt template (``hidden_states[-3]``) with the template's tokens cropped, and ``prompt_mask`` (256,)
bool, both as ``encode_prompt`` returns them (right-padded; ``crop_start`` counted with the checkpoint's tokenizer: 95
for Llama 3's, see ``encoder.prompt_template``); ``pooled_embeds`` (768,) CLIP's pooled output; optional
``guidance`` (per sample, unscaled).

Forward kwargs, as HunyuanVideoPipeline's denoising loop: ``hidden_states`` = the latents unchanged (patchified
inside), ``timestep = sigma * 1000``, ``encoder_hidden_states``, ``encoder_attention_mask`` (the 0/1 mask in the
latents' dtype), ``pooled_projections``, ``guidance = 1.0 * 1000`` (the distilled guidance embedding at
``spec.GUIDANCE_SCALE``, finetrainers' training value; the pipeline samples at ``guidance_scale=6.0``). Sigmas: the
scheduler's static shift 7.0.

Context parallelism: forward() builds one [video | text] key mask over the whole sequence from the count of kept text
tokens; the plan declares its two segments (``joint_key_mask``) and the CP core reorders its keys into the order the
ranks hold them (train/cp/masks.py), so padded prompts, prompts of different lengths in one batch and dropped captions
train exactly as the pipeline-form serial run (tests/test_cp_models.py). The token refiner (``context_embedder``)
attends over the whole text on every rank before the split. The refiner's key bias has an exactly-zero gradient
(:func:`unused_params`).

Not covered: image-to-video (HunyuanVideoImageToVideoPipeline, token_replace), FramePack. HunyuanVideo 1.5 is its own
family (``hunyuan_video15``).
"""

from .encoder import HunyuanVideoEncoder as Encoder
from .spec import SPEC, unused_params
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny", "unused_params"]
