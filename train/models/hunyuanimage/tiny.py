"""HunyuanImage 2.1's tiny HunyuanImagePipeline around the tiny transformer of recipes/tiny/hunyuanimage.yaml: a
3-layer Qwen2.5-VL text model with a byte-level Qwen2 tokenizer whose merges make each piece of the pipeline's prompt
template one token (so the pipeline's hard-coded ``prompt_template_encode_start_idx`` 34 drops exactly the template,
as with Qwen2.5-VL's own tokenizer), a ByT5 (T5 encoder on bytes) for the glyph text, AutoencoderKLHunyuanImage with
4 latent channels at the released x32 compression, and the released guider (CFG 3.5 with APG from step 5)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

from train.models import tiny_config
from train.models.tiny import byt5_glyph_encoder, byte_bpe_vocab, decoder_sizes, qwen25_rope

QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def qwen_template_tokenizer():
    """A real byte-level BPE Qwen2 tokenizer (one token per byte) plus merges that spell each pre-token of
    HunyuanImagePipeline's template prefix (the words, punctuation and newlines between its special tokens)."""
    from diffusers.pipelines.hunyuan_image.pipeline_hunyuanimage import HunyuanImagePipeline
    from transformers import Qwen2Tokenizer

    # the pipeline's prompt_template_encode, also the default of its _get_qwen_prompt_embeds
    template = inspect.signature(HunyuanImagePipeline._get_qwen_prompt_embeds).parameters["template"].default
    prefix = template[: template.index("{}")]
    pre = Qwen2Tokenizer(vocab=byte_bpe_vocab(), merges=[]).backend_tokenizer.pre_tokenizer
    vocab, merges = byte_bpe_vocab(), []
    for segment in re.split("|".join(map(re.escape, QWEN_SPECIALS)), prefix):
        for piece, _ in pre.pre_tokenize_str(segment):
            for end in range(2, len(piece) + 1):
                if (pair := (piece[: end - 1], piece[end - 1])) not in merges:
                    merges.append(pair)
                vocab.setdefault(piece[:end], len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS)})
    tok.pad_token = "<|endoftext|>"
    return tok


def tiny_components() -> dict[str, Any]:
    """HunyuanImagePipeline's constructor arguments, tiny."""
    from diffusers import (
        AdaptiveProjectedMixGuidance,
        AutoencoderKLHunyuanImage,
        FlowMatchEulerDiscreteScheduler,
        HunyuanImageTransformer2DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from train.models.hunyuanimage.spec import SCHEDULER_CONFIG

    cfg = tiny_config("hunyuanimage")
    tok, byt5_tok = qwen_template_tokenizer(), ByT5Tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # 3 layers: the pipeline reads hidden_states[-3]; 34 template tokens + 1000 text tokens fit 2048 positions
    sizes = decoder_sizes(tok, cfg["text_embed_dim"], 3, rope_parameters=qwen25_rope())
    qwen = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(**sizes, bos_token_id=end, eos_token_id=end, pad_token_id=tok.pad_token_id)
    )
    byt5 = byt5_glyph_encoder(byt5_tok, cfg["text_embed_2_dim"])
    vae = AutoencoderKLHunyuanImage(
        in_channels=3,
        out_channels=3,
        latent_channels=cfg["in_channels"],
        block_out_channels=(32,) * 6,  # 5 downsamplings (x32); its GroupNorms take 32 groups
        layers_per_block=1,
        spatial_compression_ratio=32,
        sample_size=384,
        scaling_factor=0.75289,  # the released value: any value but 1 shows a missing scaling
    )
    return dict(
        text_encoder=qwen,
        tokenizer=tok,
        transformer=HunyuanImageTransformer2DModel(**cfg),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_CONFIG["shift"]),
        text_encoder_2=byt5,
        tokenizer_2=byt5_tok,
        guider=AdaptiveProjectedMixGuidance(),  # the released guider's settings are the class defaults
    )


def build_tiny(path: Path) -> None:
    from diffusers import HunyuanImagePipeline

    HunyuanImagePipeline(**tiny_components()).save_pretrained(path)
