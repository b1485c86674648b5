"""Wan 2.2 I2V A14B's tiny two-expert WanImageToVideoPipeline (no image encoder; ``transformer``, ``transformer_2``,
``boundary_ratio`` 0.9 in model_index.json) around the tiny transformer of recipes/tiny/wan22_i2v.yaml."""

from __future__ import annotations

from pathlib import Path

from train.models import tiny_config
from train.models.tiny import wan_vae
from train.models.wan.tiny import umt5_text

BOUNDARY_RATIO = 0.9  # Wan-AI/Wan2.2-I2V-A14B-Diffusers model_index.json (wan/configs/wan_i2v_A14B.py boundary)


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanTransformer3DModel

    config = tiny_config("wan22_i2v")
    text = umt5_text(max_length=512)
    vae = wan_vae(config["out_channels"])
    high, low = WanTransformer3DModel(**config), WanTransformer3DModel(**config)  # two draws: the experts differ
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)  # as the other tiny Wan pipelines
    WanImageToVideoPipeline(**text, vae=vae, scheduler=scheduler, transformer=high, transformer_2=low,
                            boundary_ratio=BOUNDARY_RATIO).save_pretrained(path)  # fmt: skip
