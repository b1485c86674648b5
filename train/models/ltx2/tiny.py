"""LTX-2's tiny LTX2Pipeline around the tiny transformer of recipes/tiny/ltx2.yaml: a Gemma 3 text encoder
(Gemma3ForConditionalGeneration, 2 layers of width 16, a tiny SigLIP tower it never runs for text) with a Gemma
tokenizer over the synthetic captions' words, LTX2TextConnectors (with learnable registers, as released), the LTX-2
video VAE at the released x32 spatial / 8k+1 temporal compression, the audio VAE at the released 16 kHz, hop 160 and x4
time compression (16 mel bins here: 4 latent mel bins x 2 channels = 8 audio features), and a tiny vocoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from train.models import tiny_config
from train.models.tiny import CHARS, TEXT_DIM, WORDS

from .spec import SHIFT

# Gemma 3's special tokens, with the ids the released tokenizer gives them.
_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
TEXT_LAYERS = 2  # Gemma 3 decoder layers: the connectors read all hidden states (embeddings + each layer)
MEL_BINS = 16  # the released audio VAE reads 64; 16 keeps the tiny audio VAE small (4 latent mel bins)
REGISTERS = 8  # learnable registers per connector (released: 128); a multiple of 8 divides the 1024 text tokens


def gemma_tokenizer():
    """A real GemmaTokenizerFast (Unigram over WORDS + letters) with Gemma's special-token ids: pad 0, eos 1, bos 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import GemmaTokenizerFast

    vocab = [(t, 0.0) for t in _SPECIALS] + [("▁", -2.0)]
    vocab += [("▁" + w, -5.0) for w in WORDS] + [(c, -8.0) for c in CHARS]
    tok = Tokenizer(models.Unigram(vocab, unk_id=3))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = GemmaTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                              unk_token="<unk>", padding_side="left")  # fmt: skip
    fast.model_max_length = 1024
    return fast


def gemma3_text_encoder(vocab_size: int):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=TEXT_LAYERS,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
                sliding_window=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1, image_token_index=vocab_size)
    return Gemma3ForConditionalGeneration(config).eval()


def tiny_components(name: str = "ltx2") -> dict[str, Any]:
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    config = tiny_config(name)
    z = config["in_channels"]
    vae = AutoencoderKLLTX2Video(
        latent_channels=z,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        patch_size=4,
        patch_size_t=1,
        scaling_factor=0.75,
        # as the released config states them: the class would count 2**4 x 4 from its four scaling flags
        spatial_compression_ratio=32,
        temporal_compression_ratio=8,
    )
    audio_latent_channels = config["audio_in_channels"] // (MEL_BINS // 4)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=config["audio_in_channels"],  # its latents' statistics have base_channels entries
        output_channels=2,
        ch_mult=(1, 2, 4),
        num_res_blocks=1,
        latent_channels=audio_latent_channels,
        mel_bins=MEL_BINS,
    )
    with torch.no_grad():
        vae.latents_mean.copy_(torch.linspace(-0.3, 0.3, z))
        vae.latents_std.copy_(torch.linspace(0.5, 2.0, z))
        za = audio_vae.latents_mean.numel()
        audio_vae.latents_mean.copy_(torch.linspace(-0.2, 0.4, za))
        audio_vae.latents_std.copy_(torch.linspace(0.6, 1.8, za))
    tok = gemma_tokenizer()
    connectors = LTX2TextConnectors(
        caption_channels=TEXT_DIM,
        text_proj_in_factor=TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=TEXT_DIM // 2,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=REGISTERS,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=TEXT_DIM // 2,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=REGISTERS,
    )
    vocoder = LTX2Vocoder(in_channels=2 * MEL_BINS, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1]],
                          output_sampling_rate=16000)  # fmt: skip
    return dict(
        # Lightricks' scheduler config values (train/models/ltx2/spec.py SHIFT)
        scheduler=FlowMatchEulerDiscreteScheduler(**{k: v for k, v in SHIFT.scheduler_config.items() if k != "shift"}),
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=gemma3_text_encoder(len(tok)),
        tokenizer=tok,
        connectors=connectors,
        transformer=LTX2VideoTransformer3DModel(**config),
        vocoder=vocoder,
    )


def build_tiny(path: Path) -> None:
    from diffusers import LTX2Pipeline

    LTX2Pipeline(**tiny_components()).save_pretrained(path)
