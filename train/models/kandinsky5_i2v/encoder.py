"""Kandinsky 5 image-to-video's data encoder: Kandinsky 5 T2V's, with latent frame 0 replaced by the image latents
Kandinsky5I2VPipeline conditions on (the clip's first frame encoded alone)."""

from __future__ import annotations

from train.data.media import Geometry
from train.models.encoder import retrieve
from train.models.kandinsky5.encoder import Kandinsky5Encoder


class Kandinsky5I2VEncoder(Kandinsky5Encoder):
    """latents as T2V's (``z * scaling_factor``), whose frame 0 is ``prepare_latents``' image latents: the clip's first
    frame through the pipeline's ``video_processor.preprocess``, encoded alone as a 1-frame video and scaled. The
    HunyuanVideo VAE's GroupNorms pool over time, so the clip's own latent frame 0 depends on its later frames and is
    not what the pipeline conditions on. Text: the T2V encoding (the I2V pipeline's template and encode_prompt are
    the same)."""

    name = "kandinsky5_i2v"
    validation_image = "required"  # the pipeline's `image`: its conditioning input (train/validation.py)
    validation_min_frames = 17  # normalize_first_frame reads 5 latent frames after the first 4, else NaN
    default_geometry = Geometry("kandinsky5_i2v", "video", 16, 4, 1)

    def image_latents(self, pixels, generator, mode):
        """(1, C, 1, H', W'): the first frame of ``pixels`` (3, F, H, W) in [-1, 1], as prepare_latents encodes it."""
        pipe, (_, _, height, width) = self.pipe, pixels.shape
        first = (pixels[:, 0].unsqueeze(0) + 1) / 2  # [0, 1]: what the pipeline's processor normalises to [-1, 1]
        image = pipe.video_processor.preprocess(first, height=height, width=width).to(self.device, pipe.vae.dtype)
        z = retrieve(pipe.vae.encode(image.unsqueeze(2)), generator, mode)  # the pipeline samples: mode="sample"
        return z * pipe.vae.config.scaling_factor

    def encode_media(self, pixels, generator, mode, fps):
        image = self.image_latents(pixels, generator, mode)  # drawn first, with the item's generator
        out = super().encode_media(pixels, generator, mode, fps)
        out["latents"][:, 0] = image[0, :, 0].to(out["latents"].dtype)
        return out
