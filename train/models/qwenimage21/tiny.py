"""Qwen-Image 2.1's tiny QwenImage21Pipeline around the tiny transformer of recipes/tiny/qwenimage21.yaml: a 2-layer
Qwen3-VL of width ``context_in_dim`` (a one-block vision tower) with MiniMax-H3's byte-level tokenizer and Qwen3-VL's
chat template, saved as the Qwen3VLProcessor the released ``processor/`` is; AutoencoderKLQwenImage21 at the released
x16 spatial compression (RGBA in and out, a residual encoder/decoder) with the transformer's latent channels."""

from __future__ import annotations

import json
from pathlib import Path

from train.models import tiny_config
from train.models.minimax_h3.tiny import QWEN3VL_SPECIALS, qwen3vl_tokenizer, save_qwen3vl_processor
from train.models.qwenimage21.encoder import load_processor
from train.models.tiny import decoder_sizes

# Qwen3-VL's chat template, its text parts (QwenImage21Pipeline renders the system turn with it to count the tokens it
# drops): message content as a string or a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen3vl(d: int):
    """(tokenizer with the chat template, text encoder): a 2-layer Qwen3-VL of width ``d`` (the pipeline reads its last
    decoder layer's output)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok = qwen3vl_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    special = {t: tok.convert_tokens_to_ids(t) for t in QWEN3VL_SPECIALS}
    end = special["<|im_end|>"]
    rope = dict(rope_type="default", mrope_section=[2, 1, 1], mrope_interleaved=True, rope_theta=1e4)
    text_config = decoder_sizes(tok, d, 2, head_dim=8, rope_parameters=rope, bos_token_id=end, eos_token_id=end)
    vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=d,
                         patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0])  # fmt: skip
    text_encoder = Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(
            text_config=text_config,
            vision_config=vision_config,
            image_token_id=special["<|image_pad|>"],
            video_token_id=special["<|video_pad|>"],
            vision_start_token_id=special["<|vision_start|>"],
            vision_end_token_id=special["<|vision_end|>"],
        )
    )
    return tok, text_encoder


def qwenimage21_vae(z_dim: int):
    """A tiny AutoencoderKLQwenImage21: 4 spatial downsamplings (x16, as released), RGBA in and out, non-trivial
    latents mean/std."""
    from diffusers import AutoencoderKLQwenImage21

    return AutoencoderKLQwenImage21(
        base_dim=4,
        decoder_base_dim=4,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
        latents_mean=[0.1 * (i - z_dim / 2) for i in range(z_dim)],
        latents_std=[0.5 + 0.25 * i for i in range(z_dim)],
    )


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline, QwenImage21Transformer2DModel

    cfg = tiny_config("qwenimage21")
    tok, text_encoder = tiny_qwen3vl(cfg["context_in_dim"])
    path = Path(path)
    save_qwen3vl_processor(tok, path / "processor")  # the files Qwen3VLProcessor.save_pretrained writes
    pipe = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=qwenimage21_vae(cfg["out_channels"]),
        text_encoder=text_encoder,
        processor=load_processor(str(path)),  # __init__ reads it; built without torchvision (no video processor)
        transformer=QwenImage21Transformer2DModel(**cfg),
    )
    pipe.register_modules(processor=None)  # written above: save_pretrained would save the processor class it got
    pipe.save_pretrained(path)
    index = json.loads((path / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
