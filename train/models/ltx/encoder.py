"""LTX-Video's data encoder: `_normalize_latents` with the VAE's statistics, T5 prompt embeddings + mask, the clip's
frame rate."""

from __future__ import annotations

import torch

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder

from .spec import FRAME_RATE


class LTXEncoder(FamilyEncoder):
    name = "ltx"
    default_text_tokens = 128  # LTXPipeline.__call__(max_sequence_length=128)
    default_geometry = Geometry("ltx", "video", 32, 8, 1)
    latent_strides = (128, 8, 32)

    def _geometry(self, vae_config, tr_config):
        scaling = vae_config.get("spatio_temporal_scaling", (True, True, True, False))
        spatial = vae_config.get("spatial_compression_ratio") or vae_config.get("patch_size", 4) * 2 ** sum(scaling)
        temporal = vae_config.get("temporal_compression_ratio") or vae_config.get("patch_size_t", 1) * 2 ** sum(scaling)
        return self._patched_geometry(spatial, temporal, tr_config)

    def encode_text(self, caption, max_tokens):
        embeds, mask = self.pipe._get_t5_prompt_embeds(
            prompt=[caption], max_sequence_length=max_tokens, device=self.device
        )
        return {"prompt_embeds": embeds[0], "prompt_mask": mask[0].bool()}

    def encode_media(self, pixels, generator, mode, fps):
        vae = self.pipe.vae
        z = self._vae_encode(pixels.unsqueeze(0), generator, mode)
        z = self.pipe._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        rate = fps if fps and pixels.shape[1] > 1 else FRAME_RATE
        return {"latents": z[0], "frame_rate": torch.tensor(float(rate))}
