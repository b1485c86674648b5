"""ChronoEdit's tiny ChronoEditPipeline: Wan image-to-video's tiny components (train/models/wan_i2v/tiny.py) around the
tiny transformer of recipes/tiny/chronoedit.yaml (Wan's blocks, image-to-video, like the real ChronoEdit-14B)."""

from __future__ import annotations

from pathlib import Path

from train.models import tiny_config
from train.models.wan_i2v.tiny import image_to_video_components


def build_tiny(path: Path) -> None:
    from diffusers import ChronoEditPipeline, ChronoEditTransformer3DModel

    components = image_to_video_components(tiny_config("chronoedit"), ChronoEditTransformer3DModel, flow_shift=5.0)
    ChronoEditPipeline(**components).save_pretrained(path)
