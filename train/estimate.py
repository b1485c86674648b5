"""Will it fit? Predict the memory per rank of a recipe before launching it, and suggest the smallest change that fits.

    python -m train.estimate --recipe recipes/wan/14b_lora.yaml --gpus 16 --gpu-memory 80GiB
    python -m train.estimate --calibrate [family ...]      # re-measure train/models/<family>/calibration.json

Per rank: parameters, gradients and optimizer state (counted exactly on a meta-device build of the family's real
transformer config, LoRA included, sharded over the FSDP group dp_shard × cp as FSDP2 pads dim 0), the FSDP2 working
set (the gathered blocks in flight and the root that stays gathered), activations (per block × blocks, the
checkpointed blocks keeping only their inputs), the CP all-to-all buffers, and the peak: the larger of forward/backward
and the optimizer step.

Activation bytes come from a calibration MEASURED per family on CPU (`--calibrate`): a mid-size instance of the
family's transformer (the config and synthetic shapes in its calibration.json, `instance`) runs forward under
`saved_tensors_hooks` (unique storages, parameters excluded) and forward + backward under a live-storage tracker
(`LiveBytes`), at four (image tokens, text tokens) points per precision (fp32; bf16 autocast as on GPU) and method
(full; LoRA on the family's targets, whose frozen linears save less). Each quantity is fitted as
`a·N + b·N² + t·T + c` and stored per unit of width (the blocks' linear in+out features; the hidden size for a
block's input), so it transfers to the real config. torch's CPU SDPA runs its flash kernel (saves out + LSE): the
fitted b is ~0, as on GPU flash/cudnn/efficient kernels; for backends that materialise the scores (`_native_math`,
eager) the estimate adds heads × Sq × Skv per attention call, counted in the calibration.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import hashlib
import json
import math
import re
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from train import optim
from train.config import Recipe, add_recipe_args, recipe_from_args
from train.errors import UserError

GIB = 2**30
MODELS_DIR = Path(__file__).resolve().parent / "models"
CALIBRATION_VERSION = 1  # bump when what `calibrate` measures changes: every calibration.json is then stale
# A prediction "clearly exceeds" the device when it is over by more than the estimate's validated error (±15% on CPU,
# tests/test_estimate.py): refusing inside that band would refuse runs that fit.
REFUSE_MARGIN = 0.15
# Backends whose attention saves the (heads, Sq, Skv) probabilities for backward; the others save out + LSE only.
SCORE_BACKENDS = ("_native_math", "eager")
EMA = "EMA of the trained weights (fp32)"  # train/ema.py


# --------------------------------------------------------------------------------------------------- live storage


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive on `device_type`, and their peak, over what runs inside the mode.

    Allocator-agnostic (what `torch.distributed._tools.mem_tracker.MemTracker` does, without its per-module
    snapshots): every op's outputs are tracked by storage (a weak reference frees them), and
    `UntypedStorage.resize_` (how FSDP2 frees and re-allocates gathered parameters) is patched to update the count.
    Storages created before entering, or outside the dispatcher, are not seen."""

    def __init__(self, device_type: str = "cpu", exclude: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.exclude = exclude  # bytes not to count in the peak (e.g. the gradients alive now), polled per op
        self.sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.current = 0
        self.peak = 0
        self._orig_resize = torch.UntypedStorage.resize_

    def _freed(self, box: list[int], _ref: Any) -> None:
        self.current -= box[0]

    def track(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type or t.is_meta:
            return
        st = t.untyped_storage()
        if st in self.sizes:
            return
        box = [st.nbytes()]
        self.sizes[st] = (box, weakref.ref(st, lambda r, box=box: self._freed(box, r)))
        self.current += box[0]

    def _update_peak(self) -> None:
        self.peak = max(self.peak, self.current - (self.exclude() if self.exclude else 0))

    def reset_peak(self) -> None:
        self.peak = 0
        self._update_peak()

    def __enter__(self) -> LiveBytes:
        tracker, orig = self, self._orig_resize

        def resize_(st: torch.UntypedStorage, size: int) -> None:
            orig(st, size)
            entry = tracker.sizes.get(st)
            if entry is not None:
                tracker.current += st.nbytes() - entry[0][0]
                entry[0][0] = st.nbytes()
                tracker._update_peak()

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which this mode then sees
        out = func(*args, **(kwargs or {}))
        # an output sharing an input's storage (a view, an in-place or out= op) allocated nothing: a view of a storage
        # made before entering (a parameter) must not count as new
        given = {t.untyped_storage()._cdata for t in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and not t.is_meta}  # fmt: skip
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage()._cdata not in given:
                self.track(t)
        self._update_peak()
        return out


# --------------------------------------------------------------------------------------------------- model shape


def _padded_shard_numel(shape: Sequence[int], shards: int) -> int:
    """Elements FSDP2 allocates per rank for one parameter: dim 0 padded to a multiple of the group size."""
    if not shape:
        return 1
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / shards) * rest


def _linear_width(module: torch.nn.Module) -> int:
    """Σ (in + out) features of the nn.Linear layers in `module` (LoRA's own small linears excluded): the unit that
    per-token activation bytes scale with (each linear saves its input, the activations between them are as wide)."""
    width = 0
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Linear) and ".lora_" not in f".{name}":
            width += m.in_features + m.out_features
    return width


def _heads_and_inner_dim(spec: Any, config: Mapping[str, Any]) -> tuple[int, int]:
    """(attention heads, the width of the token stream: what a checkpointed block keeps per token, heads × head dim),
    read from the config as the family names them (`FamilySpec.attention_shape`)."""
    heads, head_dim = spec.attention_shape(config)
    return heads, heads * head_dim


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a recipe's model holds, counted on the meta device (per parameter: numel, dtype, trainable, in a block)."""

    # (shape, element size, trainable, block index or -1, floating: False for fp8 codes, which no cast touches)
    params: tuple[tuple[tuple[int, ...], int, bool, int, bool], ...]
    n_blocks: int
    linear_width: float  # mean Σ(in+out) linear features per block
    inner_dim: int
    heads: int

    @functools.cached_property
    def _by_block(self) -> dict[int, list[tuple[tuple[int, ...], int, bool, bool]]]:
        """The parameters grouped by block (-1: outside the blocks): `select(block=b)` reads one group, not all."""
        groups: dict[int, list[tuple[tuple[int, ...], int, bool, bool]]] = {}
        for s, e, tr, b, f in self.params:
            groups.setdefault(b, []).append((s, e, tr, f))
        return groups

    def select(
        self, trainable: bool | None = None, block: int | None = None
    ) -> list[tuple[tuple[int, ...], int, bool]]:
        groups = self._by_block.values() if block is None else [self._by_block.get(block, [])]
        return [(s, e, f) for g in groups for s, e, tr, f in g if trainable is None or tr == trainable]

    def numel(self, trainable: bool | None = None) -> int:
        return sum(math.prod(s) for s, _, _ in self.select(trainable))


def model_shape(recipe: Recipe) -> ModelShape:
    """The recipe's transformer built on the meta device (the family's real config), LoRA / full applied."""
    from train.modeling import apply_finetune, family_spec, meta_transformer
    from train.parallel import repeated_blocks

    spec = family_spec(recipe.model)
    model = meta_transformer(recipe.model, spec)
    apply_finetune(model, recipe.finetune, spec, recipe.train.master_weights)
    blocks = repeated_blocks(model)
    where = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
    params = tuple((tuple(p.shape), p.element_size(), p.requires_grad, where.get(id(p), -1), p.is_floating_point())
                   for p in model.parameters())  # fmt: skip
    width = sum(_linear_width(b) for b in blocks) / max(len(blocks), 1)
    config = model.config
    heads, inner = _heads_and_inner_dim(spec, config)
    return ModelShape(params, len(blocks), width, inner, heads)


# ------------------------------------------------------------------------------------------------- tokens per sample


def sample_tokens(recipe: Recipe) -> tuple[int, int]:
    """(transformer tokens of the noised streams after patching, text tokens) of one sample at the recipe's
    resolution: from `data.synthetic.shapes` through the spec's `tokens_per_sample`, else from the largest bucket
    (of the caches trained on, `cache_buckets`; before they exist, data.buckets or the recipe's
    num_frames × height × width) and the family's size rules (`Geometry`: spatial multiple =
    VAE stride × patch, frames period × offset), as `train.prepare.check_geometry` checks them."""
    from train.data.media import Bucket
    from train.models import get_encoder

    m, data = recipe.model, recipe.data
    if data.synthetic is not None:
        return _tokens_at(recipe, None, None, None), data.synthetic.shapes["prompt_embeds"][0]
    # a hub id is not fetched for an estimate: the family's published strides (a local folder gives its own)
    local = m.pretrained_path is not None and Path(m.pretrained_path).expanduser().is_dir()
    encoder = get_encoder(m.family)
    g = encoder.geometry(m.pretrained_path if local else None, m.revision)
    # the caches trained on, not the recipe's data.height/width/num_frames (a cache holds the sizes it was prepared at)
    names = cache_buckets(recipe) or data.resolved(m).buckets
    buckets = [Bucket.parse(x) for x in names]
    g.check(buckets)  # what train.prepare.check_geometry checks
    tokens = max(_tokens_at(recipe, b.frames, b.height, b.width) for b in buckets)
    return tokens, encoder.text_tokens(data.max_text_tokens) or encoder.default_text_tokens


def cache_buckets(recipe: Recipe) -> list[str]:
    """The buckets holding samples in the caches the trainer reads (data.cache_dir, or each of data.datasets'), from
    their manifests; none for synthetic data, or when data.cache_dir holds no cache yet (an estimate before
    train.prepare: then the recipe's buckets are what prepare will write). A mixture's caches must exist."""
    from train.data.dataset import CacheMissingError, read_manifest

    data = recipe.data
    if data.synthetic is not None:
        return []
    names: set[str] = set()
    for cache in data.cache_dirs():
        try:
            manifest = read_manifest(cache)
        except CacheMissingError:
            if data.datasets is not None:
                raise
            return []
        names.update(b for b, n in manifest.get("buckets", {}).items() if n)
    return sorted(names)


def _tokens_at(recipe: Recipe, frames: int | None, height: int | None, width: int | None) -> int:
    """Transformer tokens of one sample of `frames` × `height` × `width` pixels (the family's latent shapes, patched);
    the synthetic shapes' tokens with synthetic data; the largest bucket's when no size is given."""
    from train.modeling import family_spec
    from train.models import get_encoder, transformer_config

    m, data = recipe.model, recipe.data
    spec = family_spec(m)
    config = transformer_config(m.family, init_config=m.init_config, pretrained_path=m.pretrained_path,
                                subfolder=m.subfolder)  # fmt: skip
    if data.synthetic is not None:
        return spec.tokens_per_sample({s: data.synthetic.shapes[s] for s in spec.streams}, config)
    if height is None or width is None:
        return sample_tokens(recipe)[0]
    return spec.tokens_per_sample(get_encoder(m.family).latent_shapes(frames, height, width, data.fps), config)


# ------------------------------------------------------------------------------------------------------ calibration


def calibration_path(family: str) -> Path:
    return MODELS_DIR / family / "calibration.json"


def _instance_hash(family: str, instance: Mapping[str, Any]) -> str:
    from train.models import get_family

    key = {"family": family, "class": get_family(family).transformer_class, "instance": instance,
           "version": CALIBRATION_VERSION, "torch": torch.__version__.split("+")[0]}  # fmt: skip
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def load_calibration(family: str) -> dict[str, Any]:
    path = calibration_path(family)
    if not path.is_file():
        raise ValueError(f"no activation calibration for family {family!r} ({path}); run "
                         f"`python -m train.estimate --calibrate {family}`")  # fmt: skip
    return json.loads(path.read_text())


def calibration_status(family: str) -> str | None:
    """None when the family's calibration.json is present and measured for its current instance; else why not."""
    path = calibration_path(family)
    if not path.is_file():
        return f"{path} is missing"
    data = json.loads(path.read_text())
    if "fit" not in data:
        return f"{path} has no fit (never calibrated)"
    if data.get("hash") != _instance_hash(family, data["instance"]):
        return f"{path} is stale (its instance, the transformer class, torch or CALIBRATION_VERSION changed)"
    return None


def _scaled_shapes(instance: Mapping[str, Any], grid: int, text: int) -> dict[str, list[int]]:
    """The instance's synthetic shapes with the latent grid's last axis × `grid` (and every tensor on the latents'
    spatial grid alike, whatever its channels and frames: Wan VACE's control latents, Wan Animate's pose latents) and
    the text length × `text`."""
    base = instance["shapes"]
    out = {}
    for key, shape in base.items():
        shape = list(shape)
        if len(shape) == len(base["latents"]) and shape[-2:] == base["latents"][-2:]:
            shape[-1] *= grid
        elif key.startswith("prompt") or key.endswith("_prompt_embeds"):  # LTX-2's audio prompt: the same text
            shape[0] *= text
        out[key] = shape
    return out


def _forward_kwargs(family: str, model: torch.nn.Module, shapes: Mapping[str, list[int]], dtype: torch.dtype):
    """One sample's training-step kwargs (train/step.py) at the calibration shapes, and its transformer tokens."""
    from train.data.dataset import collate
    from train.data.synthetic_latents import SyntheticLatentDataset
    from train.models import get_family
    from train.step import Objective, prepare

    spec = get_family(family)
    batch = collate([SyntheticLatentDataset(1, dict(shapes), 0, dtype)[0]])
    inputs = prepare(spec, batch, Objective(), torch.Generator().manual_seed(0), model_config=model.config)
    latents = {s: batch[s].shape[1:] for s in spec.streams}
    return inputs.kwargs, spec.tokens_per_sample(latents, model.config)


def _measure(
    family: str, instance: Mapping[str, Any], method: str, precision: str, grid: int, text: int, with_peak: bool
) -> dict[str, float]:
    """One calibration point: per-block saved bytes, a block's own inputs, saved bytes outside the blocks, the
    activation peak of forward + backward above params and grads (plain, then with every block checkpointed), and
    the attention score elements per block (heads × Sq × Skv summed over its SDPA calls)."""
    import diffusers

    from train.config import FinetuneConfig
    from train.modeling import apply_finetune
    from train.models import get_family
    from train.parallel import repeated_blocks

    spec = get_family(family)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    model = getattr(diffusers, spec.transformer_class).from_config(instance["config"]).to(dtype).train()
    model.set_attention_backend("native")
    apply_finetune(model, FinetuneConfig(method=method), spec, "fp32")
    if precision == "bf16":
        model.to(dtype)  # what FSDP2's param_dtype gives the compute on GPU (LoRA's fp32 adapters too)
    shapes = _scaled_shapes(instance, grid, text)
    kwargs, tokens = _forward_kwargs(family, model, shapes, dtype)
    text_tokens = shapes["prompt_embeds"][0]
    blocks = repeated_blocks(model)
    params = {p.untyped_storage()._cdata for p in model.parameters()} | {b.untyped_storage()._cdata
                                                                         for b in model.buffers()}  # fmt: skip
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()

    # 1. saved tensors, by storage, attributed to the block (or the outside) that first saved them
    seen: set[int] = set()
    current = [-1]  # the block running now, -1 outside the blocks
    saved = [0] * (len(blocks) + 1)  # per block; the last entry is outside the blocks
    inputs = [0] * len(blocks)
    scores = [0] * len(blocks)

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in params and st._cdata not in seen:
            seen.add(st._cdata)
            saved[current[0]] += st.nbytes()
        return t

    class CountScores(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in func.__name__ and current[0] >= 0:
                q, k = args[0], args[1]  # (B, H, Sq, D), (B, H, Skv, D)
                scores[current[0]] += q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
            return func(*args, **(kwargs or {}))

    def enter(i: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kw: dict) -> None:
            current[0] = i
            fresh = [t.untyped_storage().nbytes() for t in torch.utils._pytree.tree_leaves((args, kw))
                     if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen]  # fmt: skip
            inputs[i] = max(fresh, default=0)  # the hidden states (text, temb, rope were saved by block 0 already)

        return hook

    def leave(module: torch.nn.Module, args: tuple, out: Any) -> None:
        current[0] = -1

    handles = [b.register_forward_pre_hook(enter(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(leave) for b in blocks]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), CountScores(), amp:
        model(**kwargs, return_dict=False)
    for h in handles:
        h.remove()

    n = len(blocks)
    row = {"tokens": tokens, "text": text_tokens, "block": sum(saved[:-1]) / n, "input": sum(inputs[1:]) / (n - 1),
           "outside": saved[-1], "scores": sum(scores) / n}  # fmt: skip
    if not with_peak:
        return row

    row["peak"], row["peak_ckpt"] = _peaks(model, kwargs, amp, blocks)
    return row


def _peaks(model: torch.nn.Module, kwargs: dict, amp: Any, blocks: list[torch.nn.Module]) -> tuple[int, int]:
    """The peak of forward + backward above the parameters and the gradients alive at each moment: plain, then with
    every block checkpointed (the levers are left applied)."""
    from train.parallel import apply_activation_levers

    grads = [0]
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(0, grads[0] + p.grad.nbytes))

    def peak() -> int:
        gc.collect()
        grads[0] = 0
        with LiveBytes(exclude=lambda: grads[0]) as live:
            with amp:
                out = model(**kwargs, return_dict=False)
            loss = sum(o.float().square().mean() for o in torch.utils._pytree.tree_leaves(out)
                       if isinstance(o, torch.Tensor))  # fmt: skip
            del out
            loss.backward()
        model.zero_grad(set_to_none=True)
        return live.peak

    plain = peak()
    apply_activation_levers(blocks, checkpoint_every=1, offload=False, compile=False)
    return plain, peak()


# Calibration points, (latent grid ×, text ×) of the instance's shapes: bytes are fitted on the first four (N, N², T,
# 1: exact there), attention score elements (forward only, cheap) on all six (N, N², T, T², N·T, 1: joint attention
# over N + T tokens has them all).
POINTS = ((1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (1, 3))
BYTES_FEATURES = ("N", "N2", "T", "1")
SCORE_FEATURES = ("N", "N2", "T", "T2", "NT", "1")


def _features(n: float, t: float) -> dict[str, float]:
    return {"N": n, "N2": n * n, "T": t, "T2": t * t, "NT": n * t, "1": 1.0}


def _fit(rows: list[dict[str, float]], key: str, unit: float, features: Sequence[str]) -> dict[str, float]:
    """Least-squares coefficients of `key` per `unit` of width on `features`."""
    import numpy as np

    a = np.array([[_features(r["tokens"], r["text"])[f] for f in features] for r in rows], dtype=np.float64)
    y = np.array([r[key] / unit for r in rows], dtype=np.float64)
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    return {f: float(c) for f, c in zip(features, coef, strict=True)}


def _eval(fit: Mapping[str, float], n: float, t: float) -> float:
    x = _features(n, t)
    return sum(c * x[f] for f, c in fit.items())


def calibrate(family: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure the family's instance (calibration.json `instance`) and write the fit back into the file."""
    import diffusers
    from diffusers.utils import logging as dlogging

    from train.config import FinetuneConfig
    from train.modeling import apply_finetune
    from train.models import get_family
    from train.parallel import repeated_blocks

    dlogging.set_verbosity_error()  # the dtype-cast and attention-backend notes, once per point
    path = calibration_path(family)
    data = json.loads(path.read_text())
    instance = data["instance"]
    spec = get_family(family)
    with torch.device("meta"):
        meta = getattr(diffusers, spec.transformer_class).from_config(instance["config"])
    apply_finetune(meta, FinetuneConfig(method="lora"), spec, "fp32")
    blocks = repeated_blocks(meta)
    width = sum(_linear_width(b) for b in blocks) / len(blocks)
    heads, inner = _heads_and_inner_dim(spec, instance["config"])
    fit: dict[str, Any] = {}
    for precision in ("fp32", "bf16"):
        for method in ("full", "lora"):
            rows = [_measure(family, instance, method, precision, g, t, i < len(BYTES_FEATURES))
                    for i, (g, t) in enumerate(POINTS)]  # fmt: skip
            n_blocks, all_rows, rows = len(blocks), rows, rows[: len(BYTES_FEATURES)]
            for r in rows:  # what forward + backward adds on top of the saved activations (gradients in flight, ...)
                r["work"] = r["peak"] - n_blocks * r["block"] - r["outside"]
                r["work_ckpt"] = r["peak_ckpt"] - n_blocks * r["input"] - r["outside"]
            fit[f"{precision}/{method}"] = {
                **{k: _fit(rows, k, width, BYTES_FEATURES) for k in ("block", "outside", "work", "work_ckpt")},
                "input": _fit(rows, "input", inner, BYTES_FEATURES),
                "scores": _fit(all_rows, "scores", heads, SCORE_FEATURES),
                "points": [{k: int(v) for k, v in r.items()} for r in all_rows],
            }
            r = rows[2]
            log(f"{family} {precision}/{method}: {r['tokens']} tokens + {r['text']} text: block "
                f"{r['block'] / 2**20:.1f}"
                f" MiB saved, input {r['input'] / 2**20:.2f} MiB, outside {r['outside'] / 2**20:.1f} MiB, work "
                f"{r['work'] / 2**20:.1f} MiB (checkpointed {r['work_ckpt'] / 2**20:.1f} MiB)")  # fmt: skip
    data.update(hash=_instance_hash(family, instance), width={"linear": width, "inner": inner, "heads": heads},
                fit=fit)  # fmt: skip
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


# -------------------------------------------------------------------------------------------------------- estimate


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes per rank, by component; `peak` is the larger of forward/backward and the optimizer step."""

    components: dict[str, float]
    peak: float
    first_step_peak: float  # the first step's: AdamW creates its state in the optimizer step, after backward
    host: dict[str, float]  # host memory per rank: offloaded activations; the sharded state under CPU offload
    all_to_all: float  # CP all-to-all bytes sent per rank per optimizer step
    tokens: int  # per sample, after patching
    text: int
    layout: str
    compute: float = 1.0  # the step's compute relative to the same step without train.preservation's forwards

    def table(self, device_gib: float | None) -> str:
        lines = [f"{self.layout}; {self.tokens:,} tokens + {self.text} text tokens per sample"]
        lines += [f"  {name:<34}{b / GIB:9.2f} GiB" for name, b in self.components.items()]
        lines.append(f"  {'predicted peak':<34}{self.peak / GIB:9.2f} GiB")
        if device_gib is not None:
            lines.append(f"  {'device memory':<34}{device_gib:9.2f} GiB")
        lines += [f"  {'host: ' + name:<34}{b / GIB:9.2f} GiB" for name, b in self.host.items()]
        lines.append(f"  {'CP all-to-all sent per step':<34}{self.all_to_all / GIB:9.2f} GiB")
        if self.compute != 1.0:
            lines.append(f"  {'compute (train.preservation)':<34}{self.compute:9.2f} x the step without it")
        return "\n".join(lines)


# What a GPU needs beyond the step's tensors, which no CPU measurement sees (CUDA only), each a constant and its source:
# - the CUDA context (driver, lazily loaded kernels: ~300 MB since CUDA 11.7, pytorch/pytorch#107667; nvidia-smi
#   showed 0.2-0.7 GB for it, #28113 and #37250) plus cuBLAS / cuDNN handles and workspaces: 0.5 GiB per process;
# - NCCL's buffers per communicator: NCCL_BUFFSIZE (4 MiB by default) for each channel's send and receive
#   connection, ~16 channels on an NVLink node: 0.125 GiB per communicator the step uses (world, FSDP, CP and the
#   ring or replica groups where they exist), created at its first collective;
# - the caching allocator's reserve and fragmentation: reserved over allocated at the peak was 1.11 in
#   pytorch/pytorch#40989 (16,726 vs 15,006 MB; 19,354 vs 17,402 MB): 12% of the step's tensors.
CUDA_CONTEXT = 0.5 * GIB
NCCL_PER_COMMUNICATOR = 0.125 * GIB
ALLOCATOR_RESERVE = 0.12
# `--gpu-memory` presets: the usable memory of common GPUs (GiB, as torch.cuda reports the total).
GPU_PRESETS = {
    "rtx3090": 24.0, "rtx4090": 24.0, "a10": 24.0, "l4": 24.0, "a100-40": 40.0, "a6000": 48.0, "l40s": 48.0,
    "a100": 80.0, "a100-80": 80.0, "h100": 80.0, "h800": 80.0, "rtx-pro-6000": 96.0, "h100-nvl": 94.0,
    "h200": 141.0, "b200": 180.0,
}  # fmt: skip


def _communicators(recipe: Recipe, world_size: int) -> int:
    """NCCL communicators a step uses: the world's (loss, flags), FSDP's, CP's, the ring's and the replicas'."""
    p = recipe.parallel
    rep, shard, cp = p.resolve(world_size)
    return 1 + (p.fsdp and shard * cp > 1) + (cp > 1) + (p.cp_ring > 1) + (rep > 1)


def _precision(recipe: Recipe, device_type: str) -> str:
    """The activation precision of the step: bf16 when the blocks compute in bf16 (FSDP's param_dtype on CUDA under
    mixed precision, or bf16 autocast), else fp32."""
    mp = recipe.train.mixed_precision
    return "bf16" if mp == "bf16" or (mp == "auto" and device_type == "cuda") else "fp32"


def estimate(recipe: Recipe, world_size: int, device_type: str = "cuda", shape: ModelShape | None = None) -> Estimate:
    """Predicted memory per rank of `recipe` on `world_size` ranks of `device_type` (steady state: the optimizer
    state exists during forward and backward)."""
    p, t = recipe.parallel, recipe.train
    _, shard, cp = p.resolve(world_size)
    shape = shape or model_shape(recipe)
    fsdp = shard * cp if p.fsdp else 1  # FSDP2 shards over dp_shard × cp, replicates over dp_replicate
    cuda = device_type == "cuda"
    compute = torch.bfloat16 if cuda and t.mixed_precision != "no" else None  # FSDP2 param_dtype (modeling.py)
    offload = p.cpu_offload and cuda  # FSDP2 CPU offload: on a CPU-only machine the state is in host memory anyway

    def sharded(trainable: bool | None, elem: int | None = None, block: int | None = None) -> float:
        return sum(_padded_shard_numel(s, fsdp) * (elem or e) for s, e, _ in shape.select(trainable, block))

    def gathered(block: int, trainable: bool | None = None) -> float:  # fp8 codes are gathered as they are
        return sum(math.prod(s) * (compute.itemsize if compute and f else e)
                   for s, e, f in shape.select(trainable, block))  # fmt: skip

    c: dict[str, float] = {}
    host: dict[str, float] = {}
    experts = _trained_experts(recipe)  # their shards, optimizer state and EMA; a step runs one (train/experts.py)
    c["parameters"] = experts * sharded(None)
    c["gradients"] = sharded(True)  # in the trained weights' dtype, sharded (FSDP2 reduce-scatters into the shard)
    c["optimizer state (AdamW)"] = experts * sum(optim.state_bytes(_padded_shard_numel(s, fsdp), e, t.optimizer)
                                                 for s, e, _ in shape.select(True))  # fmt: skip
    # FSDP2: the root (outside the blocks) stays gathered from forward to backward; a block in flight is gathered
    # while the next one is prefetched; its all-gather output is copied out into the parameters (one more block);
    # backward adds its unsharded gradients and their fp32 reduce-scatter input.
    biggest = max(range(shape.n_blocks), key=gathered)
    if p.fsdp and fsdp > 1:
        per_block = gathered(biggest)
        kept = shape.n_blocks * per_block if not p.reshard_after_forward else 0.0
        c["FSDP gathered root + blocks"] = gathered(-1) + kept + 2 * per_block
        c["FSDP reduce-scatter buffer"] = sharded(True, 4, biggest) * fsdp  # one block's fp32 gradients, flat
    if offload:  # each block's shards copied to the device for its all-gather (and the next one's, prefetched)
        c["CPU offload staging (2 blocks)"] = 2 * sharded(None, block=biggest)
    if recipe.ema is not None:  # train/ema.py: an fp32 copy of each rank's trained shards, where they live
        (host if offload else c)[EMA] = experts * sharded(True, 4)
    if t.grad_accum > 1 and p.fsdp and fsdp > 1:  # no reduce-scatter before the last micro-batch: FSDP2 accumulates
        c["unsharded gradients (grad_accum)"] = sum(math.prod(s) * 4 for s, _, _ in shape.select(True))  # in fp32
    cal = load_calibration(recipe.model.family)
    fit = cal["fit"][f"{_precision(recipe, device_type)}/{recipe.finetune.method}"]
    tokens, text = sample_tokens(recipe)
    n = math.ceil(tokens / cp)  # the sequence is split over cp; text is not (conservative)
    # train.batch_tokens: the largest bucket's samples filling the budget, at least one (b may be fractional: b × tokens
    # = the budget), the worst batch of any bucket for the terms linear in tokens, an upper bound for the quadratic ones
    b = t.batch_size if t.batch_tokens is None else max(1.0, t.batch_tokens / tokens)
    width, inner = shape.linear_width, shape.inner_dim
    block = b * _eval(fit["block"], n, text) * width
    elem = 2 if _precision(recipe, device_type) == "bf16" else 4
    if recipe.model.attention_backend in SCORE_BACKENDS:  # probabilities saved per attention call: (B, H/cp, S, S)
        block += b * _eval(fit["scores"], tokens, text) * shape.heads / cp * elem
    saved, recomputed = _block_activations(t, shape.n_blocks, block, b * _eval(fit["input"], n, text) * inner,
                                           b * n * inner * elem)  # fmt: skip
    work = max(0.0, b * _eval(fit["work_ckpt" if recomputed else "work"], n, text) * width)  # fits can dip below 0
    if t.offload_activations and cuda:  # saved block tensors live in host memory; one block's come back at a time
        host["offloaded activations"], saved = saved, block
    c["activations (blocks)"] = saved
    c["activations (outside blocks)"] = b * _eval(fit["outside"], n, text) * width
    c["backward working set"] = work
    if t.preservation is not None:  # its adapted forward's graph is held with the step's until their one backward;
        # the base's forward runs without gradients and keeps nothing
        c["activations (preservation forward)"] = saved + c["activations (outside blocks)"]
        if "offloaded activations" in host:
            host["offloaded activations"] *= 2
    codes = [math.prod(s) for s, _, f in shape.select(False) if not f]
    if codes:  # fp8 base: each quantized matmul upcasts its weight (forward, and again in backward), one at a time
        c["fp8 weight upcast (one layer)"] = max(codes) * elem
    if cp > 1:  # Ulysses: q, k, v, out sent and received per attention call, one call at a time
        c["CP all-to-all buffers"] = 2 * 4 * b * n * inner * elem
    opt_temp = _optimizer_temporaries(t, shape, fsdp, foreach=cuda and not offload)
    peak, first, state = _peak_totals(c, host, sharded(True, block=-1), opt_temp, offload)
    val = validation_peak(recipe, shape, fit, c, state, cp, text, elem)
    if val is not None:
        c["validation: pipeline components"] = val[1]
        peak = max(peak, val[0])
        first = max(first, val[0] - state)
    if cuda:  # what the device holds beyond the tensors (constants above)
        peak, first = _device_overheads(recipe, world_size, c, peak, first)
    # Ulysses per block and pass (forward, backward, recompute): q, k, v in and out back, (cp - 1)/cp of each leaves
    passes = 2 + recomputed / max(shape.n_blocks, 1)
    step_passes = passes if t.preservation is None else 2 * passes + 1  # + the adapted and the base forward
    a2a = 4 * b * n * inner * elem * (cp - 1) / cp * shape.n_blocks * step_passes * t.grad_accum
    layout = _layout(recipe, world_size, offload)
    # compute in forwards: forward 1, backward 2, a recomputed block 1 more; preservation: the step twice + a forward
    fwd = 3 + recomputed / max(shape.n_blocks, 1)
    compute = 1.0 if t.preservation is None else (2 * fwd + 1) / fwd
    return Estimate(c, peak, first, host, a2a, tokens, text, layout, compute)


def _trained_experts(recipe: Recipe) -> int:
    """Transformers a run holds trained: both experts of a mixture with model.both_experts, else one. A step runs one
    of them, so its gradients, gathers and activations are one expert's."""
    from train.models import get_family

    return len(get_family(recipe.model.family).experts) if recipe.model.both_experts else 1


def _optimizer_temporaries(t, shape: ModelShape, fsdp: int, foreach: bool) -> float:
    """AdamW's foreach path (CUDA) keeps one fp32 temporary per parameter of the whole list; the CPU path goes per
    tensor (torchao's optimizers, train/optim.py, compile one step per tensor: its temporaries are one tensor's at
    most)."""
    shards = [_padded_shard_numel(s, fsdp) * 4 for s, _, _ in shape.select(True)]
    if foreach and t.optimizer == "adamw" and t.master_weights == "fp32":
        return float(sum(shards))
    return max(shards, default=0)


def _block_activations(t, n_blocks: int, block: float, block_input: float, attention_out: float) -> tuple[float, int]:
    """(bytes the blocks save for backward, blocks recomputed). A recomputed block saves its input; with
    keep_attention also each attention call's output (up to 2 a block: Wan's self and cross attention; the LSE is
    1/head_dim of it); keep_attention_matmul keeps nearly everything a block saves: bounded by the whole block."""
    recomputed = math.ceil(n_blocks / t.checkpoint_every) if t.gradient_checkpointing else 0
    kept = {"full": block_input, "keep_attention": block_input + 2 * attention_out,
            "keep_attention_matmul": block}[t.checkpoint_policy]  # fmt: skip
    return (n_blocks - recomputed) * block + recomputed * kept, recomputed


def _peak_totals(
    c: dict[str, float], host: dict[str, float], outside_grads: float, opt_temp: float, offload: bool
) -> tuple[float, float, float]:
    """(steady-state peak, first-step peak, optimizer state on the device) from the components `c`; under CPU offload
    the sharded state and the optimizer step move from `c` to `host`.

    Backward frees each block's saved activations as it creates that block's sharded gradients (zero_grad sets them
    to None each step): its peak is at its start (every block's activations; with grad_accum, the gradients
    accumulated so far too) or at its end (every block's gradients, the activations outside the blocks still alive),
    whichever is larger: for full fine-tuning at long sequences the start, at short ones the end. The optimizer step
    holds the weights, gradients, state and its temporaries. The first step has no AdamW state before its update."""
    step = c["parameters"] + c["gradients"] + c["optimizer state (AdamW)"] + c.get(EMA, 0.0) + opt_temp
    state = c["optimizer state (AdamW)"]
    block_grads = c["gradients"] - outside_grads
    if offload:  # the sharded state and the optimizer step live in host memory; the device runs forward/backward
        for k in ("parameters", "gradients", "optimizer state (AdamW)"):
            host[k] = c.pop(k)
        host["optimizer step temporaries"] = opt_temp
        step, state, block_grads = 0.0, 0.0, 0.0
    held = max(c["activations (blocks)"] + c.get("unsharded gradients (grad_accum)", 0.0), block_grads)
    after = ("gradients", "activations (blocks)", "unsharded gradients (grad_accum)")  # in `held`
    fwd_bwd = sum(v for k, v in c.items() if k not in after) + held
    return max(fwd_bwd, step), max(fwd_bwd - state, step), state


def _device_overheads(
    recipe: Recipe, world_size: int, c: dict[str, float], peak: float, first: float
) -> tuple[float, float]:
    """The GPU's costs beyond the step's tensors (the constants above), added to `c`; the peaks with them."""
    k = _communicators(recipe, world_size)
    base = {"CUDA context + cuBLAS/cuDNN": CUDA_CONTEXT,
            f"NCCL buffers ({k} communicators)": k * NCCL_PER_COMMUNICATOR}  # fmt: skip
    c[f"caching allocator reserve ({ALLOCATOR_RESERVE:.0%})"] = ALLOCATOR_RESERVE * peak
    c.update(base)
    return peak * (1 + ALLOCATOR_RESERVE) + sum(base.values()), first * (1 + ALLOCATOR_RESERVE) + sum(base.values())


def _checkpointing(t) -> str:
    if not t.gradient_checkpointing:
        return "off"
    return f"every {t.checkpoint_every}" + ("" if t.checkpoint_policy == "full" else f" ({t.checkpoint_policy})")


def _layout(recipe: Recipe, world_size: int, offload: bool) -> str:
    """The breakdown's first line: degrees, method, checkpointing, optimizer and the levers on."""
    t = recipe.train
    rep, shard, cp = recipe.parallel.resolve(world_size)
    levers = [("offload activations", t.offload_activations), ("CPU offload", offload),
              ("fp8 base", recipe.finetune.fp8_base)]  # fmt: skip
    return (f"{world_size} ranks: dp_replicate {rep} × dp_shard {shard} × cp {cp}; {recipe.finetune.method}; "
            f"checkpointing {_checkpointing(t)}; "
            f"{optim.describe(t.optimizer, t.master_weights).split(' (')[0]}"
            + "".join(f"; {name}" for name, on in levers if on))  # fmt: skip


def validation_peak(
    recipe: Recipe, shape: ModelShape, fit: Mapping[str, Any], c: Mapping[str, float], state: float, cp: int,
    text: int, elem: int,
) -> tuple[float, float] | None:  # fmt: skip
    """(peak during a validation render, the pipeline components' bytes), or None without a validation section or
    when the components' sizes are unknown (a hub id not downloaded yet: said in the breakdown by its absence). Between
    steps the gradients are gone; the weights, the optimizer state and the FSDP working set stay; the VAE and text
    encoders come onto the device (train/validation.py); one block's forward at the sample's tokens runs at a time,
    batch 2 (classifier-free guidance). The VAE decode's own working set is not counted."""
    v = recipe.validation
    components = _component_bytes(recipe) if v is not None else None
    if components is None:
        return None
    tokens = _tokens_at(recipe, v.num_frames or recipe.data.num_frames, v.height or recipe.data.height,
                        v.width or recipe.data.width)  # fmt: skip
    forward = 2 * _eval(fit["block"], math.ceil(tokens / cp), text) * shape.linear_width
    kept = (
        "parameters",
        "FSDP gathered root + blocks",
        "CPU offload staging (2 blocks)",
        "CP all-to-all buffers",
    )
    peak = sum(c.get(k, 0.0) for k in kept) + state + components + forward
    return peak, components


def _component_bytes(recipe: Recipe) -> float | None:
    """Bytes of the pipeline components validation puts on the device: every safetensors file of the pipeline folder
    outside its transformer(s), as the family's encoder loads them (train/models/encoder.py: the VAE and image encoder
    in fp32, the text encoders in `data.text_encoder_dtype`). A hub id counts when its snapshot is in the local cache
    (train.prepare downloaded it)."""
    m = recipe.model
    if m.pretrained_path is None:
        return None
    folder = Path(m.pretrained_path).expanduser()
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(m.pretrained_path, revision=m.revision, local_files_only=True))
        except Exception:  # noqa: BLE001 — not downloaded (or no hub at all): unknown, not an error
            return None
    text_elem = getattr(torch, recipe.data.resolved(m).text_encoder_dtype).itemsize
    sizes = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}
    total = 0.0
    for file in folder.glob("*/*.safetensors"):
        sub = file.parent.name
        if sub.startswith("transformer"):
            continue
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            floating = entry["dtype"] in ("F64", "F32", "BF16", "F16")
            elem = (4 if sub in ("vae", "image_encoder") else text_elem) if floating else sizes.get(entry["dtype"], 4)
            total += math.prod(entry["shape"]) * elem
    return total


# ------------------------------------------------------------------------------------------------ verdict and advice


def parse_gib(text: str) -> float:
    """'80GiB', '80GB' (10^9 bytes), '80' (GiB), or a GPU_PRESETS name ('h100', 'rtx4090') -> GiB."""
    if text.strip().lower() in GPU_PRESETS:
        return GPU_PRESETS[text.strip().lower()]
    m = re.fullmatch(r"\s*([\d.]+)\s*(gib|gb|g)?\s*", text.lower())
    if not m:
        raise UserError(f"--gpu-memory {text!r}: expected e.g. 80GiB or 80GB, or one of {', '.join(GPU_PRESETS)}")
    value = float(m.group(1))
    return value * 1e9 / GIB if m.group(2) == "gb" else value


# The memory levers beyond activations, with the cost `_variants` gives them, cheapest first. Full fine-tuning: 8-bit
# moments (no compute, a loss drift of ~1e-4: tests/test_optim.py), then bf16 master weights, then both. LoRA: the
# frozen base in fp8 after checkpointing (its gradients ~3% off the bf16 base's: tests/test_fp8.py). Either: FSDP2 CPU
# offload last (every step pays host-device copies and a CPU optimizer step), alone and with the method's levers.
OPTIMIZER_LEVERS: list[tuple[int, dict[str, Any]]] = [
    (1, {"train.optimizer": "adamw_8bit"}),
    (2, {"train.master_weights": "bf16", "train.mixed_precision": "bf16"}),
    (3, {"train.optimizer": "adamw_8bit", "train.master_weights": "bf16", "train.mixed_precision": "bf16"}),
]
LORA_LEVERS: list[tuple[int, dict[str, Any]]] = [(3, {"finetune.fp8_base": True})]
CPU_OFFLOAD = (6, {"parallel.cpu_offload": True})


def _variants(recipe: Recipe, gpus: int) -> Iterable[tuple[int, dict[str, Any]]]:
    """(cost, overrides) of the layouts to try, cheapest change first: checkpointing, more CP, checkpointing every
    block, all the CP a node gives, offload of activations; with the method's memory levers and CPU offload too."""
    t, p, f = recipe.train, recipe.parallel, recipe.finetune
    cps = [c for c in range(1, gpus + 1) if gpus % (c * p.dp_replicate) == 0]
    now = {"train.optimizer": t.optimizer, "train.master_weights": t.master_weights,
           "train.mixed_precision": t.mixed_precision, "finetune.fp8_base": f.fp8_base,
           "parallel.cpu_offload": p.cpu_offload}  # fmt: skip
    own = [(0, {})] + (OPTIMIZER_LEVERS if f.method == "full" else LORA_LEVERS)
    levers = own + ([(c + CPU_OFFLOAD[0], {**o, **CPU_OFFLOAD[1]}) for c, o in own] if p.fsdp else [])
    levers = [(c, {k: v for k, v in o.items() if now[k] != v}) for c, o in levers]
    for (lever_cost, lever), cp in ((lv, cp) for lv in levers for cp in cps):
        for every in ((t.checkpoint_every,) if t.gradient_checkpointing else ()) + (2, 1):
            for offload in (t.offload_activations, True):
                changes = dict(lever)
                if cp != p.cp:
                    changes["parallel.cp"] = cp
                if (every, True) != (t.checkpoint_every, t.gradient_checkpointing) or not t.gradient_checkpointing:
                    changes["train.gradient_checkpointing"] = True
                    changes["train.checkpoint_every"] = every
                if offload != t.offload_activations:
                    changes["train.offload_activations"] = offload
                ckpt_changed = "train.gradient_checkpointing" in changes
                cost = 4 * ("parallel.cp" in changes) * cps.index(cp) + 3 * offload + 2 * ckpt_changed + (every == 1)
                yield cost + lever_cost, changes


def suggest(recipe: Recipe, gpus: int, gib: float, device_type: str = "cuda") -> str:
    """The smallest change (fewest, cheapest levers) whose prediction fits `gib`, as `--set` overrides."""
    from train.config import recipe_from_dict, recipe_to_dict

    # the trained weights' dtype and the fp8 base are in the shape
    shapes = {(recipe.train.master_weights, recipe.finetune.fp8_base): model_shape(recipe)}
    for _, changes in sorted(_variants(recipe, gpus), key=lambda v: v[0]):
        data = recipe_to_dict(recipe)
        for key, value in changes.items():
            section, name = key.split(".")
            data[section][name] = value
        data["parallel"]["dp_shard"] = -1  # what is left of the world after cp
        try:
            candidate = recipe_from_dict(data)
            key = (candidate.train.master_weights, candidate.finetune.fp8_base)
            shape = shapes[key] = shapes.get(key) or model_shape(candidate)
            e = estimate(candidate, gpus, device_type, shape)
        except ValueError:
            continue
        if e.peak <= gib * GIB:
            sets = " ".join(f"--set {k}={str(v).lower()}" for k, v in changes.items())
            return f"fits with {sets} (predicted {e.peak / GIB:.1f} GiB)" if changes else "fits as is"
    return (
        "no layout of cp, checkpointing, offload and memory levers (optimizer, fp8 base, CPU offload) fits: more "
        "GPUs (FSDP shards over all of them)" + (" or LoRA" if recipe.finetune.method == "full" else "")
    )


def device_memory_gib(recipe: Recipe, device: torch.device) -> float | None:
    """The memory the check compares with: parallel.device_memory_gib, else the GPU's own total, else none."""
    if recipe.parallel.device_memory_gib is not None:
        return recipe.parallel.device_memory_gib
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    return None


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= 0.1 * GIB else f"{n / 2**20:.1f} MiB"


def startup_check(recipe: Recipe, world_size: int, device: torch.device) -> str:
    """One line for the trainer's startup print; raises ValueError (one line, cause and fix) when
    `parallel.memory_check` is refuse and the prediction exceeds the device by more than REFUSE_MARGIN; warn returns
    the same line prefixed with "warning:". Inside the margin the estimate cannot tell, so it lets the run try."""
    if recipe.parallel.memory_check == "off":
        return "memory check off"
    e = estimate(recipe, world_size, device.type)
    limit = device_memory_gib(recipe, device)
    line = f"predicted peak per rank {_size(e.peak)}" + (f" of {_size(limit * GIB)}" if limit else "")
    if limit is None or e.peak <= limit * GIB * (1 + REFUSE_MARGIN):
        return line
    fix = suggest(recipe, world_size, limit, device.type)
    cause = f"{line}: over by more than the estimate's {REFUSE_MARGIN:.0%} error; {fix}"
    if recipe.parallel.memory_check == "refuse":
        raise UserError(f"{cause} (or set parallel.memory_check: warn)")
    return f"warning: {cause}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.estimate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    if argv is None:
        argv = sys.argv[1:]
    if "--calibrate" in argv:
        from train.models import family_names

        names = [a for a in argv if a != "--calibrate"] or list(family_names())
        for name in names:
            calibrate(name)
        return
    add_recipe_args(parser)
    parser.add_argument("--gpus", type=int, default=None,
                        help="world size (default: cp × dp_replicate × dp_shard; dp_shard -1 counts 1)")  # fmt: skip
    parser.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 80GiB, 141GB, or a GPU: "
                        f"{', '.join(GPU_PRESETS)} (default 80GiB)")  # fmt: skip
    parser.add_argument("--calibrate", action="store_true", help="re-measure the families' activation calibration")
    parser.add_argument("--layouts", action="store_true", help="rank the layouts by predicted step time (advisor)")
    parser.add_argument("--nodes", type=int, default=1, help="--layouts: nodes the GPUs are spread over (default 1)")
    parser.add_argument("--device", default="h100", help="--layouts: h100, h200, a100, h20 or cpu (default h100)")
    args = parser.parse_args(argv)
    recipe = recipe_from_args(args)
    p = recipe.parallel
    gpus = args.gpus or p.dp_replicate * max(p.dp_shard, 1) * p.cp
    gib = parse_gib(args.gpu_memory)
    if args.layouts:  # the layout advisor; --gpu-memory only when given (else the device's own)
        from train.advisor import layouts_main

        return layouts_main(recipe, gpus, args.nodes, args.device, gib if "--gpu-memory" in " ".join(argv) else None)
    e = estimate(recipe, gpus, "cuda")
    print(e.table(gib))
    fits = e.peak <= gib * GIB
    margin = gib - e.peak / GIB
    said = f"{'margin' if fits else 'over by'} {abs(margin):.1f} GiB, {abs(margin) / gib:.0%} of the device"
    print(f"verdict: {'fits' if fits else 'does NOT fit'} ({e.peak / GIB:.1f} of {gib:.1f} GiB per GPU; {said})")
    if not fits or e.peak > 0.9 * gib * GIB:
        print(f"suggestion: {suggest(recipe, gpus, 0.9 * gib if fits else gib)}")


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
