"""LTX-Video image-to-video's tiny transformer config and tiny LTXImageToVideoPipeline (LTX's tiny components)."""

from __future__ import annotations

from pathlib import Path

from train.models.ltx.tiny import TINY_CONFIG, tiny_components

__all__ = ["TINY_CONFIG", "build_tiny"]


def build_tiny(path: Path) -> None:
    from diffusers import LTXImageToVideoPipeline

    LTXImageToVideoPipeline(**tiny_components()).save_pretrained(path)
