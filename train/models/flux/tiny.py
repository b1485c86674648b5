"""FLUX.1's tiny transformer config and tiny FluxPipeline (CLIP + T5 text encoders, AutoencoderKL with 4 latent
channels)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models.tiny import CHARS, HEAD_DIM, NUM_HEADS, TEXT_DIM, WORDS, t5_encoder, t5_tokenizer

TINY_CONFIG: dict[str, Any] = dict(
    patch_size=1,
    in_channels=16,  # 4 latent channels x 2x2 packing
    num_layers=1,  # double-stream block
    num_single_layers=1,  # single-stream block
    attention_head_dim=HEAD_DIM,
    num_attention_heads=NUM_HEADS,
    joint_attention_dim=TEXT_DIM,
    pooled_projection_dim=12,
    guidance_embeds=True,
    axes_dims_rope=(2, 2, 4),  # sums to HEAD_DIM
)


def clip_tokenizer(max_length: int = 77):
    """A real BPE CLIP tokenizer: letters, letters+</w>, and merges that spell each word of WORDS."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in CHARS:
        vocab[c] = len(vocab)
    for c in CHARS:
        vocab[c + "</w>"] = len(vocab)
    merges: list[tuple[str, str]] = []
    for w in WORDS:
        parts = list(w[:-1]) + [w[-1] + "</w>"]
        while len(parts) > 1:
            pair = (parts[0], parts[1])
            if pair not in merges:
                merges.append(pair)
            vocab.setdefault(pair[0] + pair[1], len(vocab))
            parts = [pair[0] + pair[1], *parts[2:]]
    tok = CLIPTokenizer(vocab=vocab, merges=merges)
    tok.model_max_length = max_length
    return tok


def tiny_components() -> dict[str, Any]:
    """The tiny FLUX.1 pipeline's components (FluxPipeline's constructor arguments): CLIP + T5, AutoencoderKL with 4
    latent channels, the tiny transformer."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = TINY_CONFIG
    z = cfg["in_channels"] // 4  # FluxPipeline packs 2x2 latent patches into channels
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(4, 4, 4, 4),
        layers_per_block=1,
        latent_channels=z,
        norm_num_groups=2,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1,
        scaling_factor=0.5,
    )
    clip_tok = clip_tokenizer()
    t5_tok = t5_tokenizer(max_length=64)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=cfg["pooled_projection_dim"],
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5_encoder(len(t5_tok), cfg["joint_attention_dim"]),
        tokenizer_2=t5_tok,
        transformer=FluxTransformer2DModel(**cfg),
    )


def build_tiny(path: Path) -> None:
    from diffusers import FluxPipeline

    FluxPipeline(**tiny_components()).save_pretrained(path)
