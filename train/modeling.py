"""Build the transformer a recipe asks for, trainable and parallelized, without any rank holding the whole model.

Sharded start (`model.sharded_load`, the default with FSDP): every rank builds the same model on the meta device,
adds LoRA (or casts to fp32 for full fine-tuning: master weights), `parallelize` applies CP hooks, the activation
levers, compile and `fully_shard`, and only then is memory allocated: each rank's shard, filled by DCP's
`HuggingFaceStorageReader` with just that rank's slice of every pretrained safetensors tensor. Why the reader and
not `set_model_state_dict(broadcast_from_rank0=True)`: broadcasting needs the whole model on rank 0 (what this is
meant to avoid) and moves every byte through the network; the reader's peak per rank is its shard plus one
tensor slice. Broadcast from rank 0 is used only for random init (`init_config`), where rank 0 must draw the whole
model anyway to reproduce the serial initial weights.

Adapters (peft's LoRA, DoRA, LoKr, LoHa: `finetune.adapter`) start from `lora_init`: values drawn by one seeded
generator in parameter order, so they are the same on every rank and in every layout (and small: every rank holds
them whole and keeps its slice). DoRA's magnitudes start at the base weights' row norms: `set_dora_magnitudes`, once
the base weights are in place (on the sharded start, from each rank's rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import math
from pathlib import Path
from typing import Any

import diffusers
import torch
import torch.distributed as dist

from . import fp8
from .checkpoint import finite
from .config import FinetuneConfig, ModelConfig, Recipe
from .cp.enable import check_tokens
from .errors import UserError
from .models import get_family, transformer_config
from .models.spec import FamilySpec
from .parallel import Mesh, Parallelized, check_replicated, parallelize, repeated_blocks
from .schema import suggest

# peft's parameter names of each adapter kind: LoRA/DoRA (`lora_A`, `lora_B`, `lora_magnitude_vector`), LoKr
# (`lokr_w1`, `lokr_w2`, or their `_a`/`_b` factors), LoHa (`hada_w1_a` ... `hada_w2_b`)
ADAPTER_TAGS = ("lora_", "lokr_", "hada_")
# The factor peft's `reset_adapter_parameters` (init weights: true) zeros, one per kind, so that the adapted model
# starts equal to the base; the others are kaiming-uniform(a=√5)
ZERO_AT_START = ("lora_B", "lokr_w1", "lokr_w1_a", "hada_w2_b")


def adapter_factor(name: str) -> str | None:
    """The adapter factor a parameter name holds (`lora_A`, `lokr_w2`, `hada_w1_b`, `lora_magnitude_vector`), or
    None for a base parameter."""
    return next((part for part in name.split(".") if part.startswith(ADAPTER_TAGS)), None)


def family_spec(cfg: ModelConfig) -> FamilySpec:
    """The family's spec; `model.flow_shift`, when set, replaces the primary stream's shift by a static one."""
    spec = get_family(cfg.family)
    if cfg.flow_shift is None:
        return spec
    shift = dataclasses.replace(spec.shift, kind="static", shift=cfg.flow_shift, mu_fn=None)
    return dataclasses.replace(spec, shift=shift)


def check_model(recipe: Recipe, spec: FamilySpec) -> None:
    """The model's user errors, one line each, before any process group exists (every rank finds the same):
    `init_config` keys the transformer class does not take (diffusers only warns, then builds another model), a
    pretrained folder without the transformer's config or without whole weights of that config's shapes, a CP
    plan file for another class, a CP degree above a sample's token count, and bf16 on a GPU without it."""
    cfg = recipe.model
    if cfg.both_experts:  # each expert as its own one-expert run would be checked
        from .experts import expert_recipes

        if not spec.experts:
            raise UserError(f"model.both_experts: {spec.name} has one transformer, not a mixture of experts; set "
                            "model.both_experts: false")  # fmt: skip
        if recipe.validation_loss is not None:
            raise UserError("validation_loss: a held-out loss of both experts (routing each held-out sample by its "
                            "sigma) is not built yet; set validation_loss: null with model.both_experts")  # fmt: skip
        for one in expert_recipes(recipe, spec).values():
            check_model(one, spec)
        return
    if recipe.train.mixed_precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise UserError(f"train.mixed_precision: bf16, but {torch.cuda.get_device_name()} has no bf16 support; set "
                        "train.mixed_precision: no (fp32)")  # fmt: skip
    cls = getattr(diffusers, spec.transformer_class)
    if cfg.init_config is not None:
        takes = [n for n, p in inspect.signature(cls.__init__).parameters.items()
                 if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]  # fmt: skip
        unknown = [k for k in cfg.init_config if k not in takes]
        if unknown:
            keys = ", ".join(f"{k!r}{suggest(k, takes)}" for k in unknown)
            raise UserError(f"model.init_config: {cls.__name__} takes no {keys}: diffusers would ignore it and build "
                            f"another model; valid keys: {', '.join(takes)}")  # fmt: skip
    if recipe.parallel.cp > 1 and cfg.cp_plan is not None:  # another class's plan: refused here, on every rank alike
        from .cp.plans import load_plan_file

        plan = load_plan_file(cfg.cp_plan)
        if plan.model_class not in [c.__name__ for c in cls.__mro__]:
            raise UserError(f"model.cp_plan: {cfg.cp_plan} is the plan for {plan.model_class}; {cfg.family} trains a "
                            f"{cls.__name__}: point it at that class's plan, or null for the shipped one")  # fmt: skip
    local = cfg.pretrained_path is not None and Path(cfg.pretrained_path).expanduser().is_dir()
    if cfg.init_config is None and not local and not cfg.sharded_load:
        return  # a hub id that from_pretrained fetches: its config is known only once downloaded
    try:
        config = transformer_config(cfg.family, init_config=cfg.init_config, pretrained_path=cfg.pretrained_path,
                                    subfolder=cfg.subfolder)  # fmt: skip
    except ValueError as e:
        raise UserError(str(e)) from None
    if cfg.init_config is None and local:  # the weights whole and of this config's shapes, before any group exists
        folder = Path(cfg.pretrained_path).expanduser() / (cfg.subfolder or "")
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            meta = cls.from_config(config)
        check_weights(folder, {k: tuple(t.shape) for k, t in meta.state_dict().items()})
    f, keys = recipe.finetune, recipe.checkpoint.export_format
    if f.method == "lora" and (f.init_lora or f.base_adapter or (keys != "diffusers" and recipe.exported == "lora")):
        check_adapters(recipe, spec)
    full_layout = spec.lora_format is not None and spec.lora_format.full is not None
    if recipe.exported == "full" and keys != "diffusers" and not full_layout:
        raise UserError(f"checkpoint.export_format: {spec.name} has no original full-checkpoint layout here "
                        "(its diffusers folder is what its loaders read); set export_format: diffusers")  # fmt: skip
    shapes = _sample_shapes(recipe, spec)  # reads the cache's manifest: a missing cache is named here, early
    if recipe.parallel.cp > 1:
        check_tokens(recipe.parallel.cp, spec, shapes, config)
    if recipe.validation_loss is not None and recipe.validation_loss.cache_dir is not None:
        from .heldout import check_cache

        check_cache(recipe, spec, config)  # like the training cache: CP degree, the model's shapes


def check_adapters(recipe: Recipe, spec: FamilySpec) -> None:
    """On a meta model (no memory): `finetune.init_lora` and `finetune.base_adapter` fit it (read_init_lora), and an
    original-format LoRA export (`checkpoint.export_format`) is one the family can write: it has a format that names
    every adapted module."""
    from .lora_format import check_format

    model = meta_transformer(recipe.model, spec)
    add_adapters(recipe, spec, model)
    if recipe.checkpoint.export_format == "diffusers" or recipe.exported != "lora":
        return
    modules = [n.removesuffix(".lora_A.default.weight") for n, _ in model.named_parameters()
               if n.endswith(".lora_A.default.weight")]  # fmt: skip
    check_format(spec.lora_format, spec.name, modules)


def _sample_shapes(recipe: Recipe, spec: FamilySpec) -> dict[str, dict[str, Any]]:
    """Per-sample shapes of the noised streams, per bucket: the synthetic shapes, or the cache manifest's."""
    from .data.dataset import read_manifest

    if recipe.data.synthetic is not None:
        shapes = recipe.data.synthetic.shapes
        return {"synthetic": {s: shapes[s] for s in spec.streams if s in shapes}}
    tensors = {}
    for cache in recipe.data.cache_dirs():  # data.cache_dir, or each of data.datasets
        tensors |= read_manifest(cache).get("tensors", {})
    return {b: {s: t[s]["shape"] for s in spec.streams if s in t} for b, t in tensors.items()}


def _hub_error(cfg: ModelConfig, error: Exception) -> UserError:
    """A hub fetch of `model.pretrained_path` failed: say it was taken for a hub id, and why it failed."""
    reason = (str(error).strip().splitlines() or [""])[0][:200]
    return UserError(
        f"model.pretrained_path {cfg.pretrained_path!r} is not a local folder (no "
        f"{Path(cfg.pretrained_path).expanduser().resolve()}), so it was fetched as a hub id, which failed "
        f"({type(error).__name__}: {reason}); check the network, HF_TOKEN and HF_HUB_OFFLINE, or download it and "
        "set model.pretrained_path to its folder",
        same_on_every_rank=False,
    )


def _random_init(cfg: ModelConfig, spec: FamilySpec, seed: int) -> torch.nn.Module:
    cls = getattr(diffusers, spec.transformer_class)
    torch.manual_seed(seed)  # identical initial weights on every rank, and in every layout
    return cls.from_config(cfg.init_config).to(getattr(torch, cfg.dtype))


def load_transformer(cfg: ModelConfig, spec: FamilySpec, seed: int) -> torch.nn.Module:
    """The whole transformer on this rank: random init from `init_config`, or `from_pretrained` (`subfolder`)."""
    if cfg.init_config is not None:
        model = _random_init(cfg, spec, seed)
    else:
        cls = getattr(diffusers, spec.transformer_class)
        try:
            model = cls.from_pretrained(cfg.pretrained_path, subfolder=cfg.subfolder, revision=cfg.revision,
                                        torch_dtype=getattr(torch, cfg.dtype))  # fmt: skip
        except Exception as e:  # a local folder's own errors stay as they are
            if Path(cfg.pretrained_path).expanduser().is_dir():
                raise
            raise _hub_error(cfg, e) from e
    spec.train_ready(model).set_attention_backend(cfg.attention_backend)
    return model.train()


def meta_transformer(cfg: ModelConfig, spec: FamilySpec) -> torch.nn.Module:
    """The transformer with every parameter on the meta device (no memory), in the dtypes loading would give it:
    `model.dtype`, except the class's `_keep_in_fp32_modules` when loading pretrained weights (as diffusers'
    `from_pretrained` does). Buffers are real (computed by the constructor: RoPE tables and the like)."""
    from accelerate import init_empty_weights

    cls = getattr(diffusers, spec.transformer_class)
    config = transformer_config(cfg.family, init_config=cfg.init_config, pretrained_path=cfg.pretrained_path,
                                subfolder=cfg.subfolder)  # fmt: skip
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config)
    dtype = getattr(torch, cfg.dtype)
    if cfg.init_config is not None:
        model.to(dtype)  # what _random_init does, buffers included
    else:
        keep = cls._keep_in_fp32_modules or []
        for name, p in model.named_parameters():
            p.data = p.data.to(torch.float32 if any(k in name for k in keep) else dtype)
    spec.train_ready(model).set_attention_backend(cfg.attention_backend)
    return model.train()


def cast_master(model: torch.nn.Module, master_weights: str) -> None:
    """Full fine-tuning's trained weights (`train.master_weights`): fp32 (buffers too), or every parameter bf16, the
    modules diffusers keeps in fp32 included (FSDP2 needs one dtype for the trained parameters of a group; buffers
    such as RoPE tables keep theirs)."""
    if master_weights == "fp32":
        model.to(torch.float32)
        return
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class InitAdapter:
    """`finetune.init_lora` as its family's pipeline reads it: the peft config `load_lora_weights` would build for it
    (rank, alpha and targets per module) and each adapter tensor under our parameter name."""

    config: Any
    values: dict[str, torch.Tensor]


def read_init_lora(
    path: str, spec: FamilySpec, model: torch.nn.Module, setting: str = "finetune.init_lora"
) -> InitAdapter:
    """Read an existing adapter (a diffusers/PEFT folder or file, or the original / ComfyUI / kohya keys) with the
    family pipeline's own `lora_state_dict` (diffusers' converters, what `load_lora_weights` runs) and the config
    diffusers builds from it; every tensor is checked against `model` (meta is enough). A file diffusers cannot read
    for this family, a module the model lacks or a shape that does not fit: one line naming the first bad key."""
    from diffusers.utils.peft_utils import _create_lora_config

    file = Path(path).expanduser()
    if not file.exists():
        raise UserError(f"{setting}: {file} does not exist; point it at a LoRA .safetensors file or folder")
    cls = getattr(diffusers, spec.pipeline_class)
    if not hasattr(cls, "lora_state_dict"):  # HunyuanVideo15Pipeline: its transformer-only files read as these
        cls = diffusers.loaders.HunyuanVideoLoraLoaderMixin
    try:
        state, metadata = cls.lora_state_dict(str(file), return_lora_metadata=True)
    except Exception as e:  # noqa: BLE001 — the converters raise ValueError, KeyError, IndexError on foreign keys
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"{setting}: {file} is not a LoRA {cls.__name__} reads ({type(e).__name__}: "
                        f"{reason}); is it an adapter of model.family {spec.name}?") from None  # fmt: skip
    if isinstance(state, tuple):  # mixins that also return network alphas
        state = state[0]
    prefix = "transformer."
    adapter = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    if not adapter:
        raise UserError(f"{setting}: {file} holds no transformer adapter (keys like {list(state)[:2]})")
    metadata = {k.removeprefix(prefix): v for k, v in (metadata or {}).items() if k.startswith(prefix)} or None
    modules = dict(model.named_modules())
    rank = {}
    for key, value in adapter.items():
        module, _, kind = key.rpartition(".lora_")
        layer = modules.get(module)
        if kind not in ("A.weight", "B.weight") or not isinstance(layer, torch.nn.Linear):
            what = (
                f"has no linear layer {module!r}" if kind in ("A.weight", "B.weight") else f"cannot start from {kind!r}"
            )
            raise UserError(f"{setting}: {file}: the first bad key is {prefix}{key}: "
                            f"{type(model).__name__} {what} (another model's adapter, or LoRA bias/DoRA)")  # fmt: skip
        partner = adapter.get(f"{module}.lora_{'B' if kind[0] == 'A' else 'A'}.weight")
        r = value.shape[0] if kind[0] == "A" else value.shape[-1]
        fits = (value.shape == (r, layer.in_features)) if kind[0] == "A" else (value.shape == (layer.out_features, r))
        if not fits or partner is None or (partner.shape[0] if kind[0] == "B" else partner.shape[-1]) != r:
            expect = f"({r}, {layer.in_features})" if kind[0] == "A" else f"({layer.out_features}, {r})"
            raise UserError(f"{setting}: {file}: the first bad key is {prefix}{key}: shape "
                            f"{tuple(value.shape)}, {module} of {type(model).__name__} takes {expect} with its "
                            f"{'lora_B' if kind[0] == 'A' else 'lora_A'} of rank {r}: an adapter of another model "
                            "size?")  # fmt: skip
        if kind[0] == "B":
            rank[f"^{key}"] = r
    config = _create_lora_config(adapter, None, metadata, rank, model_state_dict=model.state_dict(),
                                 adapter_name="default")  # fmt: skip
    values = {f"{k.rpartition('.')[0]}.default.weight": v for k, v in adapter.items()}
    return InitAdapter(config, values)


def apply_finetune(
    model: torch.nn.Module,
    cfg: FinetuneConfig,
    spec: FamilySpec,
    master_weights: str,
    adapter: InitAdapter | None = None,
) -> list[str]:
    """Full: every parameter trains, in `master_weights` (cast_master). LoRA (any `adapter` kind): the base is
    frozen, adapters train in fp32 (bf16 with master_weights: bf16); with `fp8_base` the blocks' frozen linear weights
    become float8 first (train/fp8.py: quantized from their values, or meta on a meta model), then peft wraps them.
    Works on a meta model too (nothing is allocated). Returns the names of the trainable parameters."""
    if cfg.method == "full":
        cast_master(model, master_weights)
        model.requires_grad_(True)
    else:
        from peft import LoHaConfig, LoKrConfig, LoraConfig

        model.requires_grad_(False)
        if cfg.fp8_base:
            fp8.convert(repeated_blocks(model))
        if adapter is not None:  # finetune.init_lora: the adapter's own ranks, alphas and targets
            config = adapter.config
        else:
            targets = list(cfg.lora_targets or spec.lora_targets)
            check_lora_targets(model, targets)
            if cfg.adapter == "lora":
                check_lora_rank(model, targets, cfg.lora_rank)
            if cfg.adapter == "lora":
                config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                    target_modules=targets, init_lora_weights=True, use_dora=cfg.dora)  # fmt: skip
            else:
                kind = LoKrConfig if cfg.adapter == "lokr" else LoHaConfig
                config = kind(r=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=targets, init_weights=True)
        # peft makes each adapter on the default device, initialises it, then moves it to its base layer's device: on
        # a meta model, make them on meta (a 14B model's 320 adapters: ~4 s of CPU init for values never read)
        meta = next(model.parameters()).is_meta
        with torch.device("meta") if meta else contextlib.nullcontext():
            model.add_adapter(config)
        dtype = torch.bfloat16 if master_weights == "bf16" else torch.float32
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(dtype)
        if adapter is not None:
            lora = {n for n, p in model.named_parameters() if ".lora_" in n}
            if lora != set(adapter.values):  # the config built from the file adapts exactly its modules
                odd = sorted(lora ^ set(adapter.values))[:2]
                raise UserError(f"finetune.init_lora: its config adapts {odd}, which the file holds no tensors "
                                "for (or the reverse); re-export the adapter")  # fmt: skip
    return [n for n, p in model.named_parameters() if p.requires_grad]


def initial_adapters(model: torch.nn.Module, adapter: InitAdapter | None, seed: int) -> dict[str, torch.Tensor]:
    """The adapters' starting values, whole on CPU: `finetune.init_lora`'s tensors (in the trained dtype), else the
    seeded `lora_init`."""
    if adapter is None:
        return lora_init(model, seed)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    return {n: v.to(dtypes[n]).cpu() for n, v in adapter.values.items()}


def check_lora_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Every LoRA target names a module, as peft matches a list of `target_modules` (a module's name or a dotted
    suffix of it): peft drops an entry that matches nothing while another entry matches (`[to_q, to_kk]` trains what
    `[to_q]` trains), and fails with a traceback when none does. Every rank builds the same model: the same error."""
    names = [n for n, _ in model.named_modules() if n]
    unmatched = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if not unmatched:
        return

    def tail(name: str) -> str:  # what a target usually is: the last name, the last two after an index (`to_out.0`)
        return ".".join(name.split(".")[-2 if name.split(".")[-1].isdigit() else -1 :])

    said = ", ".join(f"{t!r}{suggest(t, {tail(n) for n in names})}" for t in unmatched)
    linear = sorted({tail(n) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    raise UserError(f"finetune.lora_targets: {said} match{'es' * (len(unmatched) == 1)} no module of "
                    f"{type(model).__name__} (peft skips an unmatched target silently); its linear layers are named "
                    f"{', '.join(linear[:24])}{' ...' * (len(linear) > 24)}")  # fmt: skip


def check_lora_rank(model: torch.nn.Module, targets: list[str], rank: int) -> None:
    """A LoRA update B·A of a layer is at most min(in, out) wide: a `lora_rank` above a targeted layer's width adds
    parameters, memory and optimizer state that can never raise the update's rank. Every rank builds the same model:
    the same error."""
    widths = {n: min(m.in_features, m.out_features) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith(f".{t}") for t in targets)}  # fmt: skip
    narrow = {n: w for n, w in widths.items() if w < rank}
    if narrow:
        name, width = min(narrow.items(), key=lambda kv: kv[1])
        raise UserError(f"finetune.lora_rank: {rank} is above the width of {len(narrow)} targeted layer(s) "
                        f"(the narrowest, {name}, is {width} wide), where the update's rank cannot exceed {width}; "
                        f"set finetune.lora_rank to at most {min(narrow.values())}, or leave those layers out of "
                        "finetune.lora_targets")  # fmt: skip


def lora_init(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Initial values of the adapters, whole, on CPU, as peft draws them (`reset_adapter_parameters`): one factor of
    each kind zero (ZERO_AT_START: LoRA's B, LoKr's w1, LoHa's w2_b, so the adapted model starts equal to the base),
    the others kaiming-uniform(a=√5). One generator walks the parameters in order: the same on every rank. DoRA's
    magnitudes are not here: they are the base weights' norms (`set_dora_magnitudes`, once those are loaded)."""
    gen = torch.Generator().manual_seed(seed + 1)
    values = {}
    for name, p in model.named_parameters():
        factor = adapter_factor(name)
        if not p.requires_grad or factor is None or factor == "lora_magnitude_vector":
            continue
        value = torch.zeros(p.shape, dtype=p.dtype)
        if factor not in ZERO_AT_START:
            torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)
        values[name] = value
    return values


@torch.no_grad()
def set_dora_magnitudes(model: torch.nn.Module) -> None:
    """DoRA's magnitudes at their start, as peft sets them: the row norms of W + s·B·A with B = 0, i.e. of each adapted
    base weight (float8 bases dequantized), in fp32. Each rank computes its own rows: FSDP2 shards a weight and its
    magnitude vector alike, on dim 0, so nothing is communicated and the result equals the serial start."""
    from peft.tuners.lora import LoraLayer
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    for module in model.modules():
        if not isinstance(module, LoraLayer) or not module.lora_magnitude_vector:
            continue
        base = module.get_base_layer()
        weight = base.dequantized() if isinstance(base, fp8.Fp8Linear) else local(base.weight).float()
        norm = torch.linalg.norm(weight, dim=1)
        for dora in module.lora_magnitude_vector.values():
            target = local(dora.weight)
            assert target.shape == norm.shape, (target.shape, norm.shape)  # the same dim-0 rows on this rank
            target.copy_(norm)


def _base_key(name: str) -> str:
    """The pretrained checkpoint's key of a model parameter (peft inserts `.base_layer` into wrapped layers)."""
    return name.replace(".base_layer.", ".")


def pretrained_folder(cfg: ModelConfig) -> Path:
    """The local folder holding the transformer's safetensors: `pretrained_path/subfolder`, downloaded from the hub
    (rank 0 first, the others then read the cache) when `pretrained_path` is not a local folder."""
    local = Path(cfg.pretrained_path).expanduser()
    if local.is_dir():
        folder = local / cfg.subfolder if cfg.subfolder else local
    else:
        from huggingface_hub import snapshot_download

        def fetch(offline: bool) -> Path:
            pattern = f"{cfg.subfolder}/*" if cfg.subfolder else "*"
            try:
                root = snapshot_download(cfg.pretrained_path, revision=cfg.revision, allow_patterns=[pattern],
                                         local_files_only=offline)  # fmt: skip
            except Exception as e:  # no network, offline mode, unknown repo, no access: all hub failures
                raise _hub_error(cfg, e) from e
            return Path(root) / cfg.subfolder

        folder = fetch(offline=False) if dist.get_rank() == 0 else None
        dist.barrier()
        folder = folder or fetch(offline=True)
    if not any(folder.glob("*.safetensors")):
        raise UserError(f"model.pretrained_path: no .safetensors weights in {folder} (sharded_load reads "
                         "safetensors only; set model.sharded_load=false to load other formats)")  # fmt: skip
    return folder


def _source_digest(folder: Path) -> float:
    """A cheap fingerprint of a checkpoint folder (file names and sizes, safetensors headers, the first MiB of every
    file's data): ranks that read different copies of a checkpoint (a stale copy on one node) would start from
    different weights."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode() + f.stat().st_size.to_bytes(8, "little") + fh.read(n) + fh.read(2**20))
    return float(int.from_bytes(h.digest()[:6], "little"))


def _safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a .safetensors file's header declares, after checking the file holds all the data the
    header promises (a copy or download cut short fails here, named, not deep inside a loader)."""
    import json

    size = file.stat().st_size
    with file.open("rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        header = f.read(n) if 0 < n <= size - 8 else b""
    try:
        entries = json.loads(header)
        end = max((int(e["data_offsets"][1]) for k, e in entries.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, AttributeError):
        raise UserError(f"model.pretrained_path: {file} is not a readable .safetensors file ({size} bytes, no valid "
                        "header): download or convert it again") from None  # fmt: skip
    if 8 + n + end > size:
        raise UserError(f"model.pretrained_path: {file} is truncated: its header declares {8 + n + end} bytes, the "
                        f"file holds {size}; download or copy it again")  # fmt: skip
    return {k: tuple(e["shape"]) for k, e in entries.items() if k != "__metadata__"}


def check_weights(folder: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """The transformer's weights in `folder` are complete and fit the model its config builds (`expected`: parameter
    name -> shape): every .safetensors file whole, every file its index names present, every parameter stored with
    its shape. Without .safetensors, .bin weights are left to diffusers."""
    import json

    files = sorted(folder.glob("*.safetensors"))
    for index in folder.glob("*.safetensors.index.json"):
        named = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        absent = [n for n in named if not (folder / n).is_file()]
        if absent:
            raise UserError(f"model.pretrained_path: {folder} lacks {len(absent)} of the {len(named)} weight files "
                            f"{index.name} names ({', '.join(absent[:3])}); download it again")  # fmt: skip
    if not files:
        if any(folder.glob("*.bin")):
            return
        held = sorted(p.name for p in folder.iterdir())[:5]
        raise UserError(f"model.pretrained_path: no weights (.safetensors or .bin) in {folder}, only {held}; "
                        "download the checkpoint's weights")  # fmt: skip
    stored = {k: v for f in files for k, v in _safetensors_shapes(f).items()}
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise UserError(f"model.pretrained_path: {folder} lacks {len(missing)} weights of this model (e.g. "
                         f"{missing[:3]}); is it the right checkpoint for model.family?")  # fmt: skip
    wrong = [k for k in expected if stored[k] != tuple(expected[k])]
    if wrong:
        k = wrong[0]
        raise UserError(f"model.pretrained_path: {folder} holds {k} with shape {stored[k]}, the model its "
                         f"config.json builds has {tuple(expected[k])} ({len(wrong)} such weights): the config and "
                         "the weights are of different models")  # fmt: skip


def _load_pretrained_shards(model: torch.nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """Fill each rank's shard of every pretrained parameter from the safetensors in `folder`, slice by slice. The
    float8 weights (`finetune.fp8_base`) are read one block at a time into `dtype` shards of their own placement,
    which this rank quantizes into its codes and scales (its rows: FSDP2 shards dim 0), then drops."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    quantized = {_base_key(f"{n}.weight").removesuffix(".weight"): m for n, m in fp8.modules(model).items()}
    state = {_base_key(n): t for n, t in model.state_dict().items() if adapter_factor(n) is None}
    scales = {f"{k}.weight_scale" for k in quantized}
    state = {k: t for k, t in state.items() if k not in scales}  # computed here, not in the checkpoint
    check_weights(folder, {k: tuple(t.shape) for k, t in state.items()})  # a hub download: checked once here
    codes = {f"{k}.weight" for k in quantized}
    dcp.load({k: t for k, t in state.items() if k not in codes}, storage_reader=HuggingFaceStorageReader(str(folder)))
    for block in dict.fromkeys(k.split(".")[0] + "." + k.split(".")[1] for k in quantized):  # e.g. "blocks.3"
        layers = {k: m for k, m in quantized.items() if k.startswith(f"{block}.")}
        staged = {f"{k}.weight": torch.empty_like(m.weight, dtype=dtype) for k, m in layers.items()}
        dcp.load(staged, storage_reader=HuggingFaceStorageReader(str(folder)))
        with torch.no_grad():
            for k, m in layers.items():
                value = staged.pop(f"{k}.weight")
                local = value.to_local() if hasattr(value, "to_local") else value
                q, scale = fp8.quantize(local)
                for param, v in ((m.weight, q), (m.weight_scale, scale)):
                    (param.to_local() if hasattr(param, "to_local") else param).copy_(v)


def init_adapter(recipe: Recipe, spec: FamilySpec, model: torch.nn.Module) -> InitAdapter | None:
    """`finetune.init_lora` read for `model` (before its adapters are added), or None."""
    path = recipe.finetune.init_lora if recipe.finetune.method == "lora" else None
    return None if path is None else read_init_lora(path, spec, model)


def base_adapter(recipe: Recipe, spec: FamilySpec, model: torch.nn.Module) -> InitAdapter | None:
    """`finetune.base_adapter` (train/base_adapter.py) read for `model` (before its adapters are added), or None."""
    path = recipe.finetune.base_adapter if recipe.finetune.method == "lora" else None
    return None if path is None else read_init_lora(path, spec, model, setting="finetune.base_adapter")


def add_adapters(recipe: Recipe, spec: FamilySpec, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """LoRA / full on `model` (apply_finetune), and the adapters' starting values, whole: the trained ones
    (`finetune.init_lora` or seeded), then the frozen `finetune.base_adapter` beside them."""
    adapter, base = init_adapter(recipe, spec, model), base_adapter(recipe, spec, model)
    apply_finetune(model, recipe.finetune, spec, recipe.train.master_weights, adapter)
    values = initial_adapters(model, adapter, seed=recipe.train.seed)
    if base is not None:
        from .base_adapter import add_base_adapter

        values |= add_base_adapter(model, base)
    return values


def whole_model(recipe: Recipe, spec: FamilySpec) -> torch.nn.Module:
    """The trainable transformer whole, as one process starts it: loaded (or randomly initialised), LoRA or full,
    the adapters at their seeded initial values. The start of every run without the sharded start, and the serial
    reference runs compare with (tests/harness.py `first_step`)."""
    model = load_transformer(recipe.model, spec, seed=recipe.train.seed)
    with torch.no_grad():
        for name, value in add_adapters(recipe, spec, model).items():
            model.get_parameter(name).copy_(value)
    set_dora_magnitudes(model)
    return model


def build_model(
    recipe: Recipe, spec: FamilySpec, mesh: Mesh, device: torch.device
) -> tuple[torch.nn.Module, Parallelized]:
    """The transformer, trainable (LoRA / full) and parallelized (CP, activation levers, compile, FSDP2), its
    weights in place: sharded start when `model.sharded_load` and FSDP are on, else whole on every rank first."""
    cfg, t, sharded = recipe.model, recipe.train, recipe.model.sharded_load and recipe.parallel.fsdp
    if sharded:
        model = meta_transformer(cfg, spec)
        lora = add_adapters(recipe, spec, model)
    else:  # whole on every rank, adapters set: parallelize checks every rank holds the same
        model, lora = whole_model(recipe, spec).to(device), {}
    folder = pretrained_folder(cfg) if sharded and cfg.init_config is None else None
    if sharded:  # every rank must fill its shard from the same source: compare fingerprints before any allocation
        digest = torch.tensor([_source_digest(folder) if folder else 0.0])
        check_replicated([digest, *lora.values()], what="sources of the initial weights (checkpoint, LoRA init)")
    parallel = parallelize(
        model, mesh, cp_plan=cfg.cp_plan, gradient_checkpointing=t.gradient_checkpointing,
        checkpoint_every=t.checkpoint_every, checkpoint_policy=t.checkpoint_policy,
        offload_activations=t.offload_activations, compile=t.compile,
        fsdp=recipe.parallel.fsdp, reshard_after_forward=recipe.parallel.reshard_after_forward,
        param_dtype=torch.bfloat16 if device.type == "cuda" and t.mixed_precision != "no" else None,
        cp_transport=recipe.parallel.cp_transport, attention_kernel=recipe.parallel.attention_kernel,
        cpu_offload=recipe.parallel.cpu_offload,
    )  # fmt: skip
    if sharded:  # FSDP2's offload keeps the shards in host memory: they are allocated there
        materialize(model, device, params_on=torch.device("cpu") if recipe.parallel.cpu_offload else device)
        if folder is not None:
            _load_pretrained_shards(model, folder, getattr(torch, cfg.dtype))
            _set_full(model, lora, broadcast=False)
        else:  # random init: rank 0 draws the whole model exactly as the serial run does, every rank keeps its shard
            full = {}
            if dist.get_rank() == 0:
                base = _random_init(cfg, spec, seed=t.seed)
                if recipe.finetune.method == "full":
                    cast_master(base, t.master_weights)
                if recipe.finetune.fp8_base:  # rank 0 quantizes the whole draw: every rank keeps its rows' codes
                    fp8.convert(repeated_blocks(base))
                full = {**base.state_dict(), **lora}
            names = {_base_key(n): n for n in model.state_dict()}
            _set_full(model, {names.get(k, k): v for k, v in full.items()}, broadcast=True)
        set_dora_magnitudes(model)  # from the base weights now in place: each rank its rows
    check_finite_start(model, cfg)
    return model, parallel


def check_finite_start(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """The weights the run starts from are finite (a collective; each rank checks its own shards). NaN/Inf in a
    pretrained checkpoint would make every step non-finite, and the bad-step guard would blame the samples."""
    bad = [name for name, p in model.named_parameters() if not finite(p)]
    flag = torch.tensor(len(bad), device=next(model.parameters()).device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag:
        return
    names = [bad]
    if dist.is_initialized() and dist.get_world_size() > 1:
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, bad)
    found = list(dict.fromkeys(n for part in names for n in part))
    source = cfg.pretrained_path or "the random init (model.init_config)"
    raise UserError(f"the starting weights hold NaN/Inf in {len(found)} tensor(s) ({', '.join(found[:3])}) loaded "
                    f"from {source}: that checkpoint is damaged; download or convert it again")  # fmt: skip


def materialize(model: torch.nn.Module, device: torch.device, params_on: torch.device | None = None) -> None:
    """Allocate the (sharded) meta parameters on `params_on` (default `device`), uninitialised; buffers go to
    `device` with the values their constructors computed (`to_empty` would wipe them too)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=params_on or device)
    with torch.no_grad():
        for name, value in buffers.items():
            module, _, attr = name.rpartition(".")
            owner = model.get_submodule(module) if module else model
            owner._buffers[attr] = value.to(device)


def _set_full(model: torch.nn.Module, values: dict[str, torch.Tensor], broadcast: bool) -> None:
    """Whole tensors in, each rank keeps its shard. `broadcast`: only rank 0's `values` count (the others pass {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not values and not broadcast:
        return
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=False)
    set_model_state_dict(model, values, options=opts)


def describe_start(recipe: Recipe) -> str:
    """One line on how the weights were loaded (for the layout print)."""
    if not (recipe.model.sharded_load and recipe.parallel.fsdp):
        fp8_base = "; the blocks' frozen linear weights in float8 e4m3" * recipe.finetune.fp8_base
        return f"whole model on every rank, then sharded (model.sharded_load false or parallel.fsdp false){fp8_base}"
    source = "random init on rank 0, broadcast" if recipe.model.init_config is not None else "safetensors slices"
    fp8_base = "; the blocks' frozen linear weights in float8 e4m3 (quantized per rank)" * recipe.finetune.fp8_base
    offload = "; FSDP2 CPU offload (shards, gradients, optimizer state in host memory)" * recipe.parallel.cpu_offload
    return f"sharded start: meta build, FSDP2 shards filled from {source}{fp8_base}{offload}"
