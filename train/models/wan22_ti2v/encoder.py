"""Wan 2.2 TI2V-5B's data encoder: Wan's (Wan 2.2 VAE, 48 channels, x16 spatial), with latent frame 0 replaced by the
image latent WanImageToVideoPipeline conditions on."""

from __future__ import annotations

import torch

from train.data.media import Geometry
from train.models.wan.encoder import WanEncoder
from train.models.wan_i2v.encoder import skip_missing_ftfy


class WanTI2VEncoder(WanEncoder):
    """latents ``(z - mean) / std`` of the clip, whose frame 0 is ``prepare_latents``' condition: the posterior mode
    of the first frame encoded alone (what the pipeline keeps clean at inference)."""

    name = "wan22_ti2v"
    validation_image = "required"  # the pipeline's `image`: its conditioning input (train/validation.py)
    default_geometry = Geometry("wan22_ti2v", "video", 32, 4, 1)
    latent_strides = (48, 4, 16)

    def load(self, pretrained_path, **kwargs):
        super().load(pretrained_path, **kwargs)
        skip_missing_ftfy(self.pipe)
        if not self.pipe.config.expand_timesteps:
            raise ValueError(f"{pretrained_path}: wan22_ti2v needs a pipeline with expand_timesteps=True (TI2V-5B)")

    def encode_media(self, pixels, generator, mode, fps):
        out = super().encode_media(pixels, generator, mode, fps)
        pipe, (_, frames, height, width) = self.pipe, pixels.shape
        first = pixels[:, 0].unsqueeze(0).to(self.device)  # (1, 3, H, W) in [-1, 1], as video_processor.preprocess
        placeholder = torch.zeros(1, *out["latents"].shape, device=self.device)  # prepare_latents returns it as is
        _, condition, _ = pipe.prepare_latents(
            first, 1, pipe.vae.config.z_dim, height, width, frames, torch.float32, self.device, None, placeholder
        )
        out["latents"][:, 0] = condition[0, :, 0]
        return out
