"""ChronoEdit's data encoder: Wan's, plus the condition latents and CLIP image embeddings of the input image."""

from __future__ import annotations

import torch

from train.data.media import Geometry
from train.models.wan.encoder import WanEncoder


class ChronoEditEncoder(WanEncoder):
    """Wan I2V-style editing: frame 0 of the clip is the input image, the rest is what the model learns to produce.
    Text as Wan's with L fixed to 512 (the Wan I2V processors need it)."""

    name = "chronoedit"
    fixed_text_tokens = 512
    default_geometry = Geometry("chronoedit", "video", 16, 4, 1)

    def load(self, pretrained_path, **kwargs):
        # diffusers 0.42.1's ChronoEdit prompt_clean calls ftfy.fix_text even when ftfy is not installed (NameError);
        # WanPipeline skips the call then. Without ftfy, give the module the same skip (identity fix_text).
        from diffusers.pipelines.chronoedit import pipeline_chronoedit
        from diffusers.utils import is_ftfy_available

        if not is_ftfy_available() and not hasattr(pipeline_chronoedit, "ftfy"):
            pipeline_chronoedit.ftfy = type("_NoFtfy", (), {"fix_text": staticmethod(lambda text: text)})
        super().load(pretrained_path, **kwargs)

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
        image = Image.fromarray(((first[0].permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).byte().cpu().numpy())
        out["condition_latents"] = condition[0, mask_channels:]
        out["image_embeds"] = pipe.encode_image(image, self.device)[0]
        return out
