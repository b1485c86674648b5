"""HunyuanVideo's data encoder: latents times the VAE's scaling factor, the pipeline's own `encode_prompt` (Llama states
of the prompt template, its crop and mask; CLIP's pooled output)."""

from __future__ import annotations

from typing import Any

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder


def prompt_template(tokenizer: Any) -> dict[str, Any]:
    """HunyuanVideoPipeline's DEFAULT_PROMPT_TEMPLATE with ``crop_start`` counted with ``tokenizer``: the tokens of the
    template before the prompt (``<|begin_of_text|>`` included), which ``_get_llama_prompt_embeds`` drops. Its own
    fallback for a template without ``crop_start`` counts the whole template minus 2 (the ``{}`` placeholder and the
    closing ``<|eot_id|>``), the same number, but pads to the tokenizer's maximum length first. With Llama 3's
    tokenizer this is the template's hard-coded 95, counted from its pre-tokenizer's splits (each word one token, a
    digit apart from the space before it: 1 BOS + 4 for the system header + 85 for the instructions + 5 for
    ``<|eot_id|><|start_header_id|>user<|end_header_id|>\\n\\n``; no Llama 3 tokenizer was at hand to run it). A
    tiny tokenizer gets its own count, so the cache is what the pipeline computes with that tokenizer."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    template = DEFAULT_PROMPT_TEMPLATE["template"]
    prefix = template[: template.index("{}")]
    return {"template": template, "crop_start": len(tokenizer(prefix)["input_ids"])}


class HunyuanVideoEncoder(FamilyEncoder):
    """latents ``z * scaling_factor`` (C, F, H, W); text: ``encode_prompt``'s Llama states (L, D) after the template
    crop, their 0/1 mask (L,) and CLIP's pooled embedding (D2,)."""

    name = "hunyuan_video"
    default_text_tokens = 256  # HunyuanVideoPipeline.__call__(max_sequence_length=256)
    default_geometry = Geometry("hunyuan_video", "video", 16, 4, 1)
    latent_strides = (16, 4, 8)

    def _geometry(self, vae_config, tr_config):
        # check_inputs: height and width multiples of 16 (x8 VAE, 2x2 patches); frames 4k + 1
        ratios = vae_config.get("spatial_compression_ratio", 8), vae_config.get("temporal_compression_ratio", 4)
        return self._patched_geometry(*ratios, tr_config)

    def encode_text(self, caption, max_tokens):
        embeds, pooled, mask = self.pipe.encode_prompt(
            prompt=[caption],
            prompt_template=prompt_template(self.pipe.tokenizer),
            device=self.device,
            max_sequence_length=max_tokens,
        )
        return {"prompt_embeds": embeds[0], "prompt_mask": mask[0].bool(), "pooled_embeds": pooled[0]}

    def encode_media(self, pixels, generator, mode, fps):
        # HunyuanVideoPipeline decodes `latents / vae.config.scaling_factor` (no shift)
        z = self._vae_encode(pixels.unsqueeze(0), generator, mode)
        return {"latents": (z * self.pipe.vae.config.scaling_factor)[0]}
