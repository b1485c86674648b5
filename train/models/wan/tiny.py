"""Wan's tiny WanPipeline (UMT5 text encoder, AutoencoderKLWan with 4 latent channels) around the tiny transformer of
recipes/tiny/wan.yaml; the text-to-video components the other Wan-architecture families' tiny pipelines share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from train.models import tiny_config
from train.models.tiny import t5_tokenizer, umt5_encoder, wan_vae


def umt5_text(max_length: int = 64) -> dict[str, Any]:
    """The ``tokenizer`` and ``text_encoder`` of a Wan pipeline: a T5 tokenizer and a tiny UMT5 encoder."""
    tok = t5_tokenizer(max_length=max_length)
    return {"tokenizer": tok, "text_encoder": umt5_encoder(len(tok))}


def text_to_video_components(
    name: str, transformer_class: type | None = None, scheduler: Any = None, vae: Callable[[int], Any] = wan_vae
) -> dict[str, Any]:
    """A Wan text-to-video pipeline's constructor arguments around family ``name``'s tiny transformer (default class
    WanTransformer3DModel): UMT5 text, ``vae(latent channels)``, ``scheduler`` (default a flow-match Euler one at
    shift 3). Built in the order the weights are drawn: text encoder, VAE, transformer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    config = tiny_config(name)
    return dict(
        **umt5_text(),
        vae=vae(config["in_channels"]),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0) if scheduler is None else scheduler,
        transformer=(transformer_class or WanTransformer3DModel)(**config),
    )


def build_tiny(path: Path) -> None:
    from diffusers import WanPipeline

    WanPipeline(**text_to_video_components("wan")).save_pretrained(path)
