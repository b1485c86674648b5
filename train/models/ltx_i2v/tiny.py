"""LTX-Video image-to-video's tiny LTXImageToVideoPipeline: LTX's tiny components around the tiny transformer of
recipes/tiny/ltx_i2v.yaml."""

from __future__ import annotations

from pathlib import Path

from train.models.ltx.tiny import tiny_components

__all__ = ["build_tiny"]


def build_tiny(path: Path) -> None:
    from diffusers import LTXImageToVideoPipeline

    LTXImageToVideoPipeline(**tiny_components("ltx_i2v")).save_pretrained(path)
