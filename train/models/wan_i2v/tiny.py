"""Wan 2.1 image-to-video's tiny WanImageToVideoPipeline (CLIP vision image encoder) around the tiny transformer of
recipes/tiny/wan_i2v.yaml; ChronoEdit's tiny pipeline takes the same components."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models import tiny_config
from train.models.tiny import wan_vae
from train.models.wan.tiny import umt5_text


def clip_image_encoder(image_dim: int):
    """A tiny CLIPVisionModel (2 layers, 32 px, 8 px patches: 17 tokens) and its CLIPImageProcessor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=image_dim, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=image_dim)  # fmt: skip
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                   do_center_crop=True)  # fmt: skip
    return CLIPVisionModel(config), processor


def image_to_video_components(config: dict[str, Any], transformer_class: type, flow_shift: float) -> dict[str, Any]:
    """A Wan image-to-video pipeline's constructor arguments: like the real I2V-14B, the transformer takes [noisy
    latents (z), first-frame mask (4), condition latents (z)] and predicts z = ``out_channels`` channels, and the
    image embeddings go through its added K/V projections. Text is 512 tokens (the image context follows it)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    text = umt5_text(max_length=512)
    image_encoder, image_processor = clip_image_encoder(config["image_dim"])
    return dict(
        **text,
        image_encoder=image_encoder,
        image_processor=image_processor,
        transformer=transformer_class(**config),
        vae=wan_vae(config["out_channels"]),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=flow_shift),
    )


def build_tiny(path: Path) -> None:
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    components = image_to_video_components(tiny_config("wan_i2v"), WanTransformer3DModel, flow_shift=3.0)
    WanImageToVideoPipeline(**components).save_pretrained(path)
