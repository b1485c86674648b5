"""Wan 2.1 image-to-video's data encoder: Wan's, plus WanImageToVideoPipeline's condition latents and CLIP image
embeddings of the clip's first frame (ChronoEdit's encoder is this one)."""

from __future__ import annotations

import sys

import torch

from train.data.media import Geometry
from train.models.wan.encoder import WanEncoder


def skip_missing_ftfy(pipe) -> None:
    """diffusers 0.42.1's Wan I2V / ChronoEdit ``prompt_clean`` calls ``ftfy.fix_text`` even when ftfy is not
    installed (NameError); WanPipeline's skips the call then. Without ftfy, give the pipeline's module the same skip."""
    from diffusers.utils import is_ftfy_available

    module = sys.modules[type(pipe).__module__]
    if not is_ftfy_available() and not hasattr(module, "ftfy"):
        module.ftfy = type("_NoFtfy", (), {"fix_text": staticmethod(lambda text: text)})


class WanI2VEncoder(WanEncoder):
    """Frame 0 of the clip is the input image; ``prepare_latents`` / ``encode_image`` of the pipeline give the
    condition latents and image embeddings. Text as Wan's with L fixed to 512 (the Wan I2V processors take the
    tokens past 512 as image context)."""

    name = "wan_i2v"
    validation_image = "required"  # the pipeline's `image`: its conditioning input (train/validation.py)
    fixed_text_tokens = 512
    image_embeds = True  # Wan 2.1's CLIP image embeddings (`encode_image`); Wan 2.2 A14B has no image encoder
    default_geometry = Geometry("wan_i2v", "video", 16, 4, 1)

    def load(self, pretrained_path, **kwargs):
        super().load(pretrained_path, **kwargs)
        skip_missing_ftfy(self.pipe)

    def encode_media(self, pixels, generator, mode, fps):
        from PIL import Image

        out = super().encode_media(pixels, generator, mode, fps)
        pipe, (_, frames, height, width) = self.pipe, pixels.shape
        first = pixels[:, 0].unsqueeze(0).to(self.device)  # (1, 3, H, W) in [-1, 1], as video_processor.preprocess
        placeholder = torch.zeros(1, *out["latents"].shape, device=self.device)  # prepare_latents returns it as is
        _, condition = pipe.prepare_latents(
            first, 1, pipe.vae.config.z_dim, height, width, frames, torch.float32, self.device, None, placeholder
        )
        mask_channels = pipe.vae_scale_factor_temporal
        out["condition_latents"] = condition[0, mask_channels:]
        if self.image_embeds:
            pixels8 = ((first[0].permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).byte().cpu().numpy()
            out["image_embeds"] = pipe.encode_image(Image.fromarray(pixels8), self.device)[0]
        return out
