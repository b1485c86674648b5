"""Tiny random-init diffusers transformers plus matching forward inputs: the test fixtures of the CP tests.

Families (``train/models/<family>/``, discovered): the model is the family's tiny transformer (``tiny_config``) and its
inputs are one training step's, built the way the trainer builds them: a synthetic cached batch of the family's tiny
recipe shapes (``recipes/tiny/<family>.yaml``) through train/step.py's ``prepare`` (probe.py :func:`family_case`: the
pipeline's own kwargs, with and without CP), and the trainer's loss (:func:`family_loss`). Every tiny model has 7
attention heads (divisible by none of the CP degrees 2, 3 and 4) of dim 8, and the recipes' shapes make every token
count that CP splits uneven for 2, 3 and 4 (``tests/test_tiny_models.py`` checks it on the tensors the plan splits).

Guard models (Helios): diffusers transformers whose CP training is refused, not families. Their tiny configs and
inputs are written here. (LTX-2, once configured here, is the ``ltx2`` family now.)

Usage::

    model = build_model("flux")
    inputs = build_inputs("flux")            # a family: spec.forward_kwargs of a synthetic batch
    outputs = output_tensors("flux", model(**inputs, return_dict=False))
    make_loss("flux", outputs).backward()    # MSE against a fixed random target (any model)

Parameters that a family's forward never uses (its package's ``unused_params``, e.g. Qwen-Image's last-block text
stream) are frozen by :func:`build_model`; every other parameter gets a gradient that is not None and not all zeros.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput

from train.models import family_module, family_names, get_family
from train.models import tiny_config as family_tiny_config
from train.models.tiny import HEAD_DIM, INNER_DIM, NUM_HEADS, TEXT_DIM  # noqa: F401 (re-exported sizes)
from train.tools.probe import INIT_BIAS_STD, INIT_GAIN, family_case, init_weights, tiny_recipe  # noqa: F401

REPO = Path(__file__).resolve().parents[1]

FAMILY_NAMES: tuple[str, ...] = family_names()
# Models whose CP training is expected to be refused (guard tests): not families, configured here.
GUARD_MODEL_NAMES: tuple[str, ...] = ("helios",)
# Models that are not families but train under CP in the tests (model-level parity): none since LTX-2 is a family.
TRAINED_MODEL_NAMES: tuple[str, ...] = ()
OTHER_MODEL_NAMES: tuple[str, ...] = GUARD_MODEL_NAMES + TRAINED_MODEL_NAMES  # configured here, not families
ALL_MODEL_NAMES: tuple[str, ...] = FAMILY_NAMES + OTHER_MODEL_NAMES


# Families -------------------------------------------------------------------------------------------------------------


# tiny_recipe and family_case live in probe.py (the plan tools build family inputs too).


def family_loss(case, out: Any, model_config: Any) -> torch.Tensor:
    """The trainer's loss of a family's output (train/step.py `loss_of`; float64 for float64 predictions)."""
    from train.step import Objective, loss_of

    return loss_of(case.spec, case, out, Objective(), model_config=model_config)


# Guard models ---------------------------------------------------------------------------------------------------------

# Helios is built on Wan's blocks: the tiny config of the family whose transformer is Wan's text-to-video class.
_WAN_LAYOUT = next(n for n in family_names() if get_family(n).transformer_class == "WanTransformer3DModel")
GUARD_CONFIGS: dict[str, dict[str, Any]] = {
    # Wan's block layout (its tiny config, less its rope length) with Helios' multi-term memory.
    "helios": {k: v for k, v in family_tiny_config(_WAN_LAYOUT).items() if k != "rope_max_seq_len"}
    | dict(
        num_layers=1,
        rope_dim=(4, 2, 2),  # sums to HEAD_DIM
        guidance_cross_attn=True,
        zero_history_timestep=True,
        has_multi_term_memory_patch=True,
    ),
}
GUARD_CLASSES = {"helios": "HeliosTransformer3DModel"}
_GUARD_BATCH = 1
_GUARD_GRID = (5, 1, 7)  # (frames, height, width) in tokens after patchify
_GUARD_TEXT = 7
# Helios: main chunk (5 frames) + short (2 frames) / mid (2 frames) / long (4 frames) history latents.
_HELIOS_HISTORY_FRAMES = {"long": 4, "mid": 2, "short": 2}
# (model, token_counts key) pairs that are not split by CP on their own and may be divisible by 2, 3 or 4.
UNSPLIT_COUNTS: frozenset[tuple[str, str]] = frozenset({("helios", "history")})


def _helios_history_tokens() -> dict[str, int]:
    f, h, w = _GUARD_GRID

    def down(n: int, k: int) -> int:
        return -(-n // k)

    return {
        "history_short": _HELIOS_HISTORY_FRAMES["short"] * h * w,
        "history_mid": down(_HELIOS_HISTORY_FRAMES["mid"], 2) * down(h, 2) * down(w, 2),
        "history_long": down(_HELIOS_HISTORY_FRAMES["long"], 4) * down(h, 4) * down(w, 4),
    }


def _guard_token_counts(name: str) -> dict[str, int]:
    f, h, w = _GUARD_GRID
    counts = {"video": f * h * w, "text": _GUARD_TEXT}
    if name == "helios":
        # History tokens (short + mid + long) are prepended to the current chunk; CP splits the whole sequence
        # ("total") and the current chunk ("video"), never the history on its own. It can't be odd as well: the short
        # history has 2 frames, and odd video + odd history would make the total even.
        counts["history"] = sum(_helios_history_tokens().values())
        counts["total"] = counts["video"] + counts["history"]
    return counts


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def _timestep(gen: torch.Generator, batch_size: int, scale: float = 1.0) -> torch.Tensor:
    # distinct values in (0.1, 0.9) * scale
    return (torch.rand(batch_size, generator=gen) * 0.8 + 0.1) * scale


def _helios_inputs(gen: torch.Generator, dtype: torch.dtype, with_text_mask: bool) -> dict[str, Any]:
    if with_text_mask:
        raise ValueError("helios has no text attention mask input")
    cfg, bsz = GUARD_CONFIGS["helios"], _GUARD_BATCH
    f, h, w = _GUARD_GRID
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
        "encoder_hidden_states": _randn(gen, bsz, _GUARD_TEXT, cfg["text_dim"], dtype=dtype),
        "indices_hidden_states": batched(main_idx),
        "indices_latents_history_short": batched(short_idx),
        "indices_latents_history_mid": batched(mid_idx),
        "indices_latents_history_long": batched(long_idx),
        "latents_history_short": _randn(gen, bsz, c, n_short, lat_h, lat_w, dtype=dtype),
        "latents_history_mid": _randn(gen, bsz, c, n_mid, lat_h, lat_w, dtype=dtype),
        "latents_history_long": _randn(gen, bsz, c, n_long, lat_h, lat_w, dtype=dtype),
    }


_GUARD_INPUTS = {"helios": _helios_inputs}


# Any model ------------------------------------------------------------------------------------------------------------


def _check_name(name: str) -> None:
    if name not in ALL_MODEL_NAMES:
        raise KeyError(f"unknown tiny model {name!r}; expected one of {ALL_MODEL_NAMES}")


def tiny_config(name: str) -> dict[str, Any]:
    """The tiny transformer config: a family's (``train.models.tiny_config``) or a guard model's."""
    _check_name(name)
    return family_tiny_config(name) if name in FAMILY_NAMES else dict(GUARD_CONFIGS[name])


def model_class(name: str) -> type[ModelMixin]:
    _check_name(name)
    class_name = get_family(name).transformer_class if name in FAMILY_NAMES else GUARD_CLASSES[name]
    return getattr(diffusers, class_name)


def batch_size(name: str) -> int:
    """Samples per batch of the default inputs: the tiny recipe's train.batch_size for a family."""
    _check_name(name)
    return tiny_recipe(name).train.batch_size if name in FAMILY_NAMES else _GUARD_BATCH


def frozen_params(name: str, config: Any) -> tuple[str, ...]:
    """Regexes of parameters the forward never uses (a family package's ``unused_params``; none for guard models)."""
    unused = getattr(family_module(name), "unused_params", None) if name in FAMILY_NAMES else None
    return () if unused is None else tuple(unused(config))


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> ModelMixin:
    """Build the tiny model with deterministic weights from ``seed`` (global RNG state is left untouched).

    Weight init: diffusers' default init, then every ``nn.Linear`` / ``nn.Conv*`` weight is redrawn from
    ``N(0, (INIT_GAIN**2) / fan_in)`` and its bias from ``N(0, INIT_BIAS_STD**2)``. PyTorch's default init shrinks
    activations ~sqrt(3)x per linear, which, chained through several AdaLN gates, left some gradients (e.g. Flux's
    text-query path) ~1e-6: too small for an allclose to tell them from zero. Any parameter still all-zero after that
    (e.g. LayerNorm biases, zero-init embeddings) is redrawn from ``N(0, 0.02**2)``, so that no parameter starts at
    an exact zero. Structurally unused parameters (:func:`frozen_params`) get ``requires_grad=False``.
    """
    config = tiny_config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(name)(**config)
    init_weights(model, seed)
    if name in FAMILY_NAMES:
        get_family(name).train_ready(model)  # what the family trains with (Kandinsky 5's float32 RoPE)
    frozen = [re.compile(p) for p in frozen_params(name, model.config)]
    for param_name, param in model.named_parameters():
        if any(p.fullmatch(param_name) for p in frozen):
            param.requires_grad_(False)
    if dtype != torch.float32:
        model = model.to(dtype=dtype)
    return model.train()


def build_inputs(
    name: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    with_text_mask: bool = False,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Keyword arguments for ``model(**inputs, return_dict=False)``, deterministic from ``seed``.

    A family: ``family_case(...).kwargs``, the pipeline's own kwargs (the same with and without CP; text masks as
    the pipeline passes them). A guard model: its inputs (``with_text_mask``: a guard model without one refuses it; a
    family always has its own masks and ignores it). Tensors are created on CPU and moved to ``device``.
    """
    _check_name(name)
    if name in FAMILY_NAMES:
        inputs = family_case(name, seed, dtype).kwargs
    else:
        inputs = _GUARD_INPUTS[name](torch.Generator().manual_seed(seed), dtype, with_text_mask)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def token_counts(name: str) -> dict[str, int]:
    """Token counts of the default inputs, for documentation (tables, logs).

    A family: its media tokens (``image``/``video``: ``spec.tokens_per_sample``, MiniMax-H3's audio rows included)
    and ``text`` (the text the default inputs feed). Guard models: ``video``, ``text``; Helios adds ``history`` and
    ``total`` (the sequence its blocks see).
    """
    _check_name(name)
    if name not in FAMILY_NAMES:
        return _guard_token_counts(name)
    case = family_case(name)
    media = case.spec.tokens_per_sample({s: x[1:] for s, x in case.shapes.items()}, tiny_config(name))
    text = case.kwargs.get("encoder_hidden_states")
    # Z-Image takes one caption per sample, its padding dropped: the longest kept caption
    count = text.shape[1] if torch.is_tensor(text) else int(case.batch["prompt_mask"].sum(-1).max())
    return {case.spec.latent_kind: media, "text": int(count)}


# Outputs and loss -----------------------------------------------------------------------------------------------------


def output_tensors(name: str, out: Any) -> list[torch.Tensor]:
    """The output tensors of ``model(**inputs, return_dict=False)`` (or a returned output dataclass): one per
    noised stream of a family ([video, audio] for MiniMax-H3 and LTX-2)."""
    _check_name(name)
    if isinstance(out, BaseOutput):
        out = out.to_tuple()
    if isinstance(out, torch.Tensor):
        out = (out,)
    n = len(get_family(name).streams) if name in FAMILY_NAMES else {"helios": 1}[name]
    out = tuple(torch.stack(o) if isinstance(o, list) else o for o in out)  # Z-Image: one tensor per sample
    tensors = list(out[:n])
    if len(tensors) != n or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{name}: expected {n} output tensor(s), got {type(out)}")
    return tensors


def make_target(shape: torch.Size | tuple[int, ...], seed: int, index: int = 0) -> torch.Tensor:
    """Fixed seeded float32 random target (created on CPU)."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(10_000 + 1_000 * seed + index))


def make_loss(name: str, outputs: list[torch.Tensor], seed: int = 0) -> torch.Tensor:
    """Sum over output tensors of the float32 MSE against a fixed seeded random target of the same shape."""
    _check_name(name)
    loss = outputs[0].new_zeros((), dtype=torch.float32)
    for i, out in enumerate(outputs):
        target = make_target(out.shape, seed, i).to(out.device)
        loss = loss + torch.nn.functional.mse_loss(out.float(), target)
    return loss
