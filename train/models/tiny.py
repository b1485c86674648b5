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
