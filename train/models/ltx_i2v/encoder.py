"""LTX-Video image-to-video's data encoder: LTX's, with latent frame 0 replaced by the image latent
LTXImageToVideoPipeline conditions on."""

from __future__ import annotations

from train.data.media import Geometry
from train.models.encoder import retrieve
from train.models.ltx.encoder import LTXEncoder


class LTXImageToVideoEncoder(LTXEncoder):
    """latents as LTX's, whose frame 0 is ``prepare_latents``' ``init_latents``: the clip's first frame through the
    pipeline's ``video_processor.preprocess``, encoded alone (drawn first, with the item's generator, as
    ``prepare_latents`` draws it) and normalised with the VAE's mean/std (``_normalize_latents``, scaling 1)."""

    name = "ltx_i2v"
    validation_image = "required"  # the pipeline's `image`: its conditioning input (train/validation.py)
    default_geometry = Geometry("ltx_i2v", "video", 32, 8, 1)

    def condition_latents(self, pixels, generator, mode):
        """(1, C, 1, H', W'): the first frame of ``pixels`` (3, F, H, W) in [-1, 1], as prepare_latents encodes it."""
        pipe, (_, _, height, width) = self.pipe, pixels.shape
        first = (pixels[:, 0].unsqueeze(0) + 1) / 2  # [0, 1]: what the pipeline's processor normalises to [-1, 1]
        image = pipe.video_processor.preprocess(first, height=height, width=width).to(self.device, pipe.vae.dtype)
        z = retrieve(pipe.vae.encode(image.unsqueeze(2)), generator, mode)
        return pipe._normalize_latents(z, pipe.vae.latents_mean, pipe.vae.latents_std)

    def encode_media(self, pixels, generator, mode, fps):
        condition = self.condition_latents(pixels, generator, mode)
        out = super().encode_media(pixels, generator, mode, fps)
        out["latents"][:, 0] = condition[0, :, 0].to(out["latents"].dtype)
        return out
