"""Qwen-Image's tiny QwenImagePipeline (Qwen2.5-VL text encoder of width 16, AutoencoderKLQwenImage with 4 latent
channels) around the tiny transformer of recipes/tiny/qwenimage.yaml."""

from __future__ import annotations

from pathlib import Path

from train.models import tiny_config
from train.models.tiny import decoder_sizes, qwen25_rope, qwen_tokenizer, wan_vae


def tiny_qwen25vl(
    d: int, specials: tuple[str, ...] = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>")
):
    """(tokenizer, text encoder): a byte-level Qwen2 tokenizer with ``specials`` and a Qwen2.5-VL of width ``d`` (the
    transformer's ``joint_attention_dim``) with a one-block vision tower (what the Qwen-Image pipelines read: last
    hidden state, image tokens for -Edit)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = qwen_tokenizer(specials)
    special = {t: tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|vision_start|>", "<|image_pad|>")}
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=decoder_sizes(
                tok,
                d,
                2,
                rope_parameters=qwen25_rope(),
                bos_token_id=special["<|im_end|>"],
                eos_token_id=special["<|im_end|>"],
            ),
            vision_config=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=32,
                num_heads=2,
                out_hidden_size=d,
                fullatt_block_indexes=[0],
            ),
            image_token_id=special["<|image_pad|>"],
            video_token_id=special["<|image_pad|>"],
            vision_start_token_id=special["<|vision_start|>"],
        )
    )
    return tok, text_encoder


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    cfg = tiny_config("qwenimage")
    tok, text_encoder = tiny_qwen25vl(cfg["joint_attention_dim"])
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=wan_vae(cfg["out_channels"], "AutoencoderKLQwenImage"),
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=QwenImageTransformer2DModel(**cfg),
    )
    pipe.save_pretrained(path)
