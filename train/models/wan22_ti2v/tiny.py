"""Wan 2.2 TI2V-5B's tiny transformer config and tiny pipeline: WanPipeline with ``expand_timesteps=True`` (as the
released folder; WanImageToVideoPipeline loads it for image-to-video) and a tiny Wan 2.2 VAE (residual, 2x2 patches,
x16 spatial)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models.tiny import t5_tokenizer, umt5_encoder
from train.models.wan.tiny import TINY_CONFIG as WAN_CONFIG

Z_DIM = 4
TINY_CONFIG: dict[str, Any] = dict(WAN_CONFIG, in_channels=Z_DIM, out_channels=Z_DIM)


def wan22_vae(z_dim: int = Z_DIM):
    """A tiny Wan 2.2 AutoencoderKLWan: the released strides (x16 spatial: 2x2 pixel patches then x8, 4k+1 frames ->
    k+1 latent frames), residual blocks, non-trivial latents mean/std."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=4,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        latents_mean=[0.1 * (i - z_dim / 2) for i in range(z_dim)],
        latents_std=[0.5 + 0.25 * i for i in range(z_dim)],
    )


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    tok = t5_tokenizer()
    pipe = WanPipeline(
        tokenizer=tok,
        text_encoder=umt5_encoder(len(tok)),
        vae=wan22_vae(Z_DIM),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=WanTransformer3DModel(**TINY_CONFIG),
        expand_timesteps=True,
    )
    pipe.save_pretrained(path)
