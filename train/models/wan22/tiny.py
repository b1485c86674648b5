"""Wan 2.2 A14B's tiny two-expert WanPipeline (``transformer``, ``transformer_2``, ``boundary_ratio`` 0.875 in
model_index.json): Wan's tiny components, the transformer of recipes/tiny/wan22.yaml twice."""

from __future__ import annotations

from pathlib import Path

from train.models import tiny_config
from train.models.wan.tiny import text_to_video_components

BOUNDARY_RATIO = 0.875  # Wan-AI/Wan2.2-T2V-A14B-Diffusers model_index.json


def build_tiny(path: Path) -> None:
    from diffusers import WanPipeline, WanTransformer3DModel

    components = text_to_video_components("wan22")
    expert = WanTransformer3DModel(**tiny_config("wan22"))  # another random init: the experts differ
    WanPipeline(**components, transformer_2=expert, boundary_ratio=BOUNDARY_RATIO).save_pretrained(path)
