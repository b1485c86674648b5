"""Build the transformer a recipe asks for: its family spec, load (or random-init) it, make it trainable."""

from __future__ import annotations

import dataclasses

import diffusers
import torch

from .config import FinetuneConfig, ModelConfig
from .models import get_family
from .models.spec import FamilySpec


def family_spec(cfg: ModelConfig) -> FamilySpec:
    """The family's spec; `model.flow_shift`, when set, replaces the primary stream's shift by a static one."""
    spec = get_family(cfg.family)
    if cfg.flow_shift is None:
        return spec
    shift = dataclasses.replace(spec.shift, kind="static", shift=cfg.flow_shift, mu_fn=None)
    return dataclasses.replace(spec, shift=shift)


def load_transformer(cfg: ModelConfig, spec: FamilySpec, seed: int) -> torch.nn.Module:
    """From a pretrained pipeline folder / hub id (`subfolder`), or random-init from `init_config` (tiny recipes)."""
    cls = getattr(diffusers, spec.transformer_class)
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(seed)  # identical initial weights on every rank (random init, and anything not in a checkpoint)
    if cfg.init_config is not None:
        model = cls.from_config(cfg.init_config).to(dtype)
    else:
        model = cls.from_pretrained(
            cfg.pretrained_path, subfolder=cfg.subfolder, revision=cfg.revision, torch_dtype=dtype
        )
    model.set_attention_backend(cfg.attention_backend)
    return model.train()


def apply_finetune(model: torch.nn.Module, cfg: FinetuneConfig, spec: FamilySpec, seed: int) -> list[str]:
    """Full: every parameter trains, in fp32 (master weights). LoRA: the base is frozen, adapters train in fp32.

    Returns the names of the trainable parameters.
    """
    torch.manual_seed(seed + 1)  # LoRA A matrices are drawn at random: the same on every rank
    if cfg.method == "full":
        model.to(torch.float32).requires_grad_(True)
    else:
        from peft import LoraConfig

        model.requires_grad_(False)
        targets = list(cfg.lora_targets or spec.lora_targets)
        model.add_adapter(
            LoraConfig(
                r=cfg.lora_rank,
                lora_alpha=cfg.lora_alpha,
                lora_dropout=cfg.lora_dropout,
                target_modules=targets,
                init_lora_weights=True,
            )  # fmt: skip
        )
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    return [n for n, p in model.named_parameters() if p.requires_grad]
