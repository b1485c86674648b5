"""LoRA files in a model's original key format (the names of the model authors' checkpoint, which ComfyUI and the
authors' code read), written from our diffusers/PEFT adapters.

A family states its format as data (:class:`LoraFormat`, in its home): the key prefix, the adapter tensors' names
(`lora_down`/`lora_up` or `lora_A`/`lora_B`), the alpha tensors, and how each adapted diffusers module is named in the
original checkpoint: one :class:`Rename` per module kind, with `{0}`, `{1}` standing for block numbers. A diffusers
module the original fuses with others (Flux's `to_q`/`to_k`/`to_v` in one `qkv` linear) names the original layer and
its place in it (`part`, `parts`): the fused adapter is exact, A stacked and B block-diagonal,

    [B_q 0 0; 0 B_k 0; 0 0 B_v] @ [A_q; A_k; A_v] = [B_q A_q; B_k A_k; B_v A_v],

with zero blocks of the same rank for a part that has no adapter (Flux's single-block `proj_mlp` when only attention
is trained), so every loader that splits fused layers (diffusers' kohya converter checks for exactly this
block-sparse form) gets each module's own adapter back. Alpha is written so that alpha / rank is each module's scale;
parts of one fused layer with different scales have their scale folded into B (alpha = rank).

The proof of a format is someone else's reader: diffusers' own converters (`<Pipeline>.load_lora_weights` of such a
file), tests/test_lora_format.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

from train.errors import UserError


@dataclass(frozen=True)
class Rename:
    """Diffusers module path -> original layer name; `{0}`, `{1}`: numbers (block indices), the same in both. A part of
    a fused original layer states its `part` of `parts` (in the original's concatenation order along the outputs)."""

    diffusers: str
    original: str
    part: int = 0
    parts: int = 1
    # False: no alpha tensor for this layer (its loader would not consume one): the scale is folded into up
    alpha: bool = True
    # the original's outputs are the diffusers module's in len(rows) equal chunks, in this order (an AdaLN's
    # (shift, scale) where diffusers has (scale, shift): (1, 0)); () keeps them
    rows: tuple[int, ...] = ()

    @cached_property
    def regex(self) -> re.Pattern:
        return re.compile(re.sub(r"\\\{(\d)\\\}", r"(?P<n\1>\\d+)", re.escape(self.diffusers)))

    def match(self, module: str) -> tuple[str, ...] | None:
        m = self.regex.fullmatch(module)
        return None if m is None else tuple(m.groupdict()[k] for k in sorted(m.groupdict()))

    def fill(self, template: str, numbers: tuple[str, ...]) -> str:
        return template.format(*numbers)


def fused(diffusers: tuple[str, ...], original: str) -> tuple[Rename, ...]:
    """The renames of diffusers modules fused into one original layer, in its concatenation order."""
    return tuple(Rename(d, original, i, len(diffusers)) for i, d in enumerate(diffusers))


@dataclass(frozen=True)
class LoraFormat:
    """A family's original LoRA key format (see the module docstring). `name`: who reads it, for docs and notes."""

    name: str
    renames: tuple[Rename, ...]
    prefix: str = "diffusion_model."
    down: str = "lora_down"
    up: str = "lora_up"
    alpha: bool = True
    # kohya / musubi style: "lora_unet_" + the layer name with "_" for "." (the prefix is then not used)
    kohya: bool = False
    # the authors' code names its modules as diffusers does (Qwen-Image, LTX-Video): a module no rename matches keeps
    # its diffusers path
    keep_names: bool = False
    metadata: Mapping[str, str] = field(default_factory=dict)
    # Full weights in the original checkpoint's names (`checkpoint.export_format` of a full fine-tune), as the
    # authors' single-file checkpoint holds them: None when the family has none here. Each parameter takes the first
    # of: a rename in `full` (matching its name, or its module's), a LoRA rename of its module, its own name.
    full: tuple[Rename, ...] | None = None

    def original_of(self, module: str) -> tuple[Rename, tuple[str, ...]] | None:
        for rename in self.renames:
            numbers = rename.match(module)
            if numbers is not None:
                return rename, numbers
        return (Rename(module, module), ()) if self.keep_names else None

    def key(self, layer: str, tensor: str) -> str:
        if self.kohya:
            return f"lora_unet_{layer.replace('.', '_')}.{tensor}"
        return f"{self.prefix}{layer}.{tensor}"

    def unmapped(self, modules: list[str]) -> list[str]:
        """The adapted modules this format has no name for (the original loader would not read them)."""
        return [m for m in modules if self.original_of(m) is None]

    def original_param(self, name: str) -> tuple[str, Rename]:
        """A diffusers parameter's name in the original full checkpoint, and the rename that placed it (its part of a
        fused tensor, its row order)."""
        module, _, leaf = name.rpartition(".")
        for rename in self.full or ():
            for path, tail in ((name, ""), (module, f".{leaf}")):
                numbers = rename.match(path)
                if numbers is not None:
                    return rename.fill(rename.original, numbers) + tail, rename
        for rename in self.renames:
            numbers = rename.match(module)
            if numbers is not None:
                return f"{rename.fill(rename.original, numbers)}.{leaf}", rename
        return name, Rename(name, name)


def check_format(fmt: LoraFormat | None, family: str, modules: list[str]) -> None:
    """Refuse, in one line, an original-format export the family cannot write: no format, or adapted modules it does
    not name (every rank has the same model: the same error, before any step)."""
    if fmt is None:
        raise UserError(f"checkpoint.export_format: {family} has no original LoRA key format here (diffusers' loaders "
                        "read only its diffusers keys); set checkpoint.export_format: diffusers")  # fmt: skip
    unmapped = fmt.unmapped(modules)
    if unmapped:
        raise UserError(f"checkpoint.export_format: {len(unmapped)} adapted module(s) of {family} have no name in the "
                        f"{fmt.name} format ({', '.join(unmapped[:3])}); drop them from finetune.lora_targets or set "
                        "checkpoint.export_format: diffusers")  # fmt: skip


@dataclass
class _Layer:
    parts: int
    members: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)  # part -> A, B, scale
    numbers: tuple[str, ...] = ()
    renames: dict[int, Rename] = field(default_factory=dict)


def to_original(
    fmt: LoraFormat,
    adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]],
    out_features: Callable[[str], int],
) -> dict[str, torch.Tensor]:
    """The original-format state dict of `adapters` (diffusers module path -> (A, B, scale), scale = alpha / r).
    `out_features(module)`: a diffusers module's output size, for the zero blocks of fused parts without adapters."""
    layers: dict[str, _Layer] = {}
    for module, (a, b, scale) in adapters.items():
        found = fmt.original_of(module)
        assert found is not None, module  # check_format refused it before training
        rename, numbers = found
        if rename.rows:
            b = torch.cat([b.chunk(len(rename.rows))[i] for i in rename.rows])
        layer = layers.setdefault(rename.fill(rename.original, numbers), _Layer(rename.parts, numbers=numbers))
        layer.members[rename.part] = (a, b, scale)
        layer.renames[rename.part] = rename
    siblings = {}
    for rename in fmt.renames:
        siblings.setdefault(rename.original, {})[rename.part] = rename
    out = {}
    for name, layer in layers.items():
        a, b, alpha = _fuse(layer, siblings, out_features)
        with_alpha = fmt.alpha and all(r.alpha for r in layer.renames.values())
        if not with_alpha:  # the loader takes alpha = rank: fold alpha / rank into up
            b = b * (alpha / a.shape[0])
        out[fmt.key(name, f"{fmt.down}.weight")] = a.contiguous()
        out[fmt.key(name, f"{fmt.up}.weight")] = b.contiguous()
        if with_alpha:
            out[fmt.key(name, "alpha")] = torch.tensor(alpha, dtype=torch.float32)
    return out


def _fuse(
    layer: _Layer, siblings: dict, out_features: Callable[[str], int]
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One original layer's (down, up, alpha) from its parts' adapters (see the module docstring)."""
    if layer.parts == 1:
        a, b, scale = layer.members[0]
        return a, b, scale * a.shape[0]
    template = next(iter(layer.renames.values())).original
    rank = max(a.shape[0] for a, _, _ in layer.members.values())
    scales = {s for _, _, s in layer.members.values()}
    fold = len(scales) > 1  # one alpha per layer: parts of different scales carry theirs in B
    scale = next(iter(scales))
    downs, ups = [], []
    for part in range(layer.parts):
        if part in layer.members:
            a, b, s = layer.members[part]
            if a.shape[0] < rank:  # a lower-rank part padded with zero rows/columns: the same product
                a = torch.cat([a, a.new_zeros(rank - a.shape[0], a.shape[1])])
                b = torch.cat([b, b.new_zeros(b.shape[0], rank - b.shape[1])], dim=1)
            downs.append(a)
            ups.append(b * s if fold else b)
        else:
            rename = siblings[template][part]
            module = rename.fill(rename.diffusers, layer.numbers)
            a0 = next(iter(layer.members.values()))[0]
            downs.append(a0.new_zeros(rank, a0.shape[1]))
            ups.append(a0.new_zeros(out_features(module), rank))
    down = torch.cat(downs)
    up = torch.block_diag(*ups)
    total = down.shape[0]
    return down, up, float(total) if fold else scale * total


def peft_adapters(lora: Mapping[str, torch.Tensor], scale: Callable[[str], float]) -> dict:
    """diffusers module path -> (A, B, scale) of a peft LoRA state dict (`get_peft_model_state_dict`: keys
    `<module>.lora_A.weight`); `scale(module)`: its alpha / r."""
    modules = [k.removesuffix(".lora_A.weight") for k in lora if k.endswith(".lora_A.weight")]
    return {m: (lora[f"{m}.lora_A.weight"], lora[f"{m}.lora_B.weight"], scale(m)) for m in modules}


def save_original(fmt: LoraFormat, state: Mapping[str, torch.Tensor], file) -> None:
    from safetensors.torch import save_file

    save_file(dict(state), str(file), {"format": "pt", "ctxtrain_format": fmt.name, **fmt.metadata})
