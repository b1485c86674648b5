"""HunyuanVideo 1.5's data encoder: latents times the VAE's scaling factor, the pipeline's own `encode_prompt`
(Qwen2.5-VL states of the chat template after its crop, with their mask; ByT5 states of the quoted glyph text, with
their mask: zeros when the caption quotes nothing)."""

from __future__ import annotations

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder


class HunyuanVideo15Encoder(FamilyEncoder):
    """latents ``z * scaling_factor`` (C, F, H, W); text: ``encode_prompt``'s Qwen2.5-VL states (L, D) and 0/1 mask
    (L,), its ByT5 glyph states (256, D2) and mask (256,)."""

    name = "hunyuan_video15"
    default_text_tokens = 1000  # HunyuanVideo15Pipeline.tokenizer_max_length
    default_geometry = Geometry("hunyuan_video15", "video", 16, 4, 1)
    latent_strides = (32, 4, 16)

    def _geometry(self, vae_config, tr_config):
        # the video processor's vae_scale_factor (x16 VAE, 1x1 patches); frames 4k + 1
        ratios = vae_config.get("spatial_compression_ratio", 16), vae_config.get("temporal_compression_ratio", 4)
        return self._patched_geometry(*ratios, tr_config)

    def encode_text(self, caption, max_tokens):
        pipe = self.pipe
        pipe.tokenizer_max_length = max_tokens  # encode_prompt pads (and truncates) the Qwen text to this length
        embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(prompt=[caption], device=self.device)
        return {
            "prompt_embeds": embeds[0],
            "prompt_mask": mask[0].bool(),
            "byt5_embeds": embeds_2[0],
            "byt5_mask": mask_2[0].bool(),
        }

    def encode_media(self, pixels, generator, mode, fps):
        # HunyuanVideo15Pipeline decodes `latents / vae.config.scaling_factor` (no shift)
        z = self._vae_encode(pixels.unsqueeze(0), generator, mode)
        return {"latents": (z * self.pipe.vae.config.scaling_factor)[0]}
