"""LTX-Video's tiny LTXPipeline (T5 text encoder, AutoencoderKLLTXVideo with 8 latent channels and the released x32
spatial / 8k+1 temporal compression) around the tiny transformer of recipes/tiny/ltx.yaml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from train.models import tiny_config
from train.models.tiny import t5_encoder, t5_tokenizer


def build_tiny(path: Path) -> None:
    from diffusers import LTXPipeline

    LTXPipeline(**tiny_components()).save_pretrained(path)


def tiny_components(name: str = "ltx") -> dict[str, Any]:
    """The tiny pipeline's components around the tiny transformer of family ``name`` (LTX image-to-video's pipeline
    takes the same ones)."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel

    config = tiny_config(name)
    z = config["in_channels"]
    vae = AutoencoderKLLTXVideo(
        latent_channels=z,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True, False),
        decoder_inject_noise=(False, False, False, False, False),
        patch_size=4,
        patch_size_t=1,
        scaling_factor=0.75,
    )
    with torch.no_grad():
        vae.latents_mean.copy_(torch.linspace(-0.3, 0.3, z))
        vae.latents_std.copy_(torch.linspace(0.5, 2.0, z))
    tok = t5_tokenizer(max_length=128)
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=t5_encoder(len(tok)),
        tokenizer=tok,
        transformer=LTXVideoTransformer3DModel(**config),
    )
