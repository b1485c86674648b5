"""Tiny components several families' tiny pipelines share: sizes, tokenizers, text encoders, the Wan VAE.

A family's tiny transformer config is ``model.init_config`` of its tiny recipe `recipes/tiny/<family>.yaml`
(`train.models.tiny_config`: NUM_HEADS = 7 heads, divisible by none of the CP degrees 2, 3 and 4, of HEAD_DIM = 8,
1-2 layers). Each family's `tiny.py` holds `build_tiny(path)`, which writes what `save_pretrained` writes for the
family's real pipeline class around that transformer, with the same component classes and subfolders as the released
checkpoint, only tiny. Text encoders have 2 layers of width 12-16 (unless the pipeline
reads a deeper hidden state) and real tokenizers built from a tiny vocabulary that covers the synthetic captions'
words (`train.data.synthetic_media`). VAE normalisation constants (latents mean/std, shift/scaling factors,
batch-norm statistics) are set to non-trivial values so a test notices a missing or wrong normalisation. Nothing is
downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NUM_HEADS = 7
HEAD_DIM = 8
INNER_DIM = NUM_HEADS * HEAD_DIM  # 56
TEXT_DIM = 16

# Words of the synthetic captions (train.data.synthetic_media) get one token each; other text falls back to letters.
WORDS = (
    "a an the red green blue yellow white black purple orange gray square circle triangle moving left right up down "
    "on background"
).split()
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789.,:;!?'-")


# ---------------------------------------------------------------------------------------------------------- tokenizers


def t5_tokenizer(max_length: int = 64):
    """A real (Unigram) T5 tokenizer over WORDS + letters; ids: <pad> 0, </s> 1, <unk> 2."""
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + w, -5.0) for w in WORDS] + [(c, -8.0) for c in CHARS]
    tok = T5TokenizerFast(vocab=vocab, extra_ids=0)
    tok.model_max_length = max_length
    return tok


def byte_bpe_vocab() -> dict[str, int]:
    """One token per byte, in the byte-level alphabet of the Qwen tokenizers (no merges)."""
    import tokenizers

    return {c: i for i, c in enumerate(sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet()))}


def qwen_tokenizer(specials: tuple[str, ...]):
    """A real byte-level BPE Qwen2 tokenizer (no merges: one token per byte) with the given special tokens."""
    from transformers import Qwen2Tokenizer

    tok = Qwen2Tokenizer(vocab=byte_bpe_vocab(), merges=[])
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    return tok


QWEN3VL_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                    "<|video_pad|>")  # fmt: skip


def qwen3vl_tokenizer():
    """The byte-level Qwen2 tokenizer with every Qwen3-VL vision special token."""
    return qwen_tokenizer(QWEN3VL_SPECIALS)


def save_qwen3vl_processor(tokenizer, path: Path, patch_size: int = 16, merge_size: int = 2) -> None:
    """Write the folder `Qwen3VLProcessor.save_pretrained` writes: its tokenizer + processor_config.json.

    transformers' Qwen3VLVideoProcessor cannot be instantiated without torchvision (not a dependency here), so the
    processor object is not built: the files are written as save_pretrained lays them out (image and video processor
    configs nested in processor_config.json, `processor_class` in the tokenizer config), which `from_pretrained`
    reads back where torchvision is installed; the families' encoders load them without torchvision.
    """
    from transformers import Qwen2VLImageProcessorPil

    path.mkdir(parents=True, exist_ok=True)
    tokenizer._set_processor_class("Qwen3VLProcessor")
    tokenizer.save_pretrained(path)
    pixels = {"shortest_edge": 4 * (patch_size * merge_size) ** 2, "longest_edge": 64 * (patch_size * merge_size) ** 2}
    common = dict(patch_size=patch_size, temporal_patch_size=2, merge_size=merge_size, image_mean=[0.5] * 3,
                  image_std=[0.5] * 3)  # fmt: skip
    image = Qwen2VLImageProcessorPil(size=pixels, **common).to_dict()
    image["image_processor_type"] = "Qwen2VLImageProcessor"  # the class name save_pretrained records
    video = {"video_processor_type": "Qwen3VLVideoProcessor", "size": pixels, "fps": 2, "min_frames": 4,
             "max_frames": 768, "do_sample_frames": True, **common}  # fmt: skip
    config = {"image_processor": image, "video_processor": video, "processor_class": "Qwen3VLProcessor"}
    (path / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def qwen3vl_text_encoder(tokenizer, text_dim: int, layers: int):
    """A Qwen3-VL of `layers` decoder layers of width `text_dim` with a one-block vision tower (MiniMax-H3 reads
    hidden_states[50] and refuses <= 50 layers: 51; Qwen-Image 2.1 reads the last layer: 2)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    special = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN3VL_SPECIALS}
    rope = dict(rope_type="default", mrope_section=[2, 1, 1], mrope_interleaved=True, rope_theta=1e4)
    end = special["<|im_end|>"]
    text_config = decoder_sizes(tokenizer, text_dim, layers, head_dim=8, rope_parameters=rope, bos_token_id=end,
                                eos_token_id=end)  # fmt: skip
    vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text_dim,
                         patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0])  # fmt: skip
    return Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(
            text_config=text_config,
            vision_config=vision_config,
            image_token_id=special["<|image_pad|>"],
            video_token_id=special["<|video_pad|>"],
            vision_start_token_id=special["<|vision_start|>"],
            vision_end_token_id=special["<|vision_end|>"],
        )
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


# ---------------------------------------------------------------------------------------------------- text encoders


def clip_text_encoder(vocab_size: int, hidden_size: int):
    """A 2-layer CLIPTextModel for :func:`clip_tokenizer`'s ids (the pooled text embedding of FLUX.1, HunyuanVideo)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(
        CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=24, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                       pad_token_id=1)
    )  # fmt: skip


def decoder_sizes(tokenizer: Any, hidden_size: int, num_hidden_layers: int, **sizes: Any) -> dict[str, Any]:
    """Config values of a tiny decoder text model (Llama, Mistral, Qwen2.5-VL, Qwen3-VL) for ``tokenizer``'s ids: MLP
    width 32, 2 attention heads sharing one key/value head, 2048 positions; ``sizes`` adds or replaces values."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 32,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        **sizes,
    }


def byt5_glyph_encoder(tokenizer: Any, d_model: int):
    """A tiny T5 encoder for a ByT5 tokenizer: the glyph text encoder of HunyuanVideo 1.5 and HunyuanImage 2.1."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=d_model,
            d_kv=4,
            d_ff=24,
            num_layers=2,
            num_heads=3,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    )


def qwen25_rope() -> dict[str, Any]:
    """The multimodal rope of the tiny Qwen2.5-VL text models (3 sections over a head dim of 8), a fresh dict (the
    config keeps it)."""
    return {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}


def _t5_family_encoder(config_cls, model_cls, vocab_size: int, d_model: int):
    cfg = config_cls(
        vocab_size=vocab_size, d_model=d_model, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8,
    )  # fmt: skip
    return model_cls(cfg)


def umt5_encoder(vocab_size: int, d_model: int = TEXT_DIM):
    from transformers import UMT5Config, UMT5EncoderModel

    return _t5_family_encoder(UMT5Config, UMT5EncoderModel, vocab_size, d_model)


def t5_encoder(vocab_size: int, d_model: int = TEXT_DIM):
    from transformers import T5Config, T5EncoderModel

    return _t5_family_encoder(T5Config, T5EncoderModel, vocab_size, d_model)


# ------------------------------------------------------------------------------------------------------------ VAEs


def wan_vae(z_dim: int = 4, vae_class: str = "AutoencoderKLWan", **arch: Any):
    """A tiny AutoencoderKLWan (the released strides: x8 spatial, 4k+1 frames -> k+1 latent frames) with non-trivial
    latents mean/std, or another class of its architecture (``AutoencoderKLQwenImage``); ``arch``: further constructor
    arguments (Wan 2.2's residual VAE)."""
    import diffusers

    return getattr(diffusers, vae_class)(
        base_dim=4,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        latents_mean=[0.1 * (i - z_dim / 2) for i in range(z_dim)],
        latents_std=[0.5 + 0.25 * i for i in range(z_dim)],
        **arch,
    )
