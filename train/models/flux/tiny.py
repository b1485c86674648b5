"""FLUX.1's tiny FluxPipeline (CLIP + T5 text encoders, AutoencoderKL with 4 latent channels) around the tiny
transformer of recipes/tiny/flux.yaml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models import tiny_config
from train.models.tiny import clip_text_encoder, clip_tokenizer, t5_encoder, t5_tokenizer


def tiny_components(name: str = "flux") -> dict[str, Any]:
    """The tiny FLUX.1 pipeline's components (FluxPipeline's constructor arguments, FLUX.1 Kontext's too): CLIP + T5,
    AutoencoderKL with 4 latent channels, the tiny transformer of family ``name``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    cfg = tiny_config(name)
    vae = flux_vae(cfg["in_channels"] // 4)  # FluxPipeline packs 2x2 latent patches into channels
    clip_tok = clip_tokenizer()
    t5_tok = t5_tokenizer(max_length=64)
    clip = clip_text_encoder(len(clip_tok), cfg["pooled_projection_dim"])
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5_encoder(len(t5_tok), cfg["joint_attention_dim"]),
        tokenizer_2=t5_tok,
        transformer=FluxTransformer2DModel(**cfg),
    )


def flux_vae(z: int):
    """A tiny FLUX.1 AutoencoderKL (x8, ``z`` latent channels) with non-trivial shift and scaling factors (Chroma's
    VAE too)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(4, 4, 4, 4),
        layers_per_block=1,
        latent_channels=z,
        norm_num_groups=2,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1,
        scaling_factor=0.5,
    )


def build_tiny(path: Path) -> None:
    from diffusers import FluxPipeline

    FluxPipeline(**tiny_components()).save_pretrained(path)
