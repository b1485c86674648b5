"""Qwen-Image-Edit's tiny QwenImageEditPipeline: Qwen-Image's tiny VAE and Qwen2.5-VL (with its vision tower) around
the tiny transformer of recipes/tiny/qwenimage_edit.yaml (Qwen-Image's class and size), plus the processor the edit
pipeline reads (Qwen2VLImageProcessor + the tokenizer with the vision tokens)."""

from __future__ import annotations

import json
from pathlib import Path

from train.models import tiny_config
from train.models.qwenimage.tiny import tiny_qwen25vl
from train.models.tiny import wan_vae

# The tiny processor shrinks every image to at most 4 x 4 merged vision tokens (patch 14, merge 2); the released one
# allows up to 12845056 pixels.
VL_MAX_PIXELS = 112 * 112
VL_MIN_PIXELS = 56 * 56
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImageTransformer2DModel
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = tiny_config("qwenimage_edit")
    tok, text_encoder = tiny_qwen25vl(cfg["joint_attention_dim"], SPECIALS)
    pipe = QwenImageEditPipeline(
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
