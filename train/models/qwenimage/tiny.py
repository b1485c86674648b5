"""Qwen-Image's tiny transformer config and tiny QwenImagePipeline (Qwen2.5-VL text encoder of width 16,
AutoencoderKLQwenImage with 4 latent channels)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models.tiny import HEAD_DIM, NUM_HEADS, TEXT_DIM, qwen_tokenizer

TINY_CONFIG: dict[str, Any] = dict(
    patch_size=2,
    in_channels=16,  # 4 latent channels x 2x2 patch
    out_channels=4,
    num_layers=2,
    attention_head_dim=HEAD_DIM,
    num_attention_heads=NUM_HEADS,
    joint_attention_dim=TEXT_DIM,
    axes_dims_rope=(2, 2, 4),  # sums to HEAD_DIM
)


def tiny_qwen25vl(specials: tuple[str, ...] = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>")):
    """(tokenizer, text encoder): a byte-level Qwen2 tokenizer with ``specials`` and a Qwen2.5-VL of width TEXT_DIM
    with a one-block vision tower (what the Qwen-Image pipelines read: last hidden state, image tokens for -Edit)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = qwen_tokenizer(specials)
    special = {t: tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|vision_start|>", "<|image_pad|>")}
    d = TINY_CONFIG["joint_attention_dim"]
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=len(tok),
                hidden_size=d,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0},
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


def tiny_qwenimage_vae(z: int):
    """AutoencoderKLQwenImage of base dim 4 with ``z`` latent channels and non-trivial latents mean/std."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=z,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        latents_mean=[0.1 * (i - z / 2) for i in range(z)],
        latents_std=[0.5 + 0.25 * i for i in range(z)],
    )


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    cfg = TINY_CONFIG
    tok, text_encoder = tiny_qwen25vl()
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_qwenimage_vae(cfg["out_channels"]),
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=QwenImageTransformer2DModel(**cfg),
    )
    pipe.save_pretrained(path)
