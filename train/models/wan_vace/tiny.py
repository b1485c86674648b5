"""Wan VACE's tiny WanVACEPipeline (Wan's tiny text-to-video components, one transformer) around the tiny
WanVACETransformer3DModel of recipes/tiny/wan_vace.yaml: its ``vace_in_channels`` are the pipeline's control channels
for the tiny VAE, inactive (4) | reactive (4) | the 8x8 mask grid (64)."""

from __future__ import annotations

from pathlib import Path

from train.models.wan.tiny import text_to_video_components


def build_tiny(path: Path) -> None:
    from diffusers import WanVACEPipeline, WanVACETransformer3DModel

    WanVACEPipeline(**text_to_video_components("wan_vace", WanVACETransformer3DModel)).save_pretrained(path)
