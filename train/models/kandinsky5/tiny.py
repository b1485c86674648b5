"""Kandinsky 5 T2V's tiny Kandinsky5T2VPipeline around the tiny transformer of recipes/tiny/kandinsky5.yaml:
Qwen-Image's tiny Qwen2.5-VL (width ``in_text_dim``) with a byte-level tokenizer that also knows the words of the
pipeline's prompt template, saved as the Qwen2VLProcessor the released checkpoint's ``tokenizer`` is; a CLIP text
encoder for the pooled embedding (width ``in_text_dim2``); AutoencoderKLHunyuanVideo with ``in_visual_dim`` latent
channels at the released x8 spatial / 4k+1 temporal compression; the transformer's modulations drawn (the class
zero-initialises them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from train.models import tiny_config
from train.models.qwenimage.tiny import tiny_qwen25vl
from train.models.qwenimage_edit.tiny import SPECIALS
from train.models.tiny import clip_text_encoder, clip_tokenizer


def build_tiny(path: Path) -> None:
    save_tiny_pipeline(path, "kandinsky5", "Kandinsky5T2VPipeline")


def save_tiny_pipeline(path: Path, family: str, pipeline_class: str) -> None:
    """Writes the tiny ``pipeline_class`` (a Kandinsky 5 video pipeline: T2V, or I2V, which takes the same components)
    around the tiny transformer of ``family``'s recipe to ``path``."""
    import diffusers
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, Kandinsky5Transformer3DModel
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Modulation
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = tiny_config(family)
    tok, text_encoder = tiny_qwen25vl(cfg["in_text_dim"], SPECIALS)  # the processor's image and video tokens too
    clip_tok = clip_tokenizer()
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=cfg["in_visual_dim"],
        block_out_channels=(8, 8, 8, 8),  # 3 downsamplings: x8, as the released VAE
        layers_per_block=1,
        norm_num_groups=2,
        scaling_factor=0.75,  # the released 0.476986 is as non-trivial; any value shows a missing scaling
        mid_block_add_attention=False,
    )
    transformer = Kandinsky5Transformer3DModel(**cfg)
    # the class zero-initialises its modulations (every shift, scale and gate 0: the blocks' outputs gated off, no
    # gradient reaching them); a released checkpoint's are trained: draw them
    for module in transformer.modules():
        if isinstance(module, Kandinsky5Modulation):
            torch.nn.init.normal_(module.out_layer.weight, std=0.1)
            torch.nn.init.normal_(module.out_layer.bias, std=0.1)
    pipe = getattr(diffusers, pipeline_class)(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        text_encoder_2=clip_text_encoder(len(clip_tok), cfg["in_text_dim2"]),
        tokenizer_2=clip_tok,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
    )
    # One token per word of the template (one per byte otherwise): its prefix is then 131 tokens, so the pipeline's
    # crop of the first prompt_template_encode_start_idx = 128 keeps "<|im_start|>user\n", the prompt and <|im_end|>
    # (with one token per byte, a 512-token limit would truncate the prompt itself away).
    prefix = pipe.prompt_template[: pipe.prompt_template.index("{}")]
    tok.add_tokens(sorted(set(re.findall(r" ?[A-Za-z]+", prefix))))
    text_encoder.resize_token_embeddings(len(tok), mean_resizing=False)
    path = Path(path)
    pipe.save_pretrained(path)
    # the released checkpoint's tokenizer/ holds a Qwen2VLProcessor: its image processor's config and the tokenizer
    Qwen2VLImageProcessorPil().save_pretrained(path / "tokenizer")
    index = json.loads((path / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "Qwen2VLProcessor"]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
