"""Tiny instances of any diffusers transformer, their forward inputs, and a trace of one forward: what the plan tools
(`python -m train.tools.draft_plan`, `python -m train.tools.check_plan`) and the CP tests run on.

A model is named by a diffusers class name or a local model folder (its `config.json`, or a pipeline folder's
`transformer/config.json`):

* a class a family in `train/models/` uses: the family's tiny config (its tiny recipe's `model.init_config`) and the
  inputs the trainer feeds it (:func:`family_case`: a synthetic batch of the family's tiny recipe shapes through
  train/step.py's `prepare`);
* a folder: its config with the repeated-block counts cut to at most 2 (:func:`shrink_config`), and the inputs of the
  family of its `_class_name`;
* otherwise (or to override the inputs) `--inputs module:function`, a callable taking the config dict and returning
  the forward kwargs; a class with no family then starts from its default config, shrunk (blocks <= 2, 7 heads).

Weights are diffusers' init redrawn deterministically from a seed (:func:`init_weights`), so every rank of a CP check
builds the same model without communicating.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from train.errors import UserError

REPO = Path(__file__).resolve().parents[2]

INIT_GAIN = 1.25  # see init_weights()
INIT_BIAS_STD = 0.05
TINY_HEADS = 7  # divisible by none of the CP degrees 2, 3 and 4 (train/models/tiny.py NUM_HEADS)
TINY_BLOCKS = 2
_BLOCK_COUNT_KEY = re.compile(r"(num_)?(\w+_)?(layers|blocks)")


# ------------------------------------------------------------------------------------------------ family inputs


@functools.cache
def tiny_recipe(name: str):
    """The family's tiny recipe (recipes/tiny/<family>.yaml), loaded through the one recipe schema."""
    from train.config import load_recipe

    return load_recipe(REPO / "recipes" / "tiny" / f"{name}.yaml")


def family_batch(
    name: str, seed: int = 0, dtype: torch.dtype = torch.float32, batch_size: int | None = None
) -> dict[str, torch.Tensor]:
    """A cached batch of the family's tiny recipe shapes, as the trainer collates it: synthetic items (seeded), whose
    text masks pad each sample's prompt to a different length. ``batch_size``: default the recipe's."""
    from train.data.dataset import collate
    from train.data.synthetic_latents import SyntheticLatentDataset

    recipe = tiny_recipe(name)
    size = recipe.train.batch_size if batch_size is None else batch_size
    data = SyntheticLatentDataset(size, dict(recipe.data.synthetic.shapes), seed=seed, dtype=dtype)
    return collate([data[i] for i in range(size)])


def family_case(
    name: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    batch_size: int | None = None,
    model_config: dict[str, Any] | None = None,
):
    """One training step's inputs for the family's tiny transformer (train/step.py `prepare`, the trainer's own: the
    pipeline's forward kwargs, with and without CP) on `family_batch`. ``model_config``: the transformer config the
    kwargs are built for (default: the family's tiny config)."""
    from train.models import get_family
    from train.models import tiny_config as family_tiny_config
    from train.step import Objective, prepare

    spec, recipe = get_family(name), tiny_recipe(name)
    batch = family_batch(name, seed, dtype, batch_size)
    objective = Objective.of(recipe, spec)
    config = family_tiny_config(name) if model_config is None else model_config
    return prepare(spec, batch, objective, torch.Generator().manual_seed(10_000 + seed), model_config=config)


# ------------------------------------------------------------------------------------------------------ weights


def init_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw the weights deterministically from ``seed`` (global RNG state untouched); returns ``model``.

    Every ``nn.Linear`` / ``nn.Conv*`` weight is drawn from ``N(0, INIT_GAIN**2 / fan_in)`` and its bias from
    ``N(0, INIT_BIAS_STD**2)``. PyTorch's default init shrinks activations ~sqrt(3)x per linear, which, chained through
    several AdaLN gates, left some gradients (e.g. Flux's text-query path) ~1e-6: too small for an allclose to tell
    them from zero. Any parameter still all-zero after that (LayerNorm biases, zero-init embeddings) is drawn from
    ``N(0, 0.02**2)``, so that no parameter starts at an exact zero.
    """
    gen = torch.Generator().manual_seed(seed + 1)
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
    return model


# ------------------------------------------------------------------------------------------------------ sources


InputsFn = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass
class ModelSource:
    """A model to probe: its class, the (tiny) config it is built with, and how its forward inputs are made."""

    target: str  # what the user named (class name or folder)
    cls: type
    config: dict[str, Any]
    family: str | None
    inputs_fn: InputsFn | None  # --inputs; None: the family's inputs
    shrunk: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # config key -> (was, now)
    prepare: Callable[[torch.nn.Module], None] | None = None  # applied to every built model (a check-only swap)

    @property
    def class_name(self) -> str:
        return self.cls.__name__

    def build(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """The tiny model, weights from ``seed``; a family's structurally unused parameters frozen."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.cls(**self.config)
        init_weights(model, seed)
        if self.prepare is not None:
            self.prepare(model)
        if self.family is not None:
            from train.models import family_module, get_family

            get_family(self.family).train_ready(model)  # what the family trains with (Kandinsky 5's float32 RoPE)
            unused = getattr(family_module(self.family), "unused_params", None)
            frozen = [re.compile(p) for p in (unused(model.config) if unused else ())]
            for name, param in model.named_parameters():
                if any(p.fullmatch(name) for p in frozen):
                    param.requires_grad_(False)
        return (model if dtype == torch.float32 else model.to(dtype=dtype)).train()

    def step_inputs(self, seed: int = 0, dtype: torch.dtype = torch.float32):
        """A family model's training-step inputs (train/step.py `StepInputs`: kwargs, noise, sigmas, for the family's
        own loss), deterministic from ``seed``; None for ``--inputs`` (no family: no objective)."""
        if self.inputs_fn is not None or self.family is None:
            return None
        # two samples whose prompts pad to different lengths: the case a per-sample mask must get right
        return family_case(self.family, seed, dtype, batch_size=2, model_config=self.config)

    def inputs(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """Forward kwargs, deterministic from ``seed`` (global RNG state untouched)."""
        if self.inputs_fn is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1_000 + seed)
                kwargs = self.inputs_fn(dict(self.config))
            return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
        assert self.family is not None
        return self.step_inputs(seed, dtype).kwargs


def _families_for(class_name: str) -> list[str]:
    from train.models import FAMILIES

    return sorted(name for name, spec in FAMILIES.items() if spec.transformer_class == class_name)


def _model_class(name: str, where: str) -> type:
    import diffusers
    from diffusers.models.modeling_utils import ModelMixin

    cls = getattr(diffusers, name, None)
    if isinstance(cls, type) and issubclass(cls, ModelMixin):
        return cls
    known = [n for n in dir(diffusers) if n.endswith("Model") or "Transformer" in n]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UserError(f"{where}: {name!r} is not a diffusers model class; {hint}name a class diffusers exports "
                    "(e.g. WanTransformer3DModel) or a local model folder")  # fmt: skip


def load_inputs_fn(spec: str) -> InputsFn:
    """``module:function`` (importable from the current directory) -> the callable."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise UserError(f"--inputs {spec!r}: expected module:function, e.g. my_inputs:skyreels_inputs")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"--inputs {spec!r}: cannot import {module_name} ({exc}); run from its folder") from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UserError(f"--inputs {spec!r}: {module_name} has no function {fn_name}")
    return fn


def shrink_config(config: dict[str, Any], *, heads: bool) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """The config with every repeated-block count (``num_layers``, ``num_single_layers``, ...) cut to at most
    TINY_BLOCKS and, with ``heads``, ``num_attention_heads`` set to TINY_HEADS (the head dim kept, so RoPE layouts
    stay valid). Returns (config, {key: (was, now)})."""
    out, changed = dict(config), {}
    for key, value in config.items():
        if isinstance(value, int) and not isinstance(value, bool) and _BLOCK_COUNT_KEY.fullmatch(key):
            if value > TINY_BLOCKS:
                out[key], changed[key] = TINY_BLOCKS, (value, TINY_BLOCKS)
    if heads and isinstance(config.get("num_attention_heads"), int) and config["num_attention_heads"] != TINY_HEADS:
        out["num_attention_heads"] = TINY_HEADS
        changed["num_attention_heads"] = (config["num_attention_heads"], TINY_HEADS)
    return out, changed


def _default_config(cls: type) -> dict[str, Any]:
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in params if p.name != "self" and p.default is not inspect.Parameter.empty}


def resolve_source(target: str, inputs: str | None = None, family: str | None = None) -> ModelSource:
    """The model named by ``target`` (a diffusers class name or a local model folder); see the module docstring.
    Raises UserError (one line) for an unknown class, a folder without a config, a class with no way to make inputs."""
    inputs_fn = load_inputs_fn(inputs) if inputs else None
    path = Path(target).expanduser()
    if path.is_dir() or "/" in target or target.startswith("."):
        config_file = next((f for f in (path / "config.json", path / "transformer" / "config.json") if f.is_file()),
                           None)  # fmt: skip
        if not path.is_dir():
            raise UserError(f"{target}: no such folder; name a diffusers class or a local model folder")
        if config_file is None:
            raise UserError(f"{target}: no config.json (nor transformer/config.json) in this folder; point at a "
                            "diffusers model folder (save_pretrained output) or a pipeline folder")  # fmt: skip
        raw = json.loads(config_file.read_text())
        if "_class_name" not in raw:
            raise UserError(f"{config_file}: no _class_name key; is this a diffusers model config?")
        cls = _model_class(raw["_class_name"], str(config_file))
        config, shrunk = shrink_config({k: v for k, v in raw.items() if not k.startswith("_")}, heads=False)
    else:
        cls = _model_class(target, "model")
        config, shrunk = None, {}
    families = _families_for(cls.__name__)
    if family is not None and family not in families:
        raise UserError(f"--family {family}: that family's transformer is not a {cls.__name__} "
                        f"(families with this class: {', '.join(families) or 'none'})")  # fmt: skip
    family = family or (families[0] if families else None)
    if family is None and inputs_fn is None:
        raise UserError(
            f"{cls.__name__} has no family in train/models/ to build tiny inputs from: pass --inputs "
            "module:function (a callable taking the config dict, returning the forward kwargs)"
        )
    if config is None:
        if family is not None:
            from train.models import tiny_config

            config = tiny_config(family)
        else:
            config, shrunk = shrink_config(_default_config(cls), heads=True)
    return ModelSource(target, cls, config, family, inputs_fn, shrunk)


# ---------------------------------------------------------------------------------------------------------- trace


def flatten_tensors(value: Any, name: str) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a tensor or a (nested once) tuple/list of tensors: ``name`` / ``name[i]``."""
    if torch.is_tensor(value):
        return [(name, value)]
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{i}]", v) for i, v in enumerate(value) if torch.is_tensor(v)]
    return []


def bind_inputs(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """forward()'s arguments by name (positional ones mapped through the signature)."""
    names = [p for p in inspect.signature(type(module).forward).parameters][1:]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def as_outputs(output: Any) -> list[Any]:
    """A module's outputs by index, as diffusers' split/gather hooks index them (a bare tensor is output 0)."""
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (list, tuple)):
        return list(output)
    if hasattr(output, "to_tuple"):
        return list(output.to_tuple())
    return []


@dataclass
class Call:
    """One module's first call in a traced forward."""

    path: str
    module: torch.nn.Module
    start: int  # order of the pre-hook
    end: int = -1  # order of the post-hook
    inputs: dict[str, Any] = field(default_factory=dict)  # bound forward() arguments (references)
    outputs: list[Any] = field(default_factory=list)


def trace(model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[dict[str, Call], Any]:
    """Run ``model(**kwargs)`` once (no grad) and record every module's first call: path -> Call, plus the output."""
    calls: dict[str, Call] = {}
    counter = iter(range(10**9))
    handles = []
    for path, module in model.named_modules():

        def pre(mod, args, kw, path=path):
            if path not in calls:
                calls[path] = Call(path, mod, next(counter), inputs=bind_inputs(mod, args, kw))

        def post(mod, args, kw, out, path=path):
            call = calls.get(path)
            if call is not None and call.end < 0:
                call.end, call.outputs = next(counter), as_outputs(out)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            out = model(**kwargs, return_dict=False)
    finally:
        for h in handles:
            h.remove()
    return calls, out
