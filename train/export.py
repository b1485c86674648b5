"""Export trained weights in formats diffusers loads.

Full weights (`export_full`): a `from_pretrained` folder written tensor by tensor, so no rank ever holds the whole
model. The shard files are planned from shapes and dtypes first (huggingface_hub's splitter, as `save_pretrained`
does: same file names, same index), identically on every rank; then every rank walks the state dict in the same order
and gathers one tensor at a time (`DTensor.full_tensor()`, a collective); rank 0 buffers it in its shard and writes the
shard as soon as it is complete. Rank 0's peak: one open shard plus one tensor (a tensor larger than a shard gets a
shard of its own, written at once, while the current shard stays open). A model carrying peft adapters (LoRA, DoRA,
LoKr, LoHa) is exported as the plain transformer with the adapters merged into their base weights: each adapted
layer's adapter tensors are gathered with its weight, and rank 0 merges them by peft's own `get_delta_weight` (DoRA:
peft's merge, the magnitude over the norm of W + ΔW). LoHa runs export this way (no diffusers loader reads LoHa).

LoRA weights (`export_lora`): the pipeline's `save_lora_weights` (with the adapter metadata, so `lora_alpha != r`
reloads with the right scale). Adapters are small: they are gathered whole to rank 0. LoRA and DoRA files load with
`<Pipeline>.load_lora_weights(dir)`; LoKr files (`.lokr_` keys, which the pipelines' `load_lora_weights` refuses in
diffusers 0.42.1) with `pipe.transformer.load_lora_adapter(dir, prefix="transformer")`, diffusers' LoKr loader.

Both are atomic: written into `<out_dir>/.<name>.partial/` and renamed to `<out_dir>/<name>/` once complete (a previous
export of that name is replaced only then), so a killed or failed export never leaves a folder that looks like a
model. A write that fails on rank 0 (disk full, permissions) is recorded while every rank still takes part in the
gathers; then every rank raises `ExportFailed` together (the trainer checkpoints and says where).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
import torch.distributed as dist
from diffusers.utils.constants import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from train.errors import UserError
from train.files import match_umask
from train.lora_format import LoraFormat, peft_adapters, save_original, to_original
from train.runtime import keep_alive

# diffusers' names: diffusion_pytorch_model-00001-of-00003.safetensors, or diffusion_pytorch_model.safetensors alone
ORIGINAL_LORA_FILE = "lora.safetensors"  # in <name>_original/: one file, as ComfyUI users copy it
_SHARD_PATTERN = SAFETENSORS_WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors")


class ExportFailed(Exception):
    """Rank 0 could not write the export (raised on every rank, with its cause); nothing was published."""

    def __init__(self, final: Path, cause: str) -> None:
        super().__init__(f"{final}: {cause}")
        self.final, self.cause = final, cause


class _Publish:
    """One export's writes by rank 0 into its staging folder, then the rename into place (see the module docstring).
    `write(fn, ...)` runs on rank 0 only, and not at all after a failed write."""

    def __init__(self, out_dir: Path, name: str) -> None:
        self.final, self.staging = out_dir / name, out_dir / f".{name}.partial"
        self.rank0, self.error = dist.get_rank() == 0, None
        self.write(self._fresh)

    def _fresh(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)  # a killed export's leftover
        self.staging.mkdir(parents=True)

    def write(self, fn: Callable, *args) -> None:
        if self.rank0 and self.error is None:
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 — any failed write (OSError, safetensors' own IoError): reported
                self.error = f"{type(e).__name__}: {e}"

    def _swap(self) -> None:
        old = self.final.with_name(f".{self.final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if self.final.exists():
            self.final.rename(old)
        match_umask(self.staging)  # safetensors writes 0600: readable as the umask says (train/files.py)
        self.staging.rename(self.final)
        shutil.rmtree(old, ignore_errors=True)

    def finish(self) -> Path:
        """Collective: publish, or raise `ExportFailed` on every rank (the partial folder removed)."""
        self.write(self._swap)
        box = [self.error]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            if self.rank0:
                shutil.rmtree(self.staging, ignore_errors=True)
            raise ExportFailed(self.final, box[0])
        return self.final


@dataclass(frozen=True)
class Exported:
    """What `export_full` wrote: the folder, its shard files, the bytes of all tensors, and the most bytes rank 0
    held buffered at once (0 on the other ranks)."""

    path: Path
    shards: int
    total_bytes: int
    peak_buffered_bytes: int


@dataclass(frozen=True)
class _Entry:
    """One tensor of the exported folder: `key` (a plain transformer's), read from the model's state-dict key
    `source`; for an adapted weight, the peft layer `layer` whose active adapters merge into it and the state keys of
    those adapters' tensors (gathered with it)."""

    key: str
    source: str
    layer: str | None = None
    adapter_keys: tuple[str, ...] = ()


def _entries(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> list[_Entry]:
    """The exported tensors in state-dict order: peft's `<layer>.base_layer.<p>` becomes `<layer>.<p>`, and the
    active adapters of each adapted layer (any kind) merge into its weight. Any other adapter tensor (a LoRA bias, an
    inactive adapter) cannot be merged here."""
    from train.modeling import adapter_factor

    by_layer: dict[str, list[tuple[str, str]]] = {}  # "<layer>.<factor>.<adapter>..." -> layer, adapter name
    for k in state:
        factor = adapter_factor(k)
        if factor is not None:
            layer_name, _, rest = k.partition(f".{factor}.")
            by_layer.setdefault(layer_name, []).append((k, rest.split(".")[0]))
    entries, merged = [], set()
    for name in state:
        if adapter_factor(name) is not None:
            continue
        if ".base_layer." not in name:
            entries.append(_Entry(name, name))
            continue
        layer_name, param = name.split(".base_layer.")
        if param != "weight":
            entries.append(_Entry(f"{layer_name}.{param}", name))
            continue
        active = model.get_submodule(layer_name).active_adapters
        keys = tuple(k for k, a in by_layer.get(layer_name, []) if a in active and not k.endswith(".bias"))
        merged.update(keys)
        entries.append(_Entry(f"{layer_name}.{param}", name, layer_name, keys))
    left = [n for n in state if adapter_factor(n) is not None and n not in merged]
    if left:
        raise UserError(f"export_full merges the active adapters' weights only, not {left[:3]} ({len(left)} such "
                         "tensors: a LoRA bias or inactive adapters); set checkpoint.export=lora to export the "
                         "adapters instead")  # fmt: skip
    return entries


@contextlib.contextmanager
def _swapped(layer: torch.nn.Module, values: dict[str, torch.Tensor]):
    """`layer`'s parameters named by `values` (relative names) replaced by those whole tensors, then put back: peft's
    own methods then compute on the gathered adapters (rank 0 only, between collectives)."""
    saved = []
    for name, value in values.items():
        owner, _, attr = name.rpartition(".")
        module = layer.get_submodule(owner)
        saved.append((module, attr, module._parameters[attr]))
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
    try:
        yield
    finally:
        for module, attr, param in saved:
            module._parameters[attr] = param


def _merged(layer: torch.nn.Module, weight: torch.Tensor, adapters: dict[str, torch.Tensor]) -> torch.Tensor:
    """`weight` (whole) with `layer`'s active adapters merged, in fp32, as peft's `merge` does: W + ΔW from each
    adapter's `get_delta_weight`; DoRA: (m / ‖W + ΔW‖_row) · (W + ΔW)."""
    from peft.tuners.lora import LoraLayer

    w = weight.float()
    with _swapped(layer, adapters):
        for a in layer.active_adapters:
            delta = layer.get_delta_weight(a).float()
            if isinstance(layer, LoraLayer) and a in layer.lora_magnitude_vector:  # DoRA
                dora = layer.lora_magnitude_vector[a]
                norm = dora.get_weight_norm(w, delta, scaling=1).detach()
                w = (dora.weight.float() / norm)[:, None] * (w + delta)
            else:
                w = w + delta
    return w


def _full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor on CPU. A DTensor (FSDP2 shards) is gathered: a collective, every rank in the same order; a
    plain tensor (no FSDP, buffers) is taken as it is."""
    return (value.full_tensor() if isinstance(value, DTensor) else value).cpu()


def _save_config(model: torch.nn.Module, path: Path) -> None:
    """The model's own `save_config`, under its own class name: `fully_shard` swaps in a subclass named
    `FSDP<Class>`, which `save_config` would record (and `AutoModel.from_pretrained` could not resolve)."""
    model.save_config(path)
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    config = json.loads((path / "config.json").read_text())
    config["_class_name"] = cls.__name__
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def gathered(model: torch.nn.Module, state: dict[str, torch.Tensor], entries: list[_Entry]):
    """Each entry and its whole tensor, in order (collectives: every rank walks it); on rank 0 with the active
    adapters merged in fp32 and cast back to the base weight's dtype (elsewhere not merged: only rank 0 writes)."""
    for e in entries:
        keep_alive()  # the export phase's deadline is per tensor (train/runtime.py), not for the whole model
        value = _full(state[e.source])
        adapters = {k.removeprefix(f"{e.layer}."): _full(state[k]) for k in e.adapter_keys}
        if adapters and dist.get_rank() == 0:
            value = _merged(model.get_submodule(e.layer), value, adapters).to(value.dtype)
        yield e, value


@torch.no_grad()
def export_full(
    model: torch.nn.Module, out_dir: Path, max_shard_size: int | str = "2GB", name: str = "transformer"
) -> Exported:
    """Write `<out_dir>/<name>/` (config + safetensors shards + index) for `from_pretrained`, one gathered tensor
    at a time. Collective: every rank calls it. `max_shard_size` in bytes or as "10GB" / "500MB" (diffusers' unit);
    2GB rather than diffusers' 10GB because rank 0 holds one whole shard."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    state = model.state_dict()  # persistent state only; FSDP2 keeps the original names, its params are DTensors
    entries = _entries(model, state)
    # The plan, from shapes and dtypes alone (meta tensors: no memory): the same on every rank.
    shapes = {e.key: torch.empty(state[e.source].shape, dtype=state[e.source].dtype, device="meta") for e in entries}
    plan = split_torch_state_dict_into_shards(shapes, max_shard_size=max_shard_size, filename_pattern=_SHARD_PATTERN)
    publish, rank = _Publish(out_dir, name), dist.get_rank()
    path = publish.staging
    publish.write(_save_config, model, path)

    left = {file: len(keys) for file, keys in plan.filename_to_tensors.items()}
    open_shards: dict[str, dict[str, torch.Tensor]] = {file: {} for file in left}
    buffered = peak = 0
    for e, value in gathered(model, state, entries):
        if rank != 0:
            continue
        file = plan.tensor_to_filename[e.key]
        open_shards[file][e.key] = value.contiguous()
        buffered += value.nbytes
        peak = max(peak, buffered)
        left[file] -= 1
        if left[file] == 0:
            shard = open_shards.pop(file)
            publish.write(save_file, shard, str(path / file), {"format": "pt"})
            buffered -= sum(t.nbytes for t in shard.values())
    if plan.is_sharded:
        index = {"metadata": dict(plan.metadata), "weight_map": plan.tensor_to_filename}
        publish.write((path / SAFE_WEIGHTS_INDEX_NAME).write_text, json.dumps(index, indent=2, sort_keys=True) + "\n")
    path = publish.finish()
    return Exported(path, len(plan.filename_to_tensors), plan.metadata["total_size"], peak)


def _full_state_dict(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    # Collective: every rank must call it (FSDP2 shards are gathered to rank 0, on CPU).
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=opts)


def export_lora(
    model: torch.nn.Module, pipeline_class: str, out_dir: Path, name: str = "lora",
    original: LoraFormat | None = None, diffusers_keys: bool = True,
) -> list[Path]:  # fmt: skip
    """LoRA weights as `<out_dir>/<name>/pytorch_lora_weights.safetensors`, which `<Pipeline>.load_lora_weights(dir)`
    accepts (`diffusers_keys`), and with `original` (the family's format, train/lora_format.py) the same adapters in
    the model's original keys as `<out_dir>/<name>_original/lora.safetensors`, the file ComfyUI and the authors' code
    read. Collective; each folder published whole."""
    from peft.utils import get_peft_model_state_dict

    state = _full_state_dict(model, trainable_only=True)
    lora = get_peft_model_state_dict(model, state_dict=state) if dist.get_rank() == 0 else {}
    paths = []
    if diffusers_keys:
        publish = _Publish(out_dir, name)
        publish.write(write_diffusers_lora, model, lora, pipeline_class, publish.staging)
        paths.append(publish.finish())
    if original is not None:
        publish = _Publish(out_dir, f"{name}_original")
        publish.write(write_original_lora, model, lora, original, publish.staging)
        paths.append(publish.finish())
    return paths


def write_diffusers_lora(
    model: torch.nn.Module, lora: dict[str, torch.Tensor], pipeline_class: str, folder: Path
) -> None:
    """`lora` (peft's state dict of `model`'s adapters) as the pipeline's `save_lora_weights` writes it, with the
    adapter metadata (so `lora_alpha != r` reloads with the right scale)."""
    pipeline = getattr(diffusers, pipeline_class)
    if not hasattr(pipeline, "save_lora_weights"):  # no LoRA loader (HunyuanVideo15Pipeline in diffusers 0.42.1):
        # the same transformer-only file, for `pipe.transformer.load_lora_adapter(dir, prefix="transformer")`
        pipeline = diffusers.loaders.HunyuanVideoLoraLoaderMixin
    metadata = model.peft_config["default"].to_dict()
    pipeline.save_lora_weights(folder, transformer_lora_layers=lora, transformer_lora_adapter_metadata=metadata)


def write_original_lora(model: torch.nn.Module, lora: dict[str, torch.Tensor], fmt: LoraFormat, folder: Path) -> None:
    """`lora` in the family's original key format (train/lora_format.py) as `folder/lora.safetensors`."""
    adapters = peft_adapters(lora, lambda m: model.get_submodule(m).scaling["default"])
    state = to_original(fmt, adapters, lambda m: model.get_submodule(m).out_features)
    save_original(fmt, state, folder / ORIGINAL_LORA_FILE)
