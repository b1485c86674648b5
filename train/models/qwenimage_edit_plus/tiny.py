"""Qwen-Image-Edit-Plus' tiny QwenImageEditPlusPipeline: Qwen-Image-Edit's tiny VAE, Qwen2.5-VL (with its vision tower)
and processor around the tiny transformer of recipes/tiny/qwenimage_edit_plus.yaml (zero_cond_t on, as 2511)."""

from __future__ import annotations

import json
from pathlib import Path

from train.models import tiny_config
from train.models.qwenimage.tiny import tiny_qwen25vl
from train.models.qwenimage_edit.tiny import SPECIALS, VL_MAX_PIXELS, VL_MIN_PIXELS
from train.models.tiny import wan_vae


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline, QwenImageTransformer2DModel
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = tiny_config("qwenimage_edit_plus")
    tok, text_encoder = tiny_qwen25vl(cfg["joint_attention_dim"], SPECIALS)
    pipe = QwenImageEditPlusPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=wan_vae(cfg["out_channels"], "AutoencoderKLQwenImage"),
        text_encoder=text_encoder,
        tokenizer=tok,
        processor=None,  # saved below: Qwen2VLProcessor.save_pretrained needs its video processor (torchvision)
        transformer=QwenImageTransformer2DModel(**cfg),
    )
    path = Path(path)
    pipe.save_pretrained(path)
    # what the released checkpoint's processor/ holds: the image processor's config and the tokenizer
    Qwen2VLImageProcessorPil(min_pixels=VL_MIN_PIXELS, max_pixels=VL_MAX_PIXELS).save_pretrained(path / "processor")
    tok.save_pretrained(path / "processor")
    index = json.loads((path / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
