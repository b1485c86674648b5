"""Wan's tiny transformer config and tiny WanPipeline (UMT5 text encoder, AutoencoderKLWan with 4 latent channels)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models.tiny import HEAD_DIM, NUM_HEADS, TEXT_DIM, t5_tokenizer, umt5_encoder, wan_vae

TINY_CONFIG: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=NUM_HEADS,
    attention_head_dim=HEAD_DIM,
    in_channels=4,
    out_channels=4,
    text_dim=TEXT_DIM,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    tok = t5_tokenizer()
    pipe = WanPipeline(
        tokenizer=tok,
        text_encoder=umt5_encoder(len(tok)),
        vae=wan_vae(TINY_CONFIG["in_channels"]),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=WanTransformer3DModel(**TINY_CONFIG),
    )
    pipe.save_pretrained(path)
