"""Qwen-Image 2.1's tiny QwenImage21Pipeline around the tiny transformer of recipes/tiny/qwenimage21.yaml: a 2-layer
Qwen3-VL of width ``context_in_dim`` (train/models/tiny.py: a one-block vision tower, the byte-level tokenizer) with
Qwen3-VL's chat template, saved as the Qwen3VLProcessor the released ``processor/`` is; AutoencoderKLQwenImage21 at
the released x16 spatial compression (RGBA in and out, a residual encoder/decoder) with the transformer's latent
channels."""

from __future__ import annotations

import json
from pathlib import Path

from train.models import tiny_config
from train.models.qwenimage21.encoder import load_processor
from train.models.tiny import qwen3vl_text_encoder, qwen3vl_tokenizer, save_qwen3vl_processor

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
    tok = qwen3vl_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok, qwen3vl_text_encoder(tok, d, 2)


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
