"""Kandinsky 5 image-to-video's tiny Kandinsky5I2VPipeline around the tiny transformer of
recipes/tiny/kandinsky5_i2v.yaml: the T2V family's tiny components (the I2V pipeline takes the same ones)."""

from __future__ import annotations

from pathlib import Path

from train.models.kandinsky5.tiny import save_tiny_pipeline


def build_tiny(path: Path) -> None:
    save_tiny_pipeline(path, "kandinsky5_i2v", "Kandinsky5I2VPipeline")
