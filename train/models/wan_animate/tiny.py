"""Wan Animate's tiny WanAnimatePipeline (Wan 2.1 I2V's tiny components: UMT5 text, CLIP vision image encoder, Wan
VAE) around the tiny WanAnimateTransformer3DModel of recipes/tiny/wan_animate.yaml."""

from __future__ import annotations

from pathlib import Path

from train.models import tiny_config
from train.models.wan_i2v.tiny import image_to_video_components


def build_tiny(path: Path) -> None:
    from diffusers import WanAnimatePipeline, WanAnimateTransformer3DModel

    components = image_to_video_components(tiny_config("wan_animate"), WanAnimateTransformer3DModel, flow_shift=5.0)
    WanAnimatePipeline(**components).save_pretrained(path)
