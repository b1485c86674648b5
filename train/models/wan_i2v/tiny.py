"""Wan 2.1 image-to-video's tiny transformer config and tiny WanImageToVideoPipeline (CLIP vision image encoder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models.tiny import INNER_DIM, t5_tokenizer, umt5_encoder, wan_vae
from train.models.wan.tiny import TINY_CONFIG as WAN_CONFIG

Z_DIM = 4
IMAGE_DIM = 12
# Like the real I2V-14B: image embeddings go through the added K/V projections (projected to the inner dim first). The
# transformer takes [noisy latents (z), first-frame mask (4), condition latents (z)] and predicts z channels.
TINY_CONFIG: dict[str, Any] = dict(
    WAN_CONFIG, in_channels=2 * Z_DIM + 4, out_channels=Z_DIM, image_dim=IMAGE_DIM, added_kv_proj_dim=INNER_DIM
)


def clip_image_encoder(image_dim: int = IMAGE_DIM):
    """A tiny CLIPVisionModel (2 layers, 32 px, 8 px patches: 17 tokens) and its CLIPImageProcessor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=image_dim, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=image_dim)  # fmt: skip
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                   do_center_crop=True)  # fmt: skip
    return CLIPVisionModel(config), processor


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanTransformer3DModel

    tok = t5_tokenizer(max_length=512)
    text_encoder = umt5_encoder(len(tok))
    image_encoder, image_processor = clip_image_encoder(TINY_CONFIG["image_dim"])
    pipe = WanImageToVideoPipeline(
        tokenizer=tok,
        text_encoder=text_encoder,
        image_encoder=image_encoder,
        image_processor=image_processor,
        transformer=WanTransformer3DModel(**TINY_CONFIG),
        vae=wan_vae(Z_DIM),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipe.save_pretrained(path)
