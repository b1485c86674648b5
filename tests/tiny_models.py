"""Tiny random-init diffusers transformers plus matching forward inputs, for context-parallel parity tests.

Every model is built from a fixed seed with 1-2 layers (both block types where a model has two), 7 attention heads
(7 is not divisible by the CP degrees 2, 3 and 4, so Ulysses splits heads unevenly) and head dim 8. Every token
count that context parallelism splits is odd and not divisible by 3 (25, 35, 37, 55 media/packed tokens; 5 or 7 text
tokens), so ``tensor_split`` along the token dim is uneven for CP degrees 2, 3 and 4.

Usage::

    model = build_model("flux")
    inputs = build_inputs("flux")
    outputs = output_tensors("flux", model(**inputs, return_dict=False))
    make_loss("flux", outputs).backward()

Parameters that are structurally unused by a model's forward (they can never get a gradient, whatever the inputs)
are frozen by :func:`build_model`; they are listed in :data:`FROZEN_PARAMS`. Every other parameter gets a gradient
that is not None and not all zeros.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from diffusers import (
    ChronoEditTransformer3DModel,
    Flux2Transformer2DModel,
    FluxTransformer2DModel,
    HeliosTransformer3DModel,
    LTX2VideoTransformer3DModel,
    LTXVideoTransformer3DModel,
    MiniMaxH3Transformer3DModel,
    QwenImageTransformer2DModel,
    WanTransformer3DModel,
)
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput

from train.tiny.configs import CONFIGS, HEAD_DIM, INNER_DIM, NUM_HEADS, TEXT_DIM  # noqa: F401

# The seven trainable models used by the CP parity tests, in a fixed order.
MODEL_NAMES: tuple[str, ...] = ("flux", "flux2", "qwenimage", "wan", "chronoedit", "ltx", "minimax_h3")
# Models whose CP support is expected to be refused (guard tests).
GUARD_MODEL_NAMES: tuple[str, ...] = ("helios", "ltx2")
ALL_MODEL_NAMES: tuple[str, ...] = MODEL_NAMES + GUARD_MODEL_NAMES


INIT_GAIN = 1.25  # see build_model()
INIT_BIAS_STD = 0.05

# Parameters that a model's forward never uses, so they can't get a gradient; build_model() freezes them
# (requires_grad=False). Regexes matched with re.fullmatch against the parameter name.
FROZEN_PARAMS: dict[str, tuple[str, ...]] = {
    # Qwen-Image is double-stream only and returns the image stream: in the LAST block the text-stream output
    # (text queries -> attn.to_add_out -> txt_mlp) is computed and then discarded by the model. Text keys/values
    # (add_k_proj / add_v_proj / norm_added_k) and txt_mod of the last block do reach the image stream.
    "qwenimage": (
        r"transformer_blocks\.1\.attn\.(add_q_proj|norm_added_q|to_add_out)\..*",
        r"transformer_blocks\.1\.txt_mlp\..*",
    ),
}


MODEL_CLASSES: dict[str, type[ModelMixin]] = {
    "flux": FluxTransformer2DModel,
    "flux2": Flux2Transformer2DModel,
    "qwenimage": QwenImageTransformer2DModel,
    "wan": WanTransformer3DModel,
    "chronoedit": ChronoEditTransformer3DModel,
    "ltx": LTXVideoTransformer3DModel,
    "minimax_h3": MiniMaxH3Transformer3DModel,
    "helios": HeliosTransformer3DModel,
    "ltx2": LTX2VideoTransformer3DModel,
}

# Models whose forward returns (video, audio) rather than a single sample.
_MULTI_OUTPUT = {"minimax_h3": 2, "ltx2": 2}

# Input shapes ---------------------------------------------------------------------------------------------------------

BATCH_SIZES: dict[str, int] = {
    "flux": 2,
    "flux2": 1,
    "qwenimage": 2,
    "wan": 2,
    "chronoedit": 1,
    "ltx": 2,
    "minimax_h3": 2,
    "helios": 1,
    "ltx2": 1,
}

# (frames, height, width) in tokens after patchify.
_GRIDS: dict[str, tuple[int, int, int]] = {
    "flux": (1, 5, 7),
    "flux2": (1, 5, 5),
    "qwenimage": (1, 5, 7),
    "wan": (5, 1, 7),
    "chronoedit": (5, 5, 1),
    "ltx": (5, 7, 1),
    "helios": (5, 1, 7),
    "ltx2": (5, 1, 7),
}
_TEXT_TOKENS: dict[str, int] = {
    "flux": 7,
    "flux2": 5,
    "qwenimage": 7,
    "wan": 7,
    # Wan-family processors hard-code a 512-token text context when image embeddings are prepended
    # (`image_context_length = encoder_hidden_states.shape[1] - 512`). The Wan CP plan never splits the text.
    "chronoedit": 512,
    "ltx": 5,
    "minimax_h3": 5,
    "helios": 7,
    "ltx2": 7,
}
_CHRONOEDIT_IMAGE_TOKENS = 5
# (model, token_counts key) pairs that are not split by CP on their own and may be divisible by 2, 3 or 4.
UNSPLIT_COUNTS: frozenset[tuple[str, str]] = frozenset({("chronoedit", "text"), ("helios", "history")})
_LTX2_AUDIO_FRAMES = 13

# MiniMax-H3 packed rows: text, audio, conditioning video frame + target video frames (interleaved, see below).
_MM_AUDIO_ROWS = 7  # mono audio latents
_MM_FRAME_GRID = (1, 5)  # (h, w) patches per latent frame
_MM_TARGET_FRAMES = 4
_MM_COND_FRAMES = 1

# Helios: main chunk (5 frames) + short (2 frames) / mid (2 frames) / long (4 frames) history latents.
_HELIOS_HISTORY_FRAMES = {"long": 4, "mid": 2, "short": 2}


def _minimax_rows() -> dict[str, int]:
    rows_per_frame = _MM_FRAME_GRID[0] * _MM_FRAME_GRID[1]
    video = (_MM_COND_FRAMES + _MM_TARGET_FRAMES) * rows_per_frame
    text = _TEXT_TOKENS["minimax_h3"]
    return {"packed": text + _MM_AUDIO_ROWS + video, "text": text, "audio": _MM_AUDIO_ROWS, "video": video}


def _helios_history_tokens() -> dict[str, int]:
    f, h, w = _GRIDS["helios"]

    def down(n: int, k: int) -> int:
        return -(-n // k)

    return {
        "history_short": _HELIOS_HISTORY_FRAMES["short"] * h * w,
        "history_mid": down(_HELIOS_HISTORY_FRAMES["mid"], 2) * down(h, 2) * down(w, 2),
        "history_long": down(_HELIOS_HISTORY_FRAMES["long"], 4) * down(h, 4) * down(w, 4),
    }


def token_counts(name: str) -> dict[str, int]:
    """Token counts of the default inputs (after patchify), for documentation and asserts.

    Keys: ``image``/``video`` (media tokens), ``text``; MiniMax-H3 adds ``audio`` and ``packed`` (the one sequence
    that CP splits); ChronoEdit adds ``image_embeds``; Helios adds ``history`` and ``total`` (the sequence its blocks
    see); LTX-2 adds ``audio``. Two counts are fixed by the model and may be even: ChronoEdit ``text`` (512, never
    split by CP) and Helios ``history`` (never split on its own); see :data:`UNSPLIT_COUNTS`.
    """
    _check_name(name)
    if name == "minimax_h3":
        return _minimax_rows()
    f, h, w = _GRIDS[name]
    media_key = "image" if name in ("flux", "flux2", "qwenimage") else "video"
    counts = {media_key: f * h * w, "text": _TEXT_TOKENS[name]}
    if name == "chronoedit":
        counts["image_embeds"] = _CHRONOEDIT_IMAGE_TOKENS
    if name == "helios":
        # History tokens (short + mid + long) are prepended to the current chunk; CP splits the whole sequence
        # ("total") and the current chunk ("video"), never the history on its own. It can't be odd as well: the short
        # history has 2 frames, and odd video + odd history would make the total even.
        counts["history"] = sum(_helios_history_tokens().values())
        counts["total"] = counts["video"] + counts["history"]
    if name == "ltx2":
        counts["audio"] = _LTX2_AUDIO_FRAMES
    return counts


# Helpers --------------------------------------------------------------------------------------------------------------


def _check_name(name: str) -> None:
    if name not in CONFIGS:
        raise KeyError(f"unknown tiny model {name!r}; expected one of {ALL_MODEL_NAMES}")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _key_padding_mask(batch_size: int, length: int) -> torch.Tensor:
    """1 = keep, 0 = pad. Sample 0 has its last two tokens padded, sample 1 (if any) its last one."""
    mask = torch.ones(batch_size, length, dtype=torch.long)
    for i in range(batch_size):
        mask[i, length - (2 if i % 2 == 0 else 1) :] = 0
    return mask


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Models ---------------------------------------------------------------------------------------------------------------


def build_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> ModelMixin:
    """Build the tiny model with deterministic weights from ``seed`` (global RNG state is left untouched).

    Weight init: diffusers' default init, then every ``nn.Linear`` / ``nn.Conv*`` weight is redrawn from
    ``N(0, (INIT_GAIN**2) / fan_in)`` and its bias from ``N(0, INIT_BIAS_STD**2)``. PyTorch's default init shrinks
    activations ~sqrt(3)x per linear, which, chained through several AdaLN gates, left some gradients (e.g. Flux's
    text-query path) ~1e-6: too small for an allclose to tell them from zero. Any parameter still all-zero after that
    (e.g. LayerNorm biases, zero-init embeddings) is redrawn from ``N(0, 0.02**2)``, so that no parameter starts at
    an exact zero. Structurally unused parameters (:data:`FROZEN_PARAMS`) get ``requires_grad=False``.
    """
    _check_name(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MODEL_CLASSES[name](**CONFIGS[name])
    gen = _generator(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
                fan_in = module.weight[0].numel()
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * INIT_GAIN / fan_in**0.5)
                if module.bias is not None:
                    module.bias.copy_(torch.randn(module.bias.shape, generator=gen) * INIT_BIAS_STD)
        for param in model.parameters():
            if not torch.any(param):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    frozen = [re.compile(p) for p in FROZEN_PARAMS.get(name, ())]
    for param_name, param in model.named_parameters():
        if any(p.fullmatch(param_name) for p in frozen):
            param.requires_grad_(False)
    if dtype != torch.float32:
        model = model.to(dtype=dtype)
    return model.train()


# Inputs ---------------------------------------------------------------------------------------------------------------


def build_inputs(
    name: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    with_text_mask: bool = False,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Keyword arguments for ``model(**inputs, return_dict=False)``, deterministic from ``seed``.

    Floating-point activations use ``dtype``; position ids / coordinates stay float32 or int64. Tensors are created
    on CPU and moved to ``device``.

    ``with_text_mask``: the default LTX / LTX-2 inputs pass ``encoder_attention_mask=None``; with ``True`` they get a
    key-padding text mask (1 = keep, 0 = pad) with padded positions, for the guard tests. Qwen-Image always gets a
    padded ``encoder_hidden_states_mask``. Other models have no text mask and raise ``ValueError`` when asked for one.
    """
    _check_name(name)
    if with_text_mask and name not in ("ltx", "ltx2", "qwenimage"):
        raise ValueError(f"{name} has no text attention mask input")
    builder = _INPUT_BUILDERS[name]
    inputs = builder(_generator(seed), dtype, with_text_mask)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def _timestep(gen: torch.Generator, batch_size: int, scale: float = 1.0) -> torch.Tensor:
    # distinct values in (0.1, 0.9) * scale
    return (torch.rand(batch_size, generator=gen) * 0.8 + 0.1) * scale


def _flux_inputs(gen: torch.Generator, dtype: torch.dtype, with_text_mask: bool) -> dict[str, Any]:
    cfg, bsz = CONFIGS["flux"], BATCH_SIZES["flux"]
    _, h, w = _GRIDS["flux"]
    txt = _TEXT_TOKENS["flux"]
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return {
        "hidden_states": _randn(gen, bsz, h * w, cfg["in_channels"], dtype=dtype),
        "encoder_hidden_states": _randn(gen, bsz, txt, cfg["joint_attention_dim"], dtype=dtype),
        "pooled_projections": _randn(gen, bsz, cfg["pooled_projection_dim"], dtype=dtype),
        "timestep": _timestep(gen, bsz).to(dtype),
        "guidance": torch.full((bsz,), 3.5).to(dtype),
        "img_ids": img_ids.reshape(h * w, 3),
        "txt_ids": torch.zeros(txt, 3),
    }


def _flux2_inputs(gen: torch.Generator, dtype: torch.dtype, with_text_mask: bool) -> dict[str, Any]:
    cfg, bsz = CONFIGS["flux2"], BATCH_SIZES["flux2"]
    _, h, w = _GRIDS["flux2"]
    txt = _TEXT_TOKENS["flux2"]
    # (t, h, w, l) coordinates, as Flux2Pipeline._prepare_latent_ids / _prepare_text_ids build them.
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(txt))
    return {
        "hidden_states": _randn(gen, bsz, h * w, cfg["in_channels"], dtype=dtype),
        "encoder_hidden_states": _randn(gen, bsz, txt, cfg["joint_attention_dim"], dtype=dtype),
        "timestep": _timestep(gen, bsz).to(dtype),
        "guidance": torch.full((bsz,), 4.0).to(dtype),
        "img_ids": img_ids.unsqueeze(0).expand(bsz, -1, -1),
        "txt_ids": txt_ids.unsqueeze(0).expand(bsz, -1, -1),
    }


def _qwen_inputs(gen: torch.Generator, dtype: torch.dtype, with_text_mask: bool) -> dict[str, Any]:
    cfg, bsz = CONFIGS["qwenimage"], BATCH_SIZES["qwenimage"]
    f, h, w = _GRIDS["qwenimage"]
    txt = _TEXT_TOKENS["qwenimage"]
    return {
        "hidden_states": _randn(gen, bsz, f * h * w, cfg["in_channels"], dtype=dtype),
        "encoder_hidden_states": _randn(gen, bsz, txt, cfg["joint_attention_dim"], dtype=dtype),
        "encoder_hidden_states_mask": _key_padding_mask(bsz, txt),
        "timestep": _timestep(gen, bsz).to(dtype),
        "img_shapes": [[(f, h, w)]] * bsz,
    }


def _wan_video(gen: torch.Generator, name: str, dtype: torch.dtype) -> torch.Tensor:
    cfg, bsz = CONFIGS[name], BATCH_SIZES[name]
    f, h, w = _GRIDS[name]
    p_t, p_h, p_w = cfg["patch_size"]
    return _randn(gen, bsz, cfg["in_channels"], f * p_t, h * p_h, w * p_w, dtype=dtype)


def _wan_inputs(gen: torch.Generator, dtype: torch.dtype, with_text_mask: bool) -> dict[str, Any]:
    cfg, bsz = CONFIGS["wan"], BATCH_SIZES["wan"]
    return {
        "hidden_states": _wan_video(gen, "wan", dtype),
        "encoder_hidden_states": _randn(gen, bsz, _TEXT_TOKENS["wan"], cfg["text_dim"], dtype=dtype),
        "timestep": _timestep(gen, bsz, 1000.0).to(dtype),
    }


def _chronoedit_inputs(gen: torch.Generator, dtype: torch.dtype, with_text_mask: bool) -> dict[str, Any]:
    cfg, bsz = CONFIGS["chronoedit"], BATCH_SIZES["chronoedit"]
    return {
        "hidden_states": _wan_video(gen, "chronoedit", dtype),
        "encoder_hidden_states": _randn(gen, bsz, _TEXT_TOKENS["chronoedit"], cfg["text_dim"], dtype=dtype),
        "encoder_hidden_states_image": _randn(gen, bsz, _CHRONOEDIT_IMAGE_TOKENS, cfg["image_dim"], dtype=dtype),
        "timestep": _timestep(gen, bsz, 1000.0).to(dtype),
    }


def _ltx_inputs(gen: torch.Generator, dtype: torch.dtype, with_text_mask: bool) -> dict[str, Any]:
    cfg, bsz = CONFIGS["ltx"], BATCH_SIZES["ltx"]
    f, h, w = _GRIDS["ltx"]
    txt = _TEXT_TOKENS["ltx"]
    return {
        "hidden_states": _randn(gen, bsz, f * h * w, cfg["in_channels"], dtype=dtype),
        "encoder_hidden_states": _randn(gen, bsz, txt, cfg["caption_channels"], dtype=dtype),
        "timestep": _timestep(gen, bsz, 1000.0).to(dtype),
        "encoder_attention_mask": _key_padding_mask(bsz, txt) if with_text_mask else None,
        "num_frames": f,
        "height": h,
        "width": w,
        # (vae temporal compression / frame rate, vae spatial compression, vae spatial compression), as LTXPipeline.
        "rope_interpolation_scale": (8 / 25, 32.0, 32.0),
    }


def _minimax_inputs(gen: torch.Generator, dtype: torch.dtype, with_text_mask: bool) -> dict[str, Any]:
    cfg, bsz = CONFIGS["minimax_h3"], BATCH_SIZES["minimax_h3"]
    rows = _minimax_rows()
    n_txt, n_aud, n_vid, seq = rows["text"], rows["audio"], rows["video"], rows["packed"]
    fh, fw = _MM_FRAME_GRID
    rows_per_frame = fh * fw
    n_cond = _MM_COND_FRAMES * rows_per_frame

    # The pipeline's packing: [text | audio | video] rows, conditioning video frame rows first.
    text_indices = torch.arange(n_txt)
    audio_indices = n_txt + torch.arange(n_aud)
    video_indices = n_txt + n_aud + torch.arange(n_vid)

    # 0 = video, 1 = text, 2 = audio
    token_tags = torch.empty(seq, dtype=torch.long)
    token_tags[text_indices] = 1
    token_tags[audio_indices] = 2
    token_tags[video_indices] = 0

    # Distinct noise levels, sorted as torch.unique returns them: conditioning video, audio, target video (+ text).
    timestep = torch.tensor([0.2, 0.55, 0.8])
    timestep_indices = torch.full((seq,), 2, dtype=torch.long)
    timestep_indices[audio_indices] = 1
    timestep_indices[video_indices[:n_cond]] = 0

    # (t, h, w) rotary coordinates: text on the time axis, media continuing the clock after the text.
    position_ids = torch.zeros(seq, 3)
    position_ids[text_indices, 0] = torch.arange(n_txt, dtype=torch.float32)
    position_ids[audio_indices, 0] = n_txt + torch.arange(n_aud, dtype=torch.float32)
    position_ids[audio_indices, 2] = float(fw - 1)
    frame_h, frame_w = torch.meshgrid(torch.arange(fh), torch.arange(fw), indexing="ij")
    frame_grid = torch.stack([frame_h.reshape(-1), frame_w.reshape(-1)], dim=-1).float()
    n_frames = _MM_COND_FRAMES + _MM_TARGET_FRAMES
    frame_t = torch.cat([torch.zeros(_MM_COND_FRAMES), torch.arange(_MM_TARGET_FRAMES, dtype=torch.float32)])
    position_ids[video_indices, 0] = n_txt + frame_t.repeat_interleave(rows_per_frame)
    position_ids[video_indices, 1:] = frame_grid.repeat(n_frames, 1)

    patch_dim = cfg["in_channels"] * cfg["patch_size"][0] * cfg["patch_size"][1] * cfg["patch_size"][2]
    return {
        "hidden_states": _randn(gen, bsz, n_vid, patch_dim, dtype=dtype),
        "audio_hidden_states": _randn(gen, bsz, n_aud, cfg["audio_in_channels"], dtype=dtype),
        "encoder_hidden_states": _randn(gen, bsz, n_txt, cfg["text_dim"], dtype=dtype),
        "timestep": timestep.to(dtype),
        "timestep_indices": timestep_indices,
        "token_tags": token_tags,
        "position_ids": position_ids,
        "video_indices": video_indices,
        "audio_indices": audio_indices,
        "text_indices": text_indices,
    }


def _helios_inputs(gen: torch.Generator, dtype: torch.dtype, with_text_mask: bool) -> dict[str, Any]:
    cfg, bsz = CONFIGS["helios"], BATCH_SIZES["helios"]
    f, h, w = _GRIDS["helios"]
    _, p_h, p_w = cfg["patch_size"]
    c, lat_h, lat_w = cfg["in_channels"], h * p_h, w * p_w
    n_long, n_mid, n_short = (_HELIOS_HISTORY_FRAMES[k] for k in ("long", "mid", "short"))
    # Frame indices as HeliosPipeline builds them: [prefix | long | mid | short-1x | current chunk].
    idx = torch.arange(1 + n_long + n_mid + (n_short - 1) + f)
    prefix, long_idx, mid_idx, short_1x, main_idx = idx.split([1, n_long, n_mid, n_short - 1, f])
    short_idx = torch.cat([prefix, short_1x])

    def batched(t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0).expand(bsz, -1)

    return {
        "hidden_states": _randn(gen, bsz, c, f, lat_h, lat_w, dtype=dtype),
        "timestep": _timestep(gen, bsz, 1000.0).to(dtype),
        "encoder_hidden_states": _randn(gen, bsz, _TEXT_TOKENS["helios"], cfg["text_dim"], dtype=dtype),
        "indices_hidden_states": batched(main_idx),
        "indices_latents_history_short": batched(short_idx),
        "indices_latents_history_mid": batched(mid_idx),
        "indices_latents_history_long": batched(long_idx),
        "latents_history_short": _randn(gen, bsz, c, n_short, lat_h, lat_w, dtype=dtype),
        "latents_history_mid": _randn(gen, bsz, c, n_mid, lat_h, lat_w, dtype=dtype),
        "latents_history_long": _randn(gen, bsz, c, n_long, lat_h, lat_w, dtype=dtype),
    }


def _ltx2_inputs(gen: torch.Generator, dtype: torch.dtype, with_text_mask: bool) -> dict[str, Any]:
    cfg, bsz = CONFIGS["ltx2"], BATCH_SIZES["ltx2"]
    f, h, w = _GRIDS["ltx2"]
    txt = _TEXT_TOKENS["ltx2"]
    mask = _key_padding_mask(bsz, txt) if with_text_mask else None
    return {
        "hidden_states": _randn(gen, bsz, f * h * w, cfg["in_channels"], dtype=dtype),
        "audio_hidden_states": _randn(gen, bsz, _LTX2_AUDIO_FRAMES, cfg["audio_in_channels"], dtype=dtype),
        "encoder_hidden_states": _randn(gen, bsz, txt, cfg["caption_channels"], dtype=dtype),
        "audio_encoder_hidden_states": _randn(gen, bsz, txt, cfg["caption_channels"], dtype=dtype),
        "timestep": _timestep(gen, bsz, 1000.0).to(dtype),
        "encoder_attention_mask": mask,
        "audio_encoder_attention_mask": None if mask is None else mask.clone(),
        "num_frames": f,
        "height": h,
        "width": w,
        "fps": 24.0,
        "audio_num_frames": _LTX2_AUDIO_FRAMES,
    }


_INPUT_BUILDERS: dict[str, Callable[[torch.Generator, torch.dtype, bool], dict[str, Any]]] = {
    "flux": _flux_inputs,
    "flux2": _flux2_inputs,
    "qwenimage": _qwen_inputs,
    "wan": _wan_inputs,
    "chronoedit": _chronoedit_inputs,
    "ltx": _ltx_inputs,
    "minimax_h3": _minimax_inputs,
    "helios": _helios_inputs,
    "ltx2": _ltx2_inputs,
}


def build_text_mask_inputs(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """LTX / LTX-2 inputs WITH a padded text key mask (for the guard test); same as ``with_text_mask=True``."""
    if name not in ("ltx", "ltx2"):
        raise ValueError(f"text-mask guard inputs are only defined for ltx and ltx2, not {name!r}")
    return build_inputs(name, seed=seed, dtype=dtype, with_text_mask=True)


# Outputs and loss -----------------------------------------------------------------------------------------------------


def output_tensors(name: str, out: Any) -> list[torch.Tensor]:
    """The output tensors of ``model(**inputs, return_dict=False)`` (or a returned output dataclass).

    One tensor for most models; ``[video, audio]`` for MiniMax-H3 and LTX-2.
    """
    _check_name(name)
    if isinstance(out, BaseOutput):
        out = out.to_tuple()
    if isinstance(out, torch.Tensor):
        out = (out,)
    n = _MULTI_OUTPUT.get(name, 1)
    tensors = list(out[:n])
    if len(tensors) != n or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{name}: expected {n} output tensor(s), got {type(out)}")
    return tensors


def make_target(shape: torch.Size | tuple[int, ...], seed: int, index: int = 0) -> torch.Tensor:
    """Fixed seeded float32 random target (created on CPU)."""
    return torch.randn(tuple(shape), generator=_generator(10_000 + 1_000 * seed + index))


def make_loss(name: str, outputs: list[torch.Tensor], seed: int = 0) -> torch.Tensor:
    """Sum over output tensors of the float32 MSE against a fixed seeded random target of the same shape."""
    _check_name(name)
    loss = outputs[0].new_zeros((), dtype=torch.float32)
    for i, out in enumerate(outputs):
        target = make_target(out.shape, seed, i).to(out.device)
        loss = loss + torch.nn.functional.mse_loss(out.float(), target)
    return loss


# Alias matching the brief's wording.
loss_fn = make_loss
