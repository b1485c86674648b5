"""Wan 2.2 I2V A14B's data encoder: Wan 2.1 I2V's condition latents, no CLIP image embeddings, Wan's text length."""

from __future__ import annotations

from train.data.media import Geometry
from train.models.wan_i2v.encoder import WanI2VEncoder


class Wan22I2VEncoder(WanI2VEncoder):
    name = "wan22_i2v"
    fixed_text_tokens = None  # no image context after the text: any length, as Wan's (512 by default)
    image_embeds = False  # no image encoder in the pipeline
    default_geometry = Geometry("wan22_i2v", "video", 16, 4, 1)
