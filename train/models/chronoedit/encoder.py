"""ChronoEdit's data encoder: Wan 2.1 image-to-video's (condition latents and CLIP image embeddings of the input
image), with ChronoEditPipeline."""

from __future__ import annotations

from train.data.media import Geometry
from train.models.wan_i2v.encoder import WanI2VEncoder


class ChronoEditEncoder(WanI2VEncoder):
    """Wan I2V-style editing: frame 0 of the clip is the input image, the rest is what the model learns to produce.
    ``ChronoEditPipeline.prepare_latents`` / ``encode_image`` are Wan I2V's (text fixed to 512 tokens likewise)."""

    name = "chronoedit"
    default_geometry = Geometry("chronoedit", "video", 16, 4, 1)
