"""Wan 2.2 A14B's data encoder: Wan 2.1's (the same VAE, UMT5 and WanPipeline helpers)."""

from __future__ import annotations

from train.data.media import Geometry
from train.models.wan.encoder import WanEncoder


class Wan22Encoder(WanEncoder):
    name = "wan22"
    default_geometry = Geometry("wan22", "video", 16, 4, 1)
