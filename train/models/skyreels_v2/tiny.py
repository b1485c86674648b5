"""SkyReels-V2's tiny transformer config and tiny SkyReelsV2DiffusionForcingPipeline (Wan's UMT5 and VAE)."""

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
    inject_sample_info=True,  # the DF checkpoints' fps embedding
    num_frame_per_block=1,
)


def build_tiny(path: Path) -> None:
    from diffusers import (
        SkyReelsV2DiffusionForcingPipeline,
        SkyReelsV2Transformer3DModel,
        UniPCMultistepScheduler,
    )

    tok = t5_tokenizer()
    pipe = SkyReelsV2DiffusionForcingPipeline(
        tokenizer=tok,
        text_encoder=umt5_encoder(len(tok)),
        vae=wan_vae(TINY_CONFIG["in_channels"]),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0),
        transformer=SkyReelsV2Transformer3DModel(**TINY_CONFIG),
    )
    pipe.save_pretrained(path)
