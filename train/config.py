"""Typed training recipes: nested dataclasses loaded from YAML, overridden with `--set a.b=c`.

The dataclasses below are the schema, and the one place each setting is documented: the string literal right under a
field is its documentation (`field_docs` reads it back for `--help`/`--list-keys`). Nothing else re-declares the
schema: loading, `--set` overrides, saving and the wandb config all walk `dataclasses.fields` and the annotations.

    recipe = load_recipe("recipes/tiny/flux.yaml", ["train.lr=1e-4", "parallel.cp=2", "finetune.lora_targets=[to_q]"])

Loading is strict. Every value is checked against its annotation (`int` takes ints only, not `true`; `float` takes
ints and floats; `Literal` must be one of its values; `X | None`; `list[T]`; `dict[str, Any]`; a nested section from a
mapping), unknown keys are errors with a "did you mean" suggestion and the valid keys, and a few cross-field basics
(learning rate > 0, LoRA rank >= 1, ...) are checked too. All problems are collected and raised together as one
`RecipeError` (a `ValueError`), one line each: `<file>: <dotted.path>: <problem>`.

The YAML dialect is YAML 1.2-like where 1.1 surprises: `1e-4` is a float (1.1 reads it as a string) and only
`true`/`false` are booleans (1.1 reads `no`, `off`, `yes`, `on` as booleans, so `mixed_precision: no` works).
Duplicate keys are errors.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = [
    "FAMILIES",
    "CheckpointConfig",
    "DataConfig",
    "FinetuneConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "Recipe",
    "RecipeError",
    "SyntheticData",
    "TrainConfig",
    "add_recipe_args",
    "field_docs",
    "load_recipe",
    "recipe_from_args",
    "recipe_from_dict",
    "recipe_help",
    "recipe_to_dict",
    "save_recipe",
]

Family = Literal["flux", "flux2", "qwenimage", "wan", "chronoedit", "ltx", "minimax_h3"]
FAMILIES: tuple[str, ...] = typing.get_args(Family)

# -------------------------------------------------------------------------------------------------------------- schema


@dataclass
class ModelConfig:
    """Which transformer to fine-tune and how to load it."""

    family: Family
    """Model family; selects the transformer class, its CP plan, LoRA targets and conditioning inputs."""
    pretrained_path: str | None = None
    """A diffusers pipeline folder or hub id to load the transformer (and, for prepare, the VAE/text encoders) from."""
    subfolder: str = "transformer"
    """Subfolder of `pretrained_path` that holds the transformer weights."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of `pretrained_path`; null = the default branch."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype the transformer weights are loaded (or randomly initialised) in."""
    init_config: dict[str, Any] | None = None
    """Random-initialise the transformer from these constructor kwargs instead of loading weights (tiny CPU recipes)."""
    attention_backend: str = "native"
    """diffusers attention backend name (e.g. native, flash, _native_cudnn)."""
    cp_plan: str | None = None
    """CP plan file to use; null = the plan shipped in cp_plans/ for the transformer class."""

    def _problems(self) -> list[tuple[str, str]]:
        if self.pretrained_path is None and self.init_config is None:
            return [("pretrained_path", "set pretrained_path (weights to load) or init_config (random init), or both")]
        return []


@dataclass
class ParallelConfig:
    """Device mesh: dp_replicate x dp_shard x cp must equal the world size."""

    cp: int = 1
    """Context-parallel degree: ranks that split each sample's sequence (Ulysses)."""
    dp_shard: int = -1
    """Data-parallel ranks that shard parameters (FSDP); -1 = whatever is left of the world size."""
    dp_replicate: int = 1
    """Data-parallel replicas of the sharded group (HSDP across nodes); 1 = no replication."""
    fsdp: bool = True
    """Shard parameters with FSDP2 over dp_shard x cp; false = replicate them and all-reduce gradients."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after forward (less memory, one more all-gather in backward)."""
    cp_transport: Literal["torch", "symm_mem"] = "torch"
    """CP all-to-all transport: torch (all_to_all_single) or symm_mem (intra-node CUDA, self-tested, else torch)."""

    def resolve(self, world_size: int) -> tuple[int, int, int]:
        """(dp_replicate, dp_shard, cp) for `world_size` ranks, with dp_shard = -1 filled in.

        Raises ValueError, with the numbers, when the degrees do not multiply to the world size.
        """
        rep, shard, cp = self.dp_replicate, self.dp_shard, self.cp
        if world_size < 1:
            raise ValueError(f"parallel: world size must be >= 1, got {world_size}")
        if rep < 1 or cp < 1 or (shard < 1 and shard != -1):
            raise ValueError(
                f"parallel: dp_replicate ({rep}) and cp ({cp}) must be >= 1 and dp_shard ({shard}) >= 1 or -1"
            )
        if shard == -1:
            if world_size % (rep * cp):
                raise ValueError(
                    f"parallel: world size {world_size} is not divisible by dp_replicate ({rep}) x cp ({cp}) = "
                    f"{rep * cp}; choose dp_replicate and cp whose product divides {world_size}"
                )
            shard = world_size // (rep * cp)
        if rep * shard * cp != world_size:
            raise ValueError(
                f"parallel: dp_replicate ({rep}) x dp_shard ({shard}) x cp ({cp}) = {rep * shard * cp}, but the world "
                f"size is {world_size}; change them to multiply to {world_size}, or set dp_shard: -1 to use the rest"
            )
        return rep, shard, cp

    def _problems(self) -> list[tuple[str, str]]:
        out = [(name, "must be >= 1") for name in ("cp", "dp_replicate") if getattr(self, name) < 1]
        if self.dp_shard < 1 and self.dp_shard != -1:
            out.append(("dp_shard", f"must be >= 1 or -1 (the rest of the world size), got {self.dp_shard}"))
        return out


@dataclass
class TrainConfig:
    """Optimisation: steps, batch, optimizer, schedule, timestep sampling and loss."""

    max_steps: int = 1000
    """Number of optimizer steps to train for."""
    batch_size: int = 1
    """Samples per micro-batch per data-parallel group (the cp ranks of a group share the same samples)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warmup: constant, linear to 0, or cosine to 0 at max_steps."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to lr."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value; null = no clipping."""
    seed: int = 42
    """Seed for parameter init, data order, noise and timesteps."""
    gradient_checkpointing: bool = False
    """Recompute transformer block activations in backward (less memory, about one more forward of compute)."""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """Autocast: auto = bf16 on GPU and fp32 on CPU; no = off; bf16 = always bf16."""
    timestep_sampling: Literal["logit_normal", "uniform", "mode"] = "logit_normal"
    """Distribution of training timesteps (flow matching sigmas) in [0, 1]."""
    logit_mean: float = 0.0
    """logit_normal: mean of the normal that is squashed by a sigmoid."""
    logit_std: float = 1.0
    """logit_normal: standard deviation of that normal."""
    mode_scale: float = 1.29
    """mode: scale of the SD3 mode sampling (0 = uniform)."""
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none"
    """Per-timestep weight of the flow-matching loss (SD3 weighting schemes)."""
    caption_dropout: float = 0.0
    """Probability of replacing a sample's caption with the empty caption (for classifier-free guidance)."""

    def _problems(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for name in ("max_steps", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                out.append((name, f"must be >= 1, got {getattr(self, name)}"))
        for name in ("lr", "eps", "logit_std"):
            if not getattr(self, name) > 0:
                out.append((name, f"must be > 0, got {getattr(self, name)}"))
        if self.warmup_steps < 0:
            out.append(("warmup_steps", f"must be >= 0, got {self.warmup_steps}"))
        if self.weight_decay < 0:
            out.append(("weight_decay", f"must be >= 0, got {self.weight_decay}"))
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            out.append(("betas", f"must be two numbers in [0, 1), got {self.betas}"))
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            out.append(("max_grad_norm", f"must be > 0 or null (no clipping), got {self.max_grad_norm}"))
        if not 0 <= self.caption_dropout <= 1:
            out.append(("caption_dropout", f"must be in [0, 1], got {self.caption_dropout}"))
        return out


@dataclass
class FinetuneConfig:
    """What is trained: every weight, or LoRA adapters."""

    method: Literal["full", "lora"] = "lora"
    """full = train every transformer weight; lora = train low-rank adapters only."""
    lora_rank: int = 16
    """LoRA rank r."""
    lora_alpha: float = 16.0
    """LoRA alpha; adapter outputs are scaled by alpha / rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_targets: list[str] | None = None
    """Module names (peft target_modules) that get adapters; null = the family's default targets."""

    def _problems(self) -> list[tuple[str, str]]:
        if self.method != "lora":
            return []
        out: list[tuple[str, str]] = []
        if self.lora_rank < 1:
            out.append(("lora_rank", f"must be >= 1 for method: lora, got {self.lora_rank}"))
        if not self.lora_alpha > 0:
            out.append(("lora_alpha", f"must be > 0, got {self.lora_alpha}"))
        if not 0 <= self.lora_dropout < 1:
            out.append(("lora_dropout", f"must be in [0, 1), got {self.lora_dropout}"))
        if self.lora_targets is not None and not self.lora_targets:
            out.append(("lora_targets", "is empty; list module names, or null for the family's defaults"))
        return out


@dataclass
class SyntheticData:
    """Random latents and text embeddings, for tiny recipes before a cache exists."""

    num_samples: int = 8
    """Number of distinct random samples (the epoch length)."""
    shapes: dict[str, list[int]] = field(default_factory=dict)
    """Per-sample shape of each tensor the family reads (spec batch_keys); *_mask keys: bool, last quarter padded."""

    def _problems(self) -> list[tuple[str, str]]:
        out = [("num_samples", f"must be >= 1, got {self.num_samples}")] if self.num_samples < 1 else []
        out += [(f"shapes.{k}", f"dims must be >= 1, got {v}") for k, v in self.shapes.items() if min(v, default=0) < 1]
        return out


@dataclass
class DataConfig:
    """Training data: the latent/embedding cache, the media it is prepared from, and loading."""

    cache_dir: str | None = None
    """Folder of cached latents and text embeddings, written by `python -m train.prepare`."""
    source: str | None = None
    """Media folder or datasets name that `train.prepare` encodes into cache_dir."""
    caption_column: str = "text"
    """Column (datasets) or sidecar key (media folder) holding each sample's caption."""
    height: int = 512
    """Pixel height media is resized/cropped to before encoding."""
    width: int = 512
    """Pixel width media is resized/cropped to before encoding."""
    num_frames: int = 1
    """Frames per video clip (1 for images)."""
    fps: float | None = None
    """Frame rate clips are resampled to; null = keep the source rate."""
    max_text_tokens: int | None = None
    """Truncate/pad captions to this many tokens; null = the family's default."""
    synthetic: SyntheticData | None = None
    """Train on random latents/embeddings of these shapes instead of cache_dir; null = use the cache."""
    buckets: list[str] | None = None
    """Clip shapes FxHxW items are sorted into (most frames, then closest aspect); null = num_frames×height×width."""
    max_bad_fraction: float = 0.1
    """train.prepare fails when more than this fraction of the source items is unreadable or unusable."""
    allow_upscale: bool = False
    """Upscale media smaller than its bucket instead of skipping it as too_small."""
    latent_sample: Literal["sample", "mode"] = "sample"
    """Cache a seeded posterior sample (seed from train.seed and the item index) or the posterior mean."""
    cache_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """dtype of the cached tensors; null = model.dtype."""
    text_encoder_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """dtype the text encoders run in during prepare (the VAE always runs in fp32); null = model.dtype."""
    split: str = "train"
    """datasets split read when data.source is a dataset."""
    media_column: str | None = None
    """Column or metadata key holding the media; null = the first Image/Video feature, else file_name."""
    num_workers: int = 0
    """DataLoader worker processes (and decode threads during prepare)."""
    shuffle: bool = True
    """Shuffle sample order each epoch."""

    def _problems(self) -> list[tuple[str, str]]:
        out = [
            (n, f"must be >= 1, got {getattr(self, n)}")
            for n in ("height", "width", "num_frames")
            if getattr(self, n) < 1
        ]
        if self.fps is not None and not self.fps > 0:
            out.append(("fps", f"must be > 0 or null, got {self.fps}"))
        if self.max_text_tokens is not None and self.max_text_tokens < 1:
            out.append(("max_text_tokens", f"must be >= 1 or null, got {self.max_text_tokens}"))
        if self.num_workers < 0:
            out.append(("num_workers", f"must be >= 0, got {self.num_workers}"))
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            out.append(("max_bad_fraction", f"must be in [0, 1], got {self.max_bad_fraction}"))
        return out


@dataclass
class LoggingConfig:
    """Metrics: wandb and the console progress bar."""

    wandb_project: str = "ctxtrain"
    """wandb project name."""
    wandb_run: str | None = None
    """wandb run name; null = the recipe name."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """wandb mode: online uploads, offline writes ./wandb for a later `wandb sync`, disabled logs nothing."""
    every_n_steps: int = 1
    """Log metrics every this many optimizer steps."""
    progress_bar: bool = True
    """Show a tqdm progress bar on rank 0."""

    def _problems(self) -> list[tuple[str, str]]:
        return [("every_n_steps", f"must be >= 1, got {self.every_n_steps}")] if self.every_n_steps < 1 else []


@dataclass
class CheckpointConfig:
    """Training-state checkpoints and the final export."""

    every_n_steps: int = 0
    """Save a resumable checkpoint every this many optimizer steps; 0 = off."""
    keep_last: int = 2
    """Number of most recent checkpoints kept in output_dir/checkpoints."""
    resume: bool = False
    """Continue from the latest checkpoint in output_dir/checkpoints (start fresh when there is none)."""
    export: Literal["auto", "full", "lora", "none"] = "auto"
    """Final weights written to output_dir: auto = what was trained (lora adapters or the full transformer)."""

    def _problems(self) -> list[tuple[str, str]]:
        out = []
        if self.every_n_steps < 0:
            out.append(("every_n_steps", f"must be >= 0 (0 = off), got {self.every_n_steps}"))
        if self.keep_last < 1:
            out.append(("keep_last", f"must be >= 1, got {self.keep_last}"))
        return out


@dataclass
class Recipe:
    """A complete training run."""

    model: ModelConfig
    """The transformer to fine-tune."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Device mesh and sharding."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation and loss."""
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    """Full fine-tuning or LoRA."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics logging."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and export."""
    output_dir: str = "outputs/run"
    """Folder for checkpoints, exported weights and the resolved recipe."""
    name: str | None = None
    """Run name; null = the recipe file's stem (filled in by load_recipe)."""

    def _problems(self) -> list[tuple[str, str]]:
        if self.checkpoint.export == "lora" and self.finetune.method != "lora":
            return [("checkpoint.export", "is lora but finetune.method is full; use auto or full")]
        return []


# ---------------------------------------------------------------------------------------------------------------- YAML

_FLOAT_12 = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT_TAG = "tag:yaml.org,2002:float"


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (`1e-4`) and booleans (only true/false), rejecting duplicate keys."""


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL_TAG, _FLOAT_TAG)]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL_TAG, _BOOL_12, list("tTfF"))
_Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_12, list("-+0123456789."))


def _construct_unique_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (str, int, float, bool, type(None))):
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes strings either YAML 1.1 or our loader would read as non-strings (`no`, `1e-4`)."""


_Dumper.yaml_implicit_resolvers = {ch: list(rs) for ch, rs in yaml.SafeDumper.yaml_implicit_resolvers.items()}
_Dumper.add_implicit_resolver(_FLOAT_TAG, _FLOAT_12, list("-+0123456789."))


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects


# ---------------------------------------------------------------------------------------------------------- validation


class RecipeError(ValueError):
    """Invalid recipe; `errors` holds one `<source>: <dotted.path>: <problem>` line per problem."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        head = self.errors[0] if len(self.errors) == 1 else f"{len(self.errors)} problems in the recipe:"
        super().__init__(head if len(self.errors) == 1 else "\n  ".join([head, *self.errors]))


_INVALID = object()  # a value that failed validation (its error is already recorded)
_Errors = list[tuple[str, str]]  # (dotted path, problem)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})" if value is not None else "null"


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _type_name(tp: Any) -> str:
    """Human-readable expected type for error messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "anything"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _suggest(word: Any, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _convert(value: Any, tp: Any, path: str, errors: _Errors) -> Any:
    """`value` checked against annotation `tp` (floats widened, sections built); `_INVALID` after recording errors."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return copy.deepcopy(value)
    if dataclasses.is_dataclass(tp):
        return _convert_section(value, tp, path, errors)
    if _is_union(tp):
        if value is None:
            if type(None) in args:
                return None
            errors.append((path, f"expected {_type_name(tp)}, got null"))
            return _INVALID
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:  # X | None: nested errors as they are, a mismatch of the value itself says "or null"
            scratch = []
            out = _convert(value, arms[0], path, scratch)
            errors.extend(
                (p, f"expected {_type_name(tp)}, got {_show(value)}")
                if p == path and m.startswith("expected ")
                else (p, m)
                for p, m in scratch
            )
            return out
        for arm in arms:  # first arm that accepts the value wins
            scratch: _Errors = []
            out = _convert(value, arm, path, scratch)
            if not scratch:
                return out
        errors.append((path, f"expected {_type_name(tp)}, got {_show(value)}"))
        return _INVALID
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        hint = _suggest(value, [str(a) for a in args]) if isinstance(value, str) else ""
        errors.append((path, f"expected {_type_name(tp)}, got {_show(value)}{hint}"))
        return _INVALID
    if origin is list:
        if not isinstance(value, (list, tuple)):
            errors.append((path, f"expected {_type_name(tp)}, got {_show(value)}"))
            return _INVALID
        items = [_convert(v, args[0] if args else Any, f"{path}[{i}]", errors) for i, v in enumerate(value)]
        return _INVALID if any(v is _INVALID for v in items) else items
    if origin is dict or tp is dict:
        key_tp, val_tp = args if args else (Any, Any)
        if not isinstance(value, Mapping):
            errors.append((path, f"expected {_type_name(tp)}, got {_show(value)}"))
            return _INVALID
        out = {}
        for k, v in value.items():
            key = _convert(k, key_tp, f"{path} key", errors)
            val = _convert(v, val_tp, _join(path, str(k)), errors)
            out[key] = val
        return _INVALID if any(v is _INVALID for v in (*out.keys(), *out.values())) else out
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover - a schema annotation this validator does not know
        raise TypeError(f"{path}: unsupported annotation {tp!r} in the recipe schema")
    if not ok:
        errors.append((path, f"expected {_type_name(tp)}, got {_show(value)}"))
        return _INVALID
    return value


def _convert_section(value: Any, cls: type, path: str, errors: _Errors) -> Any:
    """A section dataclass from a mapping; its cross-field checks run when all of its own fields are valid."""
    if isinstance(value, cls):
        value = recipe_to_dict(value)
    if not isinstance(value, Mapping):
        errors.append((path or "recipe", f"expected a mapping of {cls.__name__} keys, got {_show(value)}"))
        return _INVALID
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in value:
        if key not in fields:
            valid = f"valid keys{' of ' + path if path else ''}: " + ", ".join(fields)
            errors.append((_join(path, str(key)), f"unknown key{_suggest(key, fields)}; {valid}"))
    kwargs, ok = {}, True
    for name, f in fields.items():
        if name in value:
            converted = _convert(value[name], hints[name], _join(path, name), errors)
            if converted is _INVALID:
                ok = False
            else:
                kwargs[name] = converted
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errors.append((_join(path, name), f"missing required key ({_type_name(hints[name])})"))
            ok = False
    if not ok:
        return _INVALID
    obj = cls(**kwargs)
    problems = getattr(obj, "_problems", None)
    for sub, message in problems() if problems else ():
        errors.append((_join(path, sub), message))
    return obj


def _format(source: str, errors: _Errors) -> list[str]:
    return [f"{source}: {path}: {message}" if path else f"{source}: {message}" for path, message in errors]


# ------------------------------------------------------------------------------------------------------------ overrides


def _unwrap_optional(tp: Any) -> Any:
    if _is_union(tp):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1:
            return arms[0]
    return tp


def _override_type(key: str) -> tuple[Any, str | None]:
    """The annotation at dotted `key` (keys inside dict fields allowed), or (None, why it is not a recipe key)."""
    tp: Any = Recipe
    parts = key.split(".")
    for i, part in enumerate(parts):
        inner, here = _unwrap_optional(tp), ".".join(parts[:i])
        if not part:
            return None, "empty key component"
        if dataclasses.is_dataclass(inner):
            names = [f.name for f in dataclasses.fields(inner)]
            if part not in names:
                where = f" of {here}" if here else ""
                return None, f"unknown key{_suggest(part, names)}; valid keys{where}: " + ", ".join(names)
            tp = _hints(inner)[part]
        elif typing.get_origin(inner) is dict or inner is dict:
            tp = (typing.get_args(inner) or (Any, Any))[1]
        elif inner is Any:
            tp = Any
        else:
            return None, f"{here} is {_type_name(tp)} and has no sub-keys"
    return tp, None


def _apply_overrides(data: dict, overrides: Iterable[str], errors: _Errors) -> None:
    """Merge `KEY=VALUE` overrides into the raw recipe mapping `data`, after checking each against the schema."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            errors.append((item, "expected KEY=VALUE, e.g. train.lr=1e-4"))
            continue
        tp, why = _override_type(key)
        if why:
            errors.append((key, why))
            continue
        try:
            value = _yaml_load(raw)
        except yaml.YAMLError as e:
            errors.append((key, f"value {raw!r} is not valid YAML: {e}"))
            continue
        scratch: _Errors = []
        _convert(value, tp, key, scratch)
        if scratch:
            errors.extend(scratch)
            continue
        node = data
        *parents, last = key.split(".")
        for part in parents:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                break  # the file has a non-mapping here: its own validation reports it
        else:
            node[last] = value


# ------------------------------------------------------------------------------------------------------------------ API


def recipe_from_dict(d: Mapping[str, Any], source: str = "<dict>") -> Recipe:
    """A validated Recipe from a (YAML-shaped) mapping; raises RecipeError listing every problem."""
    errors: _Errors = []
    recipe = _convert_section(d, Recipe, "", errors)
    if errors or recipe is _INVALID:
        raise RecipeError(_format(source, errors))
    return recipe


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> Recipe:
    """Load a recipe YAML file, apply `--set` style overrides ("train.lr=1e-4", "finetune.lora_targets=[to_q,to_k]")."""
    source = str(path)
    try:
        data = _yaml_load(Path(path).read_text())
    except OSError as e:
        raise RecipeError([f"{source}: cannot read recipe: {e.strerror or e}"]) from e
    except yaml.YAMLError as e:
        raise RecipeError([f"{source}: invalid YAML: {e}"]) from e
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise RecipeError([f"{source}: expected a mapping of recipe sections, got {_show(data)}"])
    override_errors: _Errors = []
    _apply_overrides(data, list(overrides), override_errors)
    errors: _Errors = []
    recipe = _convert_section(data, Recipe, "", errors)
    lines = _format("--set", override_errors) + _format(source, errors)
    if lines or recipe is _INVALID:
        raise RecipeError(lines)
    if recipe.name is None:
        recipe.name = Path(path).stem
    return recipe


def recipe_to_dict(r: Any) -> Any:
    """Plain (YAML/JSON-safe) nested dict of a recipe or any of its sections."""
    if dataclasses.is_dataclass(r) and not isinstance(r, type):
        return {f.name: recipe_to_dict(getattr(r, f.name)) for f in dataclasses.fields(r)}
    if isinstance(r, (list, tuple)):
        return [recipe_to_dict(v) for v in r]
    if isinstance(r, Mapping):
        return {k: recipe_to_dict(v) for k, v in r.items()}
    return r


def save_recipe(r: Recipe, path: str | Path) -> None:
    """Write the (resolved) recipe as YAML that `load_recipe` reads back to an equal Recipe."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.dump(recipe_to_dict(r), Dumper=_Dumper, sort_keys=False, default_flow_style=False))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring literal written right under it in the class body (parsed with ast)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def recipe_help(cls: type = Recipe, prefix: str = "") -> str:
    """Every recipe key, one per line: `dotted.key (type, default X): docs` (sections expanded), for --list-keys."""
    lines = []
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp, key = _hints(cls)[f.name], prefix + f.name
        section = _unwrap_optional(tp)
        if dataclasses.is_dataclass(section):
            default = "null" if f.default is None else "section"
            lines.append(f"{key}: ({default}) {docs.get(f.name, '')}")
            lines.append(recipe_help(section, key + "."))
            continue
        if f.default is not dataclasses.MISSING:
            default = (
                f"default {yaml.safe_dump(f.default, default_flow_style=True).strip().removesuffix('...').strip()}"
            )
        elif f.default_factory is not dataclasses.MISSING:
            default = f"default {f.default_factory()}"
        else:
            default = "required"
        lines.append(f"{key} ({_type_name(tp)}; {default}): {docs.get(f.name, '')}")
    return "\n".join(lines)


class _ListKeys(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(recipe_help())
        parser.exit()


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    """Add `--recipe PATH`, repeatable `--set KEY=VALUE` and `--list-keys`; `recipe_from_args` loads the result."""
    parser.add_argument("--recipe", required=True, metavar="PATH", help="recipe YAML file (see recipes/)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, value in YAML (e.g. train.lr=1e-4, finetune.lora_targets=[to_q,to_k], "
        "model.cp_plan=null); repeatable; --list-keys shows every key",
    )
    parser.add_argument("--list-keys", action=_ListKeys, help="list every recipe key with its type, default and docs")


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """The recipe named by `--recipe`, with the `--set` overrides applied (after `add_recipe_args`)."""
    return load_recipe(args.recipe, args.set)
