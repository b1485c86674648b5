"""Wan's data encoder: WanPipeline's VAE normalisation and UMT5 prompt embeddings."""

from __future__ import annotations

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder, mean_std_normalise, transformer_patch


class WanEncoder(FamilyEncoder):
    """latents ``(z - mean) / std`` (C, F, H, W); text ``_get_t5_prompt_embeds`` (UMT5, zero-padded to L) + the
    tokenizer's mask."""

    name = "wan"
    default_text_tokens = 512  # WanPipeline.__call__(max_sequence_length=512)
    default_geometry = Geometry("wan", "video", 16, 4, 1)
    latent_strides = (16, 4, 8)

    def _geometry(self, vae_config, tr_config):
        patch = transformer_patch(tr_config, "patch_size", (1, 2, 2))
        spatial = vae_config.get("scale_factor_spatial", 8)
        temporal = vae_config.get("scale_factor_temporal", 4) * patch[0]
        return spatial * max(patch[1], patch[2]), temporal, 1

    def encode_text(self, caption, max_tokens):
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        embeds = self.pipe._get_t5_prompt_embeds(prompt=[caption], max_sequence_length=max_tokens, device=self.device)
        mask = self._t5_mask(self.pipe.tokenizer, prompt_clean(caption), max_tokens)
        return {"prompt_embeds": embeds[0], "prompt_mask": mask}

    def encode_media(self, pixels, generator, mode, fps):
        # WanVideoToVideoPipeline.prepare_latents / decode: (z - mean) * (1 / std), per channel
        z = self._vae_encode(pixels.unsqueeze(0), generator, mode)
        cfg = self.pipe.vae.config
        return {"latents": mean_std_normalise(z, cfg.latents_mean, cfg.latents_std)[0]}
