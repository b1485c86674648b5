"""ChronoEdit's tiny transformer config (Wan's blocks, image-to-video) and tiny ChronoEditPipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models.tiny import INNER_DIM, t5_tokenizer, umt5_encoder, wan_vae
from train.models.wan.tiny import TINY_CONFIG as WAN_CONFIG

Z_DIM = 4
# Image-to-video config (like the real ChronoEdit-14B): image embeddings go through the added K/V projections
# (projected to the inner dim first). The transformer takes [noisy latents (z), first-frame mask (4), condition
# latents (z)] and predicts z channels.
TINY_CONFIG: dict[str, Any] = dict(
    WAN_CONFIG, in_channels=2 * Z_DIM + 4, out_channels=Z_DIM, image_dim=12, added_kv_proj_dim=INNER_DIM
)


def build_tiny(path: Path) -> None:
    from diffusers import ChronoEditPipeline, ChronoEditTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    image_dim = TINY_CONFIG["image_dim"]
    tok = t5_tokenizer(max_length=512)
    pipe = ChronoEditPipeline(
        tokenizer=tok,
        text_encoder=umt5_encoder(len(tok)),
        image_encoder=CLIPVisionModel(
            CLIPVisionConfig(
                hidden_size=image_dim,
                intermediate_size=24,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
                projection_dim=image_dim,
            )
        ),
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, do_center_crop=True
        ),
        transformer=ChronoEditTransformer3DModel(**TINY_CONFIG),
        vae=wan_vae(Z_DIM),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
    )
    pipe.save_pretrained(path)
