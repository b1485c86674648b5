"""MiniMax-H3's tiny modular pipeline folder, around the tiny transformer of recipes/tiny/minimax_h3.yaml.

MiniMax-H3 is modular only: the folder is what `MiniMaxH3ModularPipeline.save_pretrained` writes
(modular_model_index.json + one subfolder per component), with the released latent channel counts (video 24, audio
32), the released temporal chunking (17n + 5 frames -> 5n + 2 latent frames), an audio VAE at 8 kHz with a hop of 200
(40 latents/s, the released rate), and a Qwen3-VL text encoder of 51 layers of width 16 (the pipeline reads
hidden_states[50], a fixed `text_encoder_layer`, and refuses fewer layers).
"""

from __future__ import annotations

import json
from pathlib import Path

from train.models import tiny_config
from train.models.tiny import qwen3vl_text_encoder, qwen3vl_tokenizer, save_qwen3vl_processor


def video_vae(z: int):
    """AutoencoderKLMiniMaxH3 with the released strides: x16 spatial, 17n + 5 frames -> 5n + 2 latent frames."""
    from diffusers import AutoencoderKLMiniMaxH3

    return AutoencoderKLMiniMaxH3(
        latent_channels=z,
        block_out_channels=(8,) * 6,
        layers_per_block=1,
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=8,
        decoder_ffn_mult=2,
        latents_mean=[0.05 * (i - z / 2) for i in range(z)],
        latents_std=[0.5 + 0.05 * i for i in range(z)],
    )


def audio_vae(za: int):
    """AutoencoderKLMiniMaxH3Audio at 8 kHz with a hop of 200: the released 40 latents per second."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    return AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4,
        encoder_rates=(2, 4, 5, 5),
        latent_dim=za,
        latent_channels=za,
        num_attention_heads=2,
        decoder_dim=64,
        decoder_rates=(5, 5, 2, 2, 2),
        decoder_kernel_sizes=(9, 9, 4, 4, 4),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1, 3),),
        sampling_rate=8000,
        latents_mean=[0.02 * (i - za / 2) for i in range(za)],
        latents_std=[0.6 + 0.03 * i for i in range(za)],
    )


def build_tiny(path: Path) -> None:
    from diffusers import MiniMaxH3ModularPipeline, MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel

    cfg = tiny_config("minimax_h3")
    tok = qwen3vl_tokenizer()
    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(
        # 51 layers: text_encoder_layer is 50 (a property) and get_qwen3vl_prompt_embeds refuses <= 50 layers
        text_encoder=qwen3vl_text_encoder(tok, cfg["text_dim"], 51),
        tokenizer=tok,
        vae=video_vae(cfg["in_channels"]),
        audio_vae=audio_vae(cfg["audio_in_channels"]),
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
        transformer=MiniMaxH3Transformer3DModel(**cfg),
        transformer_ref=MiniMaxH3Transformer3DModel(**cfg),  # the ref2va partition the released repo also holds
    )
    pipe.save_pretrained(str(path), overwrite_modular_index=True)
    # the processor is written by hand (see save_qwen3vl_processor) and indexed like the components save_pretrained
    # indexed, so ModularPipeline.from_pretrained(path) has a loading spec for every from_pretrained component
    save_qwen3vl_processor(qwen3vl_tokenizer(), path / "processor")
    index_path = path / "modular_model_index.json"
    index = json.loads(index_path.read_text())
    spec = dict(index["tokenizer"][2], subfolder="processor", type_hint=["transformers", "Qwen3VLProcessor"])
    index["processor"] = ["transformers", "Qwen3VLProcessor", spec]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
