"""Turn on trainable Ulysses-Anything context parallelism on a diffusers model, on any device type (CPU included).

`ModelMixin.enable_parallelism` cannot be used on CPU (it computes `rank % torch.accelerator.device_count()`, which
divides by zero without an accelerator), so the diffusers ParallelConfig is set up here directly, on a given
("ring", "ulysses") mesh that may be a sub-mesh of a larger one (so CP composes with FSDP), and the plan's hooks are
registered with diffusers' own `apply_context_parallel`.
"""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .comm import select_transport
from .layout import REGISTRY, checkpoint_with_layout
from .plans import (
    CPPlanSpec,
    load_plan_file,
    local_attention_processors,
    plan_for,
    training_problems,
    validate_plan,
)
from .ulysses import install_ulysses_anything_backward

__all__ = ["enable_context_parallel", "cp_device_type"]


def cp_device_type() -> str:
    """The device type collectives run on: the accelerator when torch has one with devices, else CPU."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None and torch.accelerator.device_count() > 0 else "cpu"


def _local_device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(
        device_type, int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.accelerator.device_count()))
    )


def _resolve_mesh(mesh: DeviceMesh | None, degree: int | None) -> DeviceMesh:
    if mesh is not None:
        names = mesh.mesh_dim_names or ()
        if "ring" not in names or "ulysses" not in names:
            raise ValueError(f"the CP mesh needs dims named 'ring' and 'ulysses'; got {names}")
        if mesh["ring"].size() != 1:
            raise ValueError(
                f"only Ulysses CP trains with uneven shapes: the 'ring' dim must be 1, got {mesh['ring'].size()}"
            )
        if degree is not None and degree != mesh["ulysses"].size():
            raise ValueError(f"degree={degree} disagrees with the mesh's 'ulysses' size {mesh['ulysses'].size()}")
        return mesh
    world = dist.get_world_size()
    degree = world if degree is None else degree
    if degree < 1 or world % degree:
        raise ValueError(f"CP degree {degree} must divide the world size {world}")
    # Consecutive ranks form a CP group (fastest interconnect); the leading dim enumerates the CP groups.
    full = init_device_mesh(
        cp_device_type(), (world // degree, 1, degree), mesh_dim_names=("cp_groups", "ring", "ulysses")
    )
    return full["ring", "ulysses"]


def _resolve_plan(model: torch.nn.Module, plan: CPPlanSpec | str | os.PathLike | dict | None) -> CPPlanSpec:
    if plan is None:
        return plan_for(model)
    if isinstance(plan, CPPlanSpec):
        return plan
    if isinstance(plan, dict):  # a diffusers-format plan, e.g. a model's own `_cp_plan`
        return CPPlanSpec(type(model).__name__, True, None, (), plan, Path("<dict>"))
    return load_plan_file(Path(plan))


_ENABLED_MODELS = 0


def _install_guards(model: torch.nn.Module, spec: CPPlanSpec, problems: list[str]) -> None:
    """A forward pre-hook: runs before diffusers' CP hooks, so it refuses a training forward before any collective."""
    mask_args = spec.per_head_mask_inputs
    # Layout verdicts are per model. A serial number, not id(): every rank enables the same models in the same
    # order, so the numbers agree, while a recycled id() could hit on one rank and miss on another.
    global _ENABLED_MODELS
    _ENABLED_MODELS += 1
    scope = f"{type(model).__name__}#{_ENABLED_MODELS}"

    names = list(inspect.signature(type(model).forward).parameters)[1:]  # forward()'s arguments, without self

    def guard(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        REGISTRY.reset(spec.layout_registry, scope)  # a new forward: the split hooks record its partitions afresh
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in module.parameters()):
            return  # inference and grad-free forwards stay allowed
        bound = {**dict(zip(names, args)), **kwargs}  # a mask passed by position counts too
        fed = [name for name in mask_args if bound.get(name) is not None]
        if fed:
            raise ValueError(
                f"{type(module).__name__}'s attention processors turn {fed} into per-head (B, heads, 1, S) masks, "
                "which Ulysses cannot shard across ranks. Train without the text mask: pass "
                + ", ".join(f"{n}=None" for n in fed)
            )
        if problems:
            raise ValueError(
                f"{type(module).__name__} cannot be trained under context parallelism with plan {spec.path}: "
                + "; ".join(problems)
            )

    model.register_forward_pre_hook(guard, with_kwargs=True)


def _checkpoint_with_layout_by_default(model: torch.nn.Module) -> None:
    """`model.enable_gradient_checkpointing()` (no function given) now uses `checkpoint_with_layout`, whose recompute
    sees the layout registry of its own forward (layout.py); any other function stays correct, exchanging sizes."""
    enable = model.enable_gradient_checkpointing

    @functools.wraps(enable)
    def enable_gradient_checkpointing(gradient_checkpointing_func=None) -> None:
        enable(gradient_checkpointing_func or checkpoint_with_layout)

    model.enable_gradient_checkpointing = enable_gradient_checkpointing


def enable_context_parallel(
    model: torch.nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    degree: int | None = None,
    plan: CPPlanSpec | str | os.PathLike | dict | None = None,
    for_training: bool | None = None,
    transport: str = "torch",
):
    """Enable trainable Ulysses-Anything CP on a diffusers `ModelMixin`; returns its diffusers `ParallelConfig`.

    Args:
        model: a diffusers transformer. Call this before activation checkpointing, compile and FSDP wrapping.
        mesh: a DeviceMesh with dims ("ring", "ulysses"), ring of size 1; may be a sub-mesh of a larger mesh.
            Default: a new mesh whose CP groups are `degree` consecutive ranks.
        degree: CP degree when no mesh is given (default: the world size).
        plan: a plan file path, a loaded `CPPlanSpec`, or a diffusers-format dict (default: the shipped plan for the
            model's class in `cp_plans/`). The plan is validated against the model.
        for_training: True → refuse now if the plan cannot train correctly; None (default) → refuse the first
            forward that would compute gradients; False → no training guard (inference only).
        transport: "torch" (all_to_all_single, everywhere) or "symm_mem" (intra-node CUDA symmetric memory after a
            self-test, else torch with the reason logged once); set up on the CP subgroup only.
    """
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    from diffusers.models.attention_processor import Attention

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before enable_context_parallel")
    if getattr(model, "_parallel_config", None) is not None:
        raise RuntimeError(f"parallelism is already enabled on this {type(model).__name__}")

    spec = _resolve_plan(model, plan)
    validate_plan(spec, model)
    problems = training_problems(spec, model)
    if for_training and problems:
        raise ValueError(f"{type(model).__name__} cannot be trained under context parallelism: " + "; ".join(problems))

    # Processors must use a backend that has a CP path (on CPU that is "native").
    processors = [m.processor for m in model.modules() if isinstance(m, (Attention, AttentionModuleMixin))]
    for proc in processors:
        if proc is None or not hasattr(proc, "_attention_backend"):
            continue
        backend = proc._attention_backend
        backend = AttentionBackendName(backend) if backend else _AttentionBackendRegistry.get_active_backend()[0]
        if not _AttentionBackendRegistry._is_context_parallel_available(backend):
            supported = sorted(b.value for b in _AttentionBackendRegistry._supports_context_parallel)
            raise ValueError(
                f"attention backend '{backend.value}' has no context-parallel path; call "
                f"model.set_attention_backend(...) with one of {supported} first"
            )

    # The plan's `local_attention` modules attend on replicated tokens without CP; their processors must not be
    # shared with a module that attends on split tokens (set_attn_processor(one_instance) shares one everywhere).
    local_procs = local_attention_processors(model, spec.local_attention)
    local = {id(p) for p in local_procs}
    if local and len(local_procs) != sum(id(p) in local for p in processors):
        raise ValueError(
            f"{type(model).__name__}: the attention processors of {list(spec.local_attention)} (attending without "
            "CP, per the plan's local_attention) are shared with other attention modules; give those modules their "
            "own processor instances (e.g. set_attn_processor with a dict, or the default processors)"
        )

    install_ulysses_anything_backward()
    mesh = _resolve_mesh(mesh, degree)
    degree = mesh["ulysses"].size()
    if degree < 2:
        raise ValueError("a CP degree of 1 needs no context parallelism; do not call enable_context_parallel")
    cp_config = ContextParallelConfig(ring_degree=1, ulysses_degree=degree, ulysses_anything=True, mesh=mesh)
    config = ParallelConfig(context_parallel_config=cp_config)
    device = _local_device(mesh.device_type)
    config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
    select_transport(transport, mesh["ulysses"].get_group(), device)
    model._parallel_config = config
    for proc in processors:
        if proc is not None and hasattr(proc, "_parallel_config") and id(proc) not in local:
            proc._parallel_config = config
    _install_guards(model, spec, problems if for_training is not False else [])
    _checkpoint_with_layout_by_default(model)
    apply_context_parallel(model, cp_config, spec.diffusers_plan(model))
    model._cp_plan_spec = spec  # for reporting (which plan file is active)
    return config
