"""FLUX.1 Kontext's tiny FluxKontextPipeline: FLUX.1's tiny components around the tiny transformer of
recipes/tiny/flux_kontext.yaml (the same transformer class and size)."""

from __future__ import annotations

from pathlib import Path

from train.models.flux.tiny import tiny_components


def build_tiny(path: Path) -> None:
    from diffusers import FluxKontextPipeline

    FluxKontextPipeline(**tiny_components("flux_kontext")).save_pretrained(path)
