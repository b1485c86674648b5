"""HunyuanImage 2.1's data encoder: latents times the 32x VAE's scaling factor, the pipeline's own `encode_prompt`
(Qwen2.5-VL states of its prompt template after the template's 34 tokens are dropped, with their mask; ByT5 states of
the caption's quoted glyph text, with their mask: zeros when the caption quotes nothing)."""

from __future__ import annotations

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder
from train.models.hunyuan_video15.encoder import HunyuanVideo15Encoder


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

    # encode_prompt returns the same four tensors as HunyuanVideo 1.5's (Qwen text and mask, ByT5 glyphs and mask)
    encode_text = HunyuanVideo15Encoder.encode_text

    def encode_media(self, pixels, generator, mode, fps):
        # HunyuanImagePipeline decodes `latents / vae.config.scaling_factor` (no shift)
        z = self._vae_encode(pixels[:, 0].unsqueeze(0), generator, mode)
        return {"latents": (z * self.pipe.vae.config.scaling_factor)[0]}
