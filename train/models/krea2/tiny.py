"""Krea 2's tiny Krea2Pipeline around the tiny transformer of recipes/tiny/krea2.yaml: a Qwen3VLModel (the base model,
as the pipeline's ``text_encoder`` is) of width ``text_hidden_dim`` with ``num_text_layers`` decoder layers, every one
tapped (``text_encoder_select_layers`` 1..n; the real taps are every third of 36); a byte-level Qwen2 tokenizer whose
merges spell the words of the pipeline's chat template, so the system prefix is 34 tokens and the assistant suffix 5,
as the real tokenizer counts them (the pipeline drops 34 and sizes the block by 5); AutoencoderKLQwenImage (x8) with
a quarter of the transformer's input channels (2x2 packing); the scheduler with Krea 2's dynamic shift."""

from __future__ import annotations

from pathlib import Path

from train.models import tiny_config
from train.models.tiny import QWEN3VL_SPECIALS, byte_bpe_vocab, qwen3vl_text_encoder, wan_vae

# Krea2Pipeline's template (its prompt_template_encode_prefix / _suffix): the words the tiny tokenizer's merges spell.
TEMPLATE = (
    "system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships "
    "of the objects and background:\nuser\nassistant\n"
)


def krea2_tokenizer():
    """A byte-level Qwen2 tokenizer with Qwen3-VL's special tokens and merges that make each word of TEMPLATE one
    token (the rest of the text stays one token per byte)."""
    import tokenizers
    from transformers import Qwen2Tokenizer

    split = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = sorted({w for line in TEMPLATE.splitlines() for w, _ in split.pre_tokenize_str(line)})
    vocab, merges = byte_bpe_vocab(), []
    for word in words:  # left to right: every prefix of a word is a token
        for i in range(1, len(word)):
            if (word[:i], word[i]) not in merges:
                merges.append((word[:i], word[i]))
            vocab.setdefault(word[: i + 1], len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": list(QWEN3VL_SPECIALS)})
    return tok


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel

    cfg = tiny_config("krea2")
    tok = krea2_tokenizer()
    layers = cfg["num_text_layers"]
    pipe = Krea2Pipeline(
        # Krea2Pipeline's documented scheduler config
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400
        ),  # fmt: skip
        vae=wan_vae(cfg["in_channels"] // 4, "AutoencoderKLQwenImage"),
        text_encoder=qwen3vl_text_encoder(tok, cfg["text_hidden_dim"], layers).model,  # a Qwen3VLModel
        tokenizer=tok,
        transformer=Krea2Transformer2DModel(**cfg),
        text_encoder_select_layers=tuple(range(1, layers + 1)),  # every decoder layer's output, as the real taps
    )
    pipe.save_pretrained(path)
