"""HunyuanImage 2.1's data encoder: latents times the 32x VAE's scaling factor, the pipeline's own `encode_prompt`
(Qwen2.5-VL states of its prompt template after the template's 34 tokens are dropped, with their mask; ByT5 states of
the caption's quoted glyph text, with their mask: zeros when the caption quotes nothing)."""

from __future__ import annotations

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder


class HunyuanImageEncoder(FamilyEncoder):
    """latents ``z * scaling_factor`` (C, H, W); text: ``encode_prompt``'s Qwen2.5-VL states (L, D) and mask (L,),
    its ByT5 glyph states (128, D2) and mask (128,)."""

    name = "hunyuanimage"
    default_text_tokens = 1000  # HunyuanImagePipeline.tokenizer_max_length
    default_geometry = Geometry("hunyuanimage", "image", 32)
    latent_strides = (64, 1, 32)

    def _geometry(self, vae_config, tr_config):
        # prepare_latents: H // vae_scale_factor (the VAE's spatial_compression_ratio) latent rows, then the patch
        patch_h, _ = self.spec.patch.of(tr_config)
        return vae_config["spatial_compression_ratio"] * patch_h, 1, 0

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
        # HunyuanImagePipeline decodes `latents / vae.config.scaling_factor` (no shift)
        z = self._vae_encode(pixels[:, 0].unsqueeze(0), generator, mode)
        return {"latents": (z * self.pipe.vae.config.scaling_factor)[0]}
