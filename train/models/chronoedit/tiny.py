"""ChronoEdit's tiny transformer config (Wan's blocks, image-to-video) and tiny ChronoEditPipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models.tiny import INNER_DIM, t5_tokenizer, umt5_encoder, wan_vae
from train.models.wan.tiny import TINY_CONFIG as WAN_CONFIG
from train.models.wan_i2v.tiny import clip_image_encoder

Z_DIM = 4
# Image-to-video config (like the real ChronoEdit-14B): image embeddings go through the added K/V projections
# (projected to the inner dim first). The transformer takes [noisy latents (z), first-frame mask (4), condition
# latents (z)] and predicts z channels.
TINY_CONFIG: dict[str, Any] = dict(
    WAN_CONFIG, in_channels=2 * Z_DIM + 4, out_channels=Z_DIM, image_dim=12, added_kv_proj_dim=INNER_DIM
)


def build_tiny(path: Path) -> None:
    from diffusers import ChronoEditPipeline, ChronoEditTransformer3DModel, FlowMatchEulerDiscreteScheduler

    tok = t5_tokenizer(max_length=512)
    text_encoder = umt5_encoder(len(tok))
    image_encoder, image_processor = clip_image_encoder(TINY_CONFIG["image_dim"])
    pipe = ChronoEditPipeline(
        tokenizer=tok,
        text_encoder=text_encoder,
        image_encoder=image_encoder,
        image_processor=image_processor,
        transformer=ChronoEditTransformer3DModel(**TINY_CONFIG),
        vae=wan_vae(Z_DIM),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
    )
    pipe.save_pretrained(path)
