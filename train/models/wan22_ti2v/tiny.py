"""Wan 2.2 TI2V-5B's tiny pipeline around the tiny transformer of recipes/tiny/wan22_ti2v.yaml: WanPipeline with
``expand_timesteps=True`` (as the released folder; WanImageToVideoPipeline loads it for image-to-video) and a tiny
Wan 2.2 VAE (residual, 2x2 patches, x16 spatial)."""

from __future__ import annotations

from pathlib import Path

from train.models.tiny import wan_vae
from train.models.wan.tiny import text_to_video_components


def wan22_vae(z_dim: int):
    """A tiny Wan 2.2 AutoencoderKLWan: the released strides (x16 spatial: 2x2 pixel patches then x8, 4k+1 frames ->
    k+1 latent frames), residual blocks."""
    return wan_vae(
        z_dim,
        decoder_base_dim=4,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
    )


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    components = text_to_video_components("wan22_ti2v", scheduler=scheduler, vae=wan22_vae)
    WanPipeline(**components, expand_timesteps=True).save_pretrained(path)
