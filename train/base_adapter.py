"""`finetune.base_adapter`: LoRAs for distilled bases (Z-Image-Turbo, Flux.2 Klein, LTX distilled).

Users train on a distilled model with a frozen "training adapter" (a de-distillation LoRA) applied, then use the
trained LoRA on the distilled model without it. Here that adapter is read as the family's pipeline reads a LoRA
(train/modeling.py `read_init_lora`: diffusers' converters, any key format, rank and alpha), added as a second peft
adapter named `base_adapter`, frozen, active beside the trained one (`default`) in every training forward: the
transformer computes W x + s_b B_b A_b x + s B A x, the merged base's (W + s_b B_b A_b) x + s B A x up to float
rounding. Kept as a frozen adapter rather than merged into W, so that W stays the distilled weights bit for bit (the
fp8 base quantizes them as they are, and nothing has to be subtracted again in bf16) and the adapter can be switched
off: validation samples render with the trained adapter only (`without_base_adapter`), which is what the pipeline on
the distilled base with the exported LoRA computes. It is never trained (requires_grad False), so the checkpoint
(trainable parameters only) and the export (`get_peft_model_state_dict` of `default`) leave it out: the run reads it
from its file again on resume (finetune.* may not change at resume: train/resume.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

BASE_ADAPTER = "base_adapter"


def add_base_adapter(model: torch.nn.Module, adapter) -> dict[str, torch.Tensor]:
    """Add `adapter` (an `InitAdapter`) to `model` (whole or on the meta device) beside its trained `default` one,
    frozen and active; returns its values under `model`'s parameter names, in the trained adapters' dtype."""
    meta = next(model.parameters()).is_meta
    with torch.device("meta") if meta else contextlib.nullcontext():
        model.add_adapter(adapter.config, adapter_name=BASE_ADAPTER)  # diffusers makes it the only active one
    _activate(model, ["default", BASE_ADAPTER])
    dtype = next(p.dtype for p in model.parameters() if p.requires_grad)
    values = {n.replace(".default.", f".{BASE_ADAPTER}."): v.to(dtype) for n, v in adapter.values.items()}
    for name, p in model.named_parameters():
        if f".{BASE_ADAPTER}." in name:
            p.data = p.data.to(dtype)
    missing = sorted(n for n, _ in model.named_parameters() if f".{BASE_ADAPTER}." in n and n not in values)
    assert not missing, missing[:3]  # its config was built from the same file (read_init_lora)
    return values


def _activate(model: torch.nn.Module, names: list[str]) -> None:
    """Make `names` the active adapters of every tuner layer that has them; peft's `set_adapter` also makes them
    trainable: the base adapter is frozen again."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.set_adapter([n for n in names if n in module.lora_A])
    for name, p in model.named_parameters():
        if f".{BASE_ADAPTER}." in name:
            p.requires_grad_(False)


def has_base_adapter(model: torch.nn.Module) -> bool:
    return any(f".{BASE_ADAPTER}." in n for n, _ in model.named_parameters())


@contextlib.contextmanager
def without_base_adapter(model: torch.nn.Module) -> Iterator[None]:
    """The trained adapter alone for the block (validation samples: the distilled base with the trained LoRA)."""
    if not has_base_adapter(model):
        yield
        return
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    _activate(model, ["default"])
    try:
        yield
    finally:
        _activate(model, ["default", BASE_ADAPTER])
        for name, p in model.named_parameters():  # exactly what trained before
            p.requires_grad_(name in trainable)
