"""FLUX.1 Kontext's tiny FluxKontextPipeline: FLUX.1's tiny components (the same transformer class and size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models.flux.tiny import TINY_CONFIG as FLUX_TINY_CONFIG
from train.models.flux.tiny import tiny_components

TINY_CONFIG: dict[str, Any] = dict(FLUX_TINY_CONFIG)


def build_tiny(path: Path) -> None:
    from diffusers import FluxKontextPipeline

    FluxKontextPipeline(**tiny_components()).save_pretrained(path)
