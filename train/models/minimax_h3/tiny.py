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
from train.models.tiny import decoder_sizes, qwen_tokenizer

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
    reads back where torchvision is installed. The encoder (`load_qwen3vl_processor_without_torchvision`) loads them
    without torchvision.
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


def qwen3vl_text_encoder(tokenizer, text_dim: int):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    special = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN3VL_SPECIALS}
    rope = dict(rope_type="default", mrope_section=[2, 1, 1], mrope_interleaved=True, rope_theta=1e4)
    end = special["<|im_end|>"]
    # 51 layers: MiniMaxH3ModularPipeline.text_encoder_layer is 50 (a property, not a config value) and
    # get_qwen3vl_prompt_embeds refuses a model of <= 50 decoder layers
    text_config = decoder_sizes(tokenizer, text_dim, 51, head_dim=8, rope_parameters=rope, bos_token_id=end,
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
        text_encoder=qwen3vl_text_encoder(tok, cfg["text_dim"]),
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
