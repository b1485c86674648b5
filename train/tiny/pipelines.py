"""Tiny random-init diffusers pipeline folders, one per family, built offline (no downloads), for the data tests.

    path = build_tiny_pipeline("wan", tmp_path / "wan")   # model_index.json, vae/, text_encoder/, tokenizer/, ...
    pipe = WanPipeline.from_pretrained(path)               # loads like a real checkpoint

Each folder is what `save_pretrained` writes for the family's real pipeline class, with the same component classes
and subfolders as the released checkpoint, only tiny: transformer from `train.tiny.configs.CONFIGS` (adapted where the
pipeline wiring needs other channel counts), VAE with 4 (LTX: 8) latent channels and the real downsampling strides,
text encoders with 2 layers of width 12-16 (Flux.2's Mistral has 30 layers, as the pipeline reads hidden states 10, 20
and 30), and real tokenizers built from a tiny vocabulary that covers the synthetic captions' words
(`train.data.synthetic_media`). VAE normalisation constants (latents mean/std, shift/scaling factors, batch-norm
statistics) are set to non-trivial values so a test notices a missing or wrong normalisation.

Families: wan, chronoedit, ltx, flux, flux2, qwenimage, minimax_h3. MiniMax-H3 is modular only: its folder is what
`MiniMaxH3ModularPipeline.save_pretrained` writes (modular_model_index.json + one subfolder per component), with the
released latent channel counts (video 24, audio 32), the released temporal chunking (17n + 5 frames -> 5n + 2 latent
frames), an audio VAE at 8 kHz with a hop of 200 (40 latents/s, the released rate), and a Qwen3-VL text encoder of 51
layers of width 16 (the pipeline reads hidden_states[50], a fixed `text_encoder_layer`, and refuses fewer layers).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from train.tiny.configs import CONFIGS, TEXT_DIM

__all__ = ["FAMILIES", "build_tiny_pipeline"]


# Words of the synthetic captions (train.data.synthetic_media) get one token each; other text falls back to letters.
WORDS = (
    "a an the red green blue yellow white black purple orange gray square circle triangle moving left right up down "
    "on background"
).split()
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789.,:;!?'-")
SEED = 0


def _seeded(fn: Callable[..., object]) -> Callable[..., object]:
    def wrapper(*args, **kwargs):
        torch.manual_seed(SEED)
        return fn(*args, **kwargs)

    return wrapper


# ---------------------------------------------------------------------------------------------------------- tokenizers


def t5_tokenizer(max_length: int = 64):
    """A real (Unigram) T5 tokenizer over WORDS + letters; ids: <pad> 0, </s> 1, <unk> 2."""
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + w, -5.0) for w in WORDS] + [(c, -8.0) for c in CHARS]
    tok = T5TokenizerFast(vocab=vocab, extra_ids=0)
    tok.model_max_length = max_length
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


def byte_bpe_vocab() -> dict[str, int]:
    import tokenizers

    return {c: i for i, c in enumerate(sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet()))}


def qwen_tokenizer():
    """A real byte-level BPE Qwen2 tokenizer (no merges: one token per byte) with the chat special tokens."""
    from transformers import Qwen2Tokenizer

    tok = Qwen2Tokenizer(vocab=byte_bpe_vocab(), merges=[])
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>"]}
    )
    return tok


# ---------------------------------------------------------------------------------------------------- text encoders


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


def wan_vae(z_dim: int = 4):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=4,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        latents_mean=[0.1 * (i - z_dim / 2) for i in range(z_dim)],
        latents_std=[0.5 + 0.25 * i for i in range(z_dim)],
    )


# --------------------------------------------------------------------------------------------------------- builders


@_seeded
def _wan(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    tok = t5_tokenizer()
    pipe = WanPipeline(
        tokenizer=tok,
        text_encoder=umt5_encoder(len(tok)),
        vae=wan_vae(CONFIGS["wan"]["in_channels"]),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=WanTransformer3DModel(**CONFIGS["wan"]),
    )
    pipe.save_pretrained(path)


@_seeded
def _chronoedit(path: Path) -> None:
    from diffusers import ChronoEditPipeline, ChronoEditTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    z = 4
    # the transformer takes [noisy latents (z), first-frame mask (4), condition latents (z)] and predicts z channels
    cfg = {**CONFIGS["chronoedit"], "in_channels": 2 * z + 4, "out_channels": z}
    image_dim = cfg["image_dim"]
    tok = t5_tokenizer(max_length=512)
    pipe = ChronoEditPipeline(
        tokenizer=tok,
        text_encoder=umt5_encoder(len(tok)),
        image_encoder=CLIPVisionModel(
            CLIPVisionConfig(
                hidden_size=image_dim,
                intermediate_size=24,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
                projection_dim=image_dim,
            )
        ),
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, do_center_crop=True
        ),
        transformer=ChronoEditTransformer3DModel(**cfg),
        vae=wan_vae(z),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
    )
    pipe.save_pretrained(path)


@_seeded
def _ltx(path: Path) -> None:
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    z = CONFIGS["ltx"]["in_channels"]
    vae = AutoencoderKLLTXVideo(
        latent_channels=z,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True, False),
        decoder_inject_noise=(False, False, False, False, False),
        patch_size=4,
        patch_size_t=1,
        scaling_factor=0.75,
    )
    with torch.no_grad():
        vae.latents_mean.copy_(torch.linspace(-0.3, 0.3, z))
        vae.latents_std.copy_(torch.linspace(0.5, 2.0, z))
    tok = t5_tokenizer(max_length=128)
    pipe = LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=t5_encoder(len(tok)),
        tokenizer=tok,
        transformer=LTXVideoTransformer3DModel(**CONFIGS["ltx"]),
    )
    pipe.save_pretrained(path)


@_seeded
def _flux(path: Path) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CONFIGS["flux"]
    z = cfg["in_channels"] // 4  # FluxPipeline packs 2x2 latent patches into channels
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(4, 4, 4, 4),
        layers_per_block=1,
        latent_channels=z,
        norm_num_groups=2,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1,
        scaling_factor=0.5,
    )
    clip_tok = clip_tokenizer()
    t5_tok = t5_tokenizer(max_length=64)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=cfg["pooled_projection_dim"],
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5_encoder(len(t5_tok), cfg["joint_attention_dim"]),
        tokenizer_2=t5_tok,
        transformer=FluxTransformer2DModel(**cfg),
    )
    pipe.save_pretrained(path)


@_seeded
def _qwenimage(path: Path) -> None:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = CONFIGS["qwenimage"]
    z = cfg["out_channels"]
    tok = qwen_tokenizer()
    special = {t: tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|vision_start|>", "<|image_pad|>")}
    d = cfg["joint_attention_dim"]
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=len(tok),
                hidden_size=d,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0},
                bos_token_id=special["<|im_end|>"],
                eos_token_id=special["<|im_end|>"],
            ),
            vision_config=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=32,
                num_heads=2,
                out_hidden_size=d,
                fullatt_block_indexes=[0],
            ),
            image_token_id=special["<|image_pad|>"],
            video_token_id=special["<|image_pad|>"],
            vision_start_token_id=special["<|vision_start|>"],
        )
    )
    vae = AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=z,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        latents_mean=[0.1 * (i - z / 2) for i in range(z)],
        latents_std=[0.5 + 0.25 * i for i in range(z)],
    )
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=QwenImageTransformer2DModel(**cfg),
    )
    pipe.save_pretrained(path)


def flux2_tokenizer(max_length: int = 512):
    """A word-level tokenizer with a Mistral-style chat template (system prompt + [INST] user [/INST]).

    The real FLUX.2 checkpoint's tokenizer is a PixtralProcessor, which transformers 5.24 refuses to build without
    torchvision (not a dependency here); Flux2Pipeline only calls `apply_chat_template` on it for text-to-image, which
    a tokenizer with a chat template answers the same way. Words: the pipeline's system message + WORDS.
    """
    import re

    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]"]
    words = sorted(set(re.findall(r"\w+|[^\w\s]", SYSTEM_MESSAGE)) | set(WORDS) | set(CHARS))
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{% else %}[INST]{% endif %}"
        "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% else %}[IMG]{% endif %}{% endfor %}"
        "{% if m['role'] == 'system' %}[/SYSTEM_PROMPT]{% else %}[/INST]{% endif %}{% endfor %}"
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=specials[4:],
        chat_template=template,
    )
    tok.model_max_length = max_length
    return tok


@_seeded
def _flux2(path: Path) -> None:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    hidden = 8
    # Flux2Pipeline stacks hidden states 10, 20 and 30 of the Mistral text model: 30 layers, text width 3 x hidden
    cfg = {**CONFIGS["flux2"], "joint_attention_dim": 3 * hidden}
    z = cfg["in_channels"] // 4  # latents are 2x2-patchified into channels
    tok = flux2_tokenizer()
    text_encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(
            vision_config=dict(
                model_type="pixtral",
                hidden_size=8,
                intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                head_dim=4,
                patch_size=4,
                image_size=32,
            ),
            text_config=dict(
                model_type="mistral",
                vocab_size=len(tok),
                hidden_size=hidden,
                intermediate_size=16,
                num_hidden_layers=30,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=4,
                max_position_embeddings=1024,
            ),
            image_token_index=tok.convert_tokens_to_ids("[IMG]"),
            spatial_merge_size=1,
        )
    )
    vae = AutoencoderKLFlux2(block_out_channels=(4, 4, 4, 4), layers_per_block=1, latent_channels=z, norm_num_groups=2)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, 4 * z))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, 4 * z))
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=Flux2Transformer2DModel(**cfg),
    )
    pipe.save_pretrained(path)


QWEN3VL_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                    "<|video_pad|>")  # fmt: skip


def qwen3vl_tokenizer():
    """The byte-level Qwen2 tokenizer of `qwen_tokenizer` with every Qwen3-VL vision special token."""
    from transformers import Qwen2Tokenizer

    tok = Qwen2Tokenizer(vocab=byte_bpe_vocab(), merges=[])
    tok.add_special_tokens({"additional_special_tokens": list(QWEN3VL_SPECIALS)})
    return tok


def save_qwen3vl_processor(tokenizer, path: Path, patch_size: int = 16, merge_size: int = 2) -> None:
    """Write the folder `Qwen3VLProcessor.save_pretrained` writes: its tokenizer + processor_config.json.

    transformers' Qwen3VLVideoProcessor cannot be instantiated without torchvision (not a dependency here), so the
    processor object is not built: the files are written as save_pretrained lays them out (image and video processor
    configs nested in processor_config.json, `processor_class` in the tokenizer config), which `from_pretrained`
    reads back where torchvision is installed. `train.data.families` loads them without torchvision.
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


@_seeded
def _minimax_h3(path: Path) -> None:
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3ModularPipeline,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    # the released latent channel counts: 24 video (AutoencoderKLMiniMaxH3) and 32 audio (AutoencoderKLMiniMaxH3Audio)
    z, za = 24, 32
    cfg = {**CONFIGS["minimax_h3"], "in_channels": z, "audio_in_channels": za}
    tok = qwen3vl_tokenizer()
    special = {t: tok.convert_tokens_to_ids(t) for t in QWEN3VL_SPECIALS}
    text_encoder = Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(
            text_config=dict(
                vocab_size=len(tok),
                hidden_size=cfg["text_dim"],
                intermediate_size=32,
                # MiniMaxH3ModularPipeline.text_encoder_layer is 50 (a property, not a config value) and
                # get_qwen3vl_prompt_embeds refuses a model of <= 50 decoder layers
                num_hidden_layers=51,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=8,
                max_position_embeddings=2048,
                rope_parameters=dict(
                    rope_type="default", mrope_section=[2, 1, 1], mrope_interleaved=True, rope_theta=1e4
                ),
                bos_token_id=special["<|im_end|>"],
                eos_token_id=special["<|im_end|>"],
            ),
            vision_config=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=32,
                num_heads=2,
                out_hidden_size=cfg["text_dim"],
                patch_size=16,
                num_position_embeddings=64,
                deepstack_visual_indexes=[0],
            ),
            image_token_id=special["<|image_pad|>"],
            video_token_id=special["<|video_pad|>"],
            vision_start_token_id=special["<|vision_start|>"],
            vision_end_token_id=special["<|vision_end|>"],
        )
    )
    vae = AutoencoderKLMiniMaxH3(  # released strides: x16 spatial, 17n + 5 frames -> 5n + 2 latent frames
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
    audio_vae = AutoencoderKLMiniMaxH3Audio(  # 8 kHz, hop 200: the released 40 latents per second
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
    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(
        text_encoder=text_encoder,
        tokenizer=tok,
        vae=vae,
        audio_vae=audio_vae,
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


BUILDERS: dict[str, Callable[[Path], None]] = {
    "wan": _wan,
    "chronoedit": _chronoedit,
    "ltx": _ltx,
    "flux": _flux,
    "qwenimage": _qwenimage,
    "flux2": _flux2,
    "minimax_h3": _minimax_h3,
}
FAMILIES: tuple[str, ...] = tuple(BUILDERS)


def build_tiny_pipeline(family: str, path: str | Path) -> Path:
    """Build the tiny pipeline of `family` and `save_pretrained` it to `path` (reused when already there)."""
    if family not in BUILDERS:
        raise KeyError(f"unknown family {family!r}; tiny pipelines exist for {FAMILIES}")
    path = Path(path)
    # Modular-only pipelines (MiniMax-H3) save modular_model_index.json instead of model_index.json.
    indexes = [path / "model_index.json", path / "modular_model_index.json"]
    if any(m.exists() and json.loads(m.read_text()).get("_tiny_family") == family for m in indexes):
        return path
    BUILDERS[family](path)
    marker = next(m for m in indexes if m.exists())
    index = json.loads(marker.read_text())
    index["_tiny_family"] = family  # diffusers ignores keys starting with "_"
    marker.write_text(json.dumps(index, indent=2))
    return path
