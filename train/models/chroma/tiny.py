"""Chroma's tiny ChromaPipeline (T5 text encoder, FLUX.1's tiny AutoencoderKL with 4 latent channels) around the tiny
transformer of recipes/tiny/chroma.yaml."""

from __future__ import annotations

from pathlib import Path

from train.models import tiny_config
from train.models.flux.tiny import flux_vae
from train.models.tiny import t5_encoder, t5_tokenizer


def build_tiny(path: Path) -> None:
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    cfg = tiny_config("chroma")
    tokenizer = t5_tokenizer(max_length=512)
    ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=flux_vae(cfg["in_channels"] // 4),  # ChromaPipeline packs 2x2 latent patches into channels
        text_encoder=t5_encoder(len(tokenizer), cfg["joint_attention_dim"]),
        tokenizer=tokenizer,
        transformer=ChromaTransformer2DModel(**cfg),
    ).save_pretrained(path)
