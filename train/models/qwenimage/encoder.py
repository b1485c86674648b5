"""Qwen-Image's data encoder: ``(z - mean) / std`` latents on the (C, 1, H, W) layout, Qwen2.5-VL `encode_prompt`."""

from __future__ import annotations

import torch

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder, mean_std_normalise


class QwenImageEncoder(FamilyEncoder):
    name = "qwenimage"
    default_text_tokens = 512  # QwenImagePipeline.__call__(max_sequence_length=512)
    default_geometry = Geometry("qwenimage", "image", 16)
    latent_strides = (16, 1, 8)

    def latent_shapes(self, frames, height, width, fps):
        return {"latents": (16, 1, height // 8, width // 8)}  # Qwen-Image's VAE keeps a frame axis of 1

    def _geometry(self, vae_config, tr_config):
        # QwenImagePipeline: vae_scale_factor = 2 ** len(temperal_downsample); check_inputs wants multiples of x2
        return 2 ** len(vae_config.get("temperal_downsample", (False, True, True))) * 2, 1, 0

    def encode_text(self, caption, max_tokens):
        embeds, mask = self.pipe.encode_prompt(prompt=[caption], device=self.device, max_sequence_length=max_tokens)
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
        return {"prompt_embeds": embeds[0], "prompt_mask": mask[0].cpu()}

    def encode_media(self, pixels, generator, mode, fps):
        # QwenImageImg2ImgPipeline._encode_vae_image: (z - mean) * (1 / std) on the (B, C, 1, H, W) layout
        cfg = self.pipe.vae.config
        z = self._vae_encode(pixels[:, :1].unsqueeze(0), generator, mode)
        return {"latents": mean_std_normalise(z, cfg.latents_mean, cfg.latents_std)[0]}
