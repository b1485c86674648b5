"""HunyuanVideo 1.5's tiny HunyuanVideo15Pipeline around the tiny transformer of recipes/tiny/hunyuan_video15.yaml: a
3-layer Qwen2.5-VL text model with a byte-level Qwen2 tokenizer and a ChatML template, a ByT5 (T5 encoder on bytes)
for the glyph text, and AutoencoderKLHunyuanVideo15 with 4 latent channels at the released x16 spatial / 4k+1 temporal
compression."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models import tiny_config
from train.models.tiny import byt5_glyph_encoder, decoder_sizes, qwen25_rope, qwen_tokenizer

# Qwen2.5-VL's chat template, as HunyuanVideo15Pipeline uses it (a system and a user message, text content only).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_chat_tokenizer():
    tok = qwen_tokenizer(("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    tok.pad_token = "<|endoftext|>"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_components() -> dict[str, Any]:
    """HunyuanVideo15Pipeline's constructor arguments, tiny."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from train.models.hunyuan_video15.spec import SCHEDULER_CONFIG

    cfg = tiny_config("hunyuan_video15")
    tok, byt5_tok = qwen_chat_tokenizer(), ByT5Tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # 3 layers: the pipeline reads hidden_states[-3]; 4096 positions: the byte-level template prefix is ~700 tokens,
    # + 1000 text tokens
    sizes = decoder_sizes(tok, cfg["text_embed_dim"], 3, max_position_embeddings=4096, rope_parameters=qwen25_rope())
    qwen = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(**sizes, bos_token_id=end, eos_token_id=end, pad_token_id=tok.pad_token_id)
    )
    byt5 = byt5_glyph_encoder(byt5_tok, cfg["text_embed_2_dim"])
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=cfg["out_channels"],
        block_out_channels=(8, 8, 8, 8, 8),
        layers_per_block=1,
        scaling_factor=0.75,  # the released 1.03682 is close to 1; any other value shows a missing scaling
    )
    return dict(
        text_encoder=qwen,
        tokenizer=tok,
        transformer=HunyuanVideo15Transformer3DModel(**cfg),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_CONFIG["shift"]),
        text_encoder_2=byt5,
        tokenizer_2=byt5_tok,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )


def build_tiny(path: Path) -> None:
    from diffusers import HunyuanVideo15Pipeline

    HunyuanVideo15Pipeline(**tiny_components()).save_pretrained(path)
