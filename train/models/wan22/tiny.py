"""Wan 2.2 A14B's tiny config (Wan's) and tiny two-expert WanPipeline (``transformer``, ``transformer_2``,
``boundary_ratio`` 0.875 in model_index.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models.tiny import t5_tokenizer, umt5_encoder, wan_vae
from train.models.wan.tiny import TINY_CONFIG as WAN_CONFIG

TINY_CONFIG: dict[str, Any] = dict(WAN_CONFIG)
BOUNDARY_RATIO = 0.875  # Wan-AI/Wan2.2-T2V-A14B-Diffusers model_index.json


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    tok = t5_tokenizer()
    pipe = WanPipeline(
        tokenizer=tok,
        text_encoder=umt5_encoder(len(tok)),
        vae=wan_vae(TINY_CONFIG["in_channels"]),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=WanTransformer3DModel(**TINY_CONFIG),
        transformer_2=WanTransformer3DModel(**TINY_CONFIG),  # another random init: the experts differ
        boundary_ratio=BOUNDARY_RATIO,
    )
    pipe.save_pretrained(path)
