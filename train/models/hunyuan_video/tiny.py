"""HunyuanVideo's tiny HunyuanVideoPipeline around the tiny transformer of recipes/tiny/hunyuan_video.yaml: a 3-layer
Llama with a byte-level BPE tokenizer that adds ``<|begin_of_text|>`` and knows the prompt template's header tokens (as
Llama 3's does), a CLIP text encoder for the pooled embedding, and AutoencoderKLHunyuanVideo with 4 latent channels at
the released x8 spatial / 4k+1 temporal compression."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.models import tiny_config
from train.models.tiny import byte_bpe_vocab, clip_text_encoder, clip_tokenizer, decoder_sizes

LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def llama_tokenizer():
    """A real byte-level BPE tokenizer (one token per byte, no merges) with Llama 3's special tokens: it prepends
    ``<|begin_of_text|>`` and pads with ``<|end_of_text|>`` on the right."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tk = tokenizers.Tokenizer(models.BPE(vocab=byte_bpe_vocab(), merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(LLAMA_SPECIALS))
    bos = LLAMA_SPECIALS[0]
    tk.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tk.token_to_id(bos))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=LLAMA_SPECIALS[1],
                                   pad_token=LLAMA_SPECIALS[1])  # fmt: skip


def tiny_components() -> dict[str, Any]:
    """HunyuanVideoPipeline's constructor arguments, tiny."""
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoTransformer3DModel
    from transformers import LlamaConfig, LlamaModel

    cfg = tiny_config("hunyuan_video")
    llama_tok, clip_tok = llama_tokenizer(), clip_tokenizer()
    ids = {f"{t}_token_id": getattr(llama_tok, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    # 3 layers: the pipeline reads hidden_states[-3]; 1024 positions: the byte-level template prefix is ~420 tokens
    sizes = decoder_sizes(llama_tok, cfg["text_embed_dim"], 3, num_key_value_heads=2, max_position_embeddings=1024)
    llama = LlamaModel(LlamaConfig(**sizes, **ids))
    clip = clip_text_encoder(len(clip_tok), cfg["pooled_projection_dim"])
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=cfg["in_channels"],
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=2,
        scaling_factor=0.75,  # the released 0.476986 is as non-trivial; any value shows a missing scaling
        mid_block_add_attention=False,
    )
    return dict(
        text_encoder=llama,
        tokenizer=llama_tok,
        transformer=HunyuanVideoTransformer3DModel(**cfg),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=clip,
        tokenizer_2=clip_tok,
    )


def build_tiny(path: Path) -> None:
    from diffusers import HunyuanVideoPipeline

    HunyuanVideoPipeline(**tiny_components()).save_pretrained(path)
