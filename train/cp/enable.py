"""Turn on trainable Ulysses-Anything context parallelism on a diffusers model, on any device type (CPU included).

`ModelMixin.enable_parallelism` cannot be used on CPU (it computes `rank % torch.accelerator.device_count()`, which
divides by zero without an accelerator), so the model's CP state (state.py: a diffusers `ParallelConfig` that also
holds the plan, the model's layout registry and transport) is set up here directly, on a given ("ring", "ulysses")
mesh that may be a sub-mesh of a larger one (so CP composes with FSDP). The plan's hooks are diffusers' own split and
gather hooks, subclassed to record each split in, and gather through, that model's state.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from diffusers.hooks.context_parallel import (
    _CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE,
    _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE,
    ContextParallelGatherHook,
    ContextParallelSplitHook,
    PartitionAnythingSharder,
)
from diffusers.hooks.hooks import HookRegistry
from diffusers.models._modeling_parallel import ContextParallelOutput
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from train.errors import UserError

from .comm import TorchTransport
from .kernels import check as check_kernel
from .plans import (
    CPPlanSpec,
    _find_modules,
    load_plan_file,
    local_attention_processors,
    plan_for,
    training_problems,
    validate_plan,
)
from .state import ContextParallelState, cp_device_type
from .ulysses import GatherAnything, install_ulysses_anything_backward

__all__ = ["ContextParallelState", "check_tokens", "enable_context_parallel", "cp_device_type"]


def check_tokens(cp: int, spec: Any, shapes: dict[str, dict[str, Any]], model_config: Any) -> None:
    """Each rank of a CP group needs at least one token of every sequence the plan splits: a sample with fewer
    transformer tokens than `cp` would fail deep inside a diffusers split. `shapes`: bucket -> the per-sample shapes
    of the noised streams (synthetic shapes or the cache manifest's); `spec`: the family's FamilySpec. Checked at
    startup, before any process group exists; raises UserError."""

    for bucket, streams in shapes.items():
        tokens = spec.tokens_per_sample(streams, model_config)
        if tokens < cp:
            latents = "x".join(str(n) for n in streams["latents"])
            raise UserError(
                f"parallel.cp={cp} is more than the {tokens} transformer token(s) of a {bucket} sample (latents "
                f"{latents} after the model's patching), and each CP rank needs at least one: set parallel.cp <= "
                f"{tokens}, or train on larger samples"
            )


def _resolve_mesh(mesh: DeviceMesh | None, degree: int | None, ring: int) -> DeviceMesh:
    if mesh is not None:
        names = mesh.mesh_dim_names or ()
        if "ring" not in names or "ulysses" not in names:
            raise ValueError(f"the CP mesh needs dims named 'ring' and 'ulysses'; got {names}")
        size = mesh["ring"].size() * mesh["ulysses"].size()
        if degree is not None and degree != size:
            raise ValueError(f"degree={degree} disagrees with the mesh's 'ring' x 'ulysses' size {size}")
        return mesh
    world = dist.get_world_size()
    degree = world if degree is None else degree
    if degree < 1 or world % degree:
        raise ValueError(f"CP degree {degree} must divide the world size {world}")
    if ring < 1 or degree % ring:
        raise ValueError(f"ring degree {ring} must divide the CP degree {degree}")
    # Consecutive ranks form a CP group (fastest interconnect); the leading dim enumerates the CP groups. Inside one,
    # rank = ring index x U + Ulysses index: Ulysses groups are consecutive ranks (one node), ring groups stride.
    full = init_device_mesh(
        cp_device_type(), (world // degree, ring, degree // ring), mesh_dim_names=("cp_groups", "ring", "ulysses")
    )
    return full["ring", "ulysses"]


def _resolve_plan(model: torch.nn.Module, plan: CPPlanSpec | str | os.PathLike | dict | None) -> CPPlanSpec:
    if plan is None:
        return plan_for(model)
    if isinstance(plan, CPPlanSpec):
        return plan
    if isinstance(plan, dict):  # a diffusers-format plan, e.g. a model's own `_cp_plan`
        return CPPlanSpec(model_class=type(model).__name__, training_supported=True, reason=None,
                          per_head_mask_inputs=(), plan=plan, path=Path("<dict>"))  # fmt: skip
    return load_plan_file(Path(plan))


def _cp_processors(model: torch.nn.Module, spec: CPPlanSpec) -> list[Any]:
    """The attention processors that attend through Ulysses: every processor, less the plan's `local_attention` ones.
    Refuses a backend without a CP path, and a local processor shared with a CP module."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    from diffusers.models.attention_processor import Attention

    # Processors must use a backend that has a CP path (on CPU that is "native").
    processors = [m.processor for m in model.modules() if isinstance(m, (Attention, AttentionModuleMixin))]
    for proc in processors:
        if proc is None or not hasattr(proc, "_attention_backend"):
            continue
        backend = proc._attention_backend
        backend = AttentionBackendName(backend) if backend else _AttentionBackendRegistry.get_active_backend()[0]
        if not _AttentionBackendRegistry._is_context_parallel_available(backend):
            supported = sorted(b.value for b in _AttentionBackendRegistry._supports_context_parallel)
            raise UserError(
                f"attention backend '{backend.value}' has no context-parallel path; call "
                f"model.set_attention_backend(...) (recipe: model.attention_backend) with one of {supported} first"
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
    return [p for p in processors if p is not None and hasattr(p, "_parallel_config") and id(p) not in local]


def _install_guard(model: torch.nn.Module, state: ContextParallelState, enforce: bool) -> None:
    """A forward pre-hook: runs before the CP hooks, so it refuses a training forward before any collective. It also
    starts the model's layout registry afresh for each forward (the split hooks then record its partitions)."""
    spec, layout = state.plan, state.layout
    problems = list(state.problems) if enforce else []
    names = list(inspect.signature(type(model).forward).parameters)[1:]  # forward()'s arguments, without self

    def guard(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        layout.reset(spec.layout_registry)
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in module.parameters()):
            return  # inference and grad-free forwards stay allowed
        bound = {**dict(zip(names, args)), **kwargs}  # a mask passed by position counts too
        fed = [name for name in spec.per_head_mask_inputs if bound.get(name) is not None]
        if fed:
            raise ValueError(
                f"{type(module).__name__}'s plan {spec.path} lists {fed} as masks Ulysses cannot shard "
                "(per_head_mask_inputs). Train without them: pass " + ", ".join(f"{n}=None" for n in fed)
            )
        if problems:
            raise UserError(
                f"{type(module).__name__} cannot be trained under context parallelism with plan {spec.path}: "
                + "; ".join(problems)
            )

    model.register_forward_pre_hook(guard, with_kwargs=True)


def _checkpoint_with_layout_by_default(model: torch.nn.Module, state: ContextParallelState) -> None:
    """`model.enable_gradient_checkpointing()` (no function given) now uses the model's `layout.checkpoint`, whose
    recompute sees the layout registry of its own forward (layout.py); any other function stays correct, exchanging
    sizes."""
    enable = model.enable_gradient_checkpointing

    @functools.wraps(enable)
    def enable_gradient_checkpointing(gradient_checkpointing_func=None) -> None:
        enable(gradient_checkpointing_func or state.layout.checkpoint)

    model.enable_gradient_checkpointing = enable_gradient_checkpointing


class _SplitHook(ContextParallelSplitHook):
    """diffusers' split hook that also records each split it makes in the model's layout registry: a tensor of global
    length L split over W ranks has per-rank sizes `tensor_split(L, W)`, the same on every rank. Each split is
    recorded under its plan name, "<plan path>:<input name or output index>" (a plan's `joint_key_mask` names them)."""

    def __init__(self, metadata, state: ContextParallelState, path: str) -> None:
        super().__init__(metadata, state.context_parallel_config)
        self.layout = state.layout
        self.names: dict[int, str] = {}  # id(spec) -> its plan name (a list argument: one name per element)
        for key, spec in metadata.items():
            for i, one in enumerate(spec if isinstance(spec, (list, tuple)) else [spec]):
                suffix = f"[{i}]" if isinstance(spec, (list, tuple)) else ""
                self.names[id(one)] = f"{path}:{key}{suffix}"

    def post_forward(self, module: torch.nn.Module, output):
        # A module that only splits inputs may return anything (a block returning (tokens, None)); diffusers' hook
        # rejects any output that is not tensors, even when it splits none.
        if not any(getattr(spec, "split_output", False) for spec in self.metadata.values()):
            return output
        return super().post_forward(module, output)

    def _prepare_cp_input(self, x: torch.Tensor, cp_input) -> torch.Tensor:
        if cp_input.expected_dims is not None and x.dim() != cp_input.expected_dims:
            return super()._prepare_cp_input(x, cp_input)  # diffusers warns and leaves x whole
        # Always the uneven split over the whole CP group: diffusers would split evenly (and assert divisibility)
        # when neither "anything" flag is set, which is the ring x Ulysses hybrid's case.
        mesh = self.parallel_config._flattened_mesh
        self.layout.record(x.size(cp_input.split_dim), mesh.size(), self.names.get(id(cp_input)))
        return PartitionAnythingSharder.shard_anything(x, cp_input.split_dim, mesh)


class _GatherHook(ContextParallelGatherHook):
    """diffusers' gather hook, gathering uneven shards through the model's state: shard sizes from its layout
    registry (no size exchange when the registry identifies them), bytes counted by its transport."""

    def __init__(self, metadata, state: ContextParallelState) -> None:
        super().__init__(metadata, state.context_parallel_config)
        self.layout, self.transport = state.layout, state.transport
        self.tail = state.plan.replicated_tail

    def post_forward(self, module: torch.nn.Module, output):
        is_tensor = isinstance(output, torch.Tensor)
        outputs = [output] if is_tensor else list(output)
        kept = (x for x, cpm in zip(outputs, self.metadata) if cpm is not None)  # null specs: left as they are
        if not all(isinstance(x, torch.Tensor) for x in kept) or len(outputs) != len(self.metadata):
            raise ValueError(f"expected {len(self.metadata)} output tensor(s) to gather, got {type(output)}")
        group = self.parallel_config._flattened_mesh.get_group()
        for i, cpm in enumerate(self.metadata):
            if cpm is not None:
                outputs[i] = GatherAnything.apply(outputs[i], cpm.gather_dim, group, self.layout, self.transport)
                if self.tail:  # undoes the output's 1/CP for what came before the gather (_scale_output_grad)
                    outputs[i] = ScaleGrad.apply(outputs[i], float(dist.get_world_size(group)))
        return outputs[0] if is_tensor else tuple(outputs)


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def _scale_output_grad(model: torch.nn.Module, state: ContextParallelState) -> None:
    """A plan with a replicated tail: every rank runs the modules after the gather on the whole sequence, so each
    holds their FULL gradient, which the SUM over CP ranks would count CP times. Dividing the model output's gradient
    by the CP degree gives them 1/CP each; the gathers multiply theirs back, so what runs before a gather keeps its
    share. Exact for any plan (scaling by 2 or 4 is exact in floating point; by 3, within a rounding)."""
    cp = float(dist.get_world_size(state.cp_group))

    def scale(tensor: Any) -> Any:
        return ScaleGrad.apply(tensor, 1.0 / cp) if torch.is_tensor(tensor) and tensor.requires_grad else tensor

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, dict):  # diffusers' BaseOutput (an OrderedDict dataclass)
            for key in list(output.keys()):
                output[key] = scale(output[key])
            return output
        return type(output)(scale(t) for t in output) if isinstance(output, tuple) else scale(output)

    model.register_forward_hook(hook)


def _apply_hooks(model: torch.nn.Module, state: ContextParallelState, plan: dict) -> None:
    """diffusers' `apply_context_parallel`, with the hooks above (same hook names, so `remove_context_parallel`
    still removes them)."""
    for module_id, entry in plan.items():
        found, error = _find_modules(model, module_id)  # diffusers' lookup, plus `-1` (the last block)
        assert error is None, (module_id, error)  # validate_plan checked
        for _, m in found:
            if isinstance(entry, dict):
                hook, name = (
                    _SplitHook(entry, state, module_id),
                    _CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE.format(module_id),
                )
            else:
                gathers = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
                assert all(g is None or isinstance(g, ContextParallelOutput) for g in gathers), entry  # validated
                hook, name = _GatherHook(gathers, state), _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE.format(module_id)
            HookRegistry.check_if_exists_or_initialize(m).register_hook(hook, name)


def enable_context_parallel(
    model: torch.nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    degree: int | None = None,
    ring: int = 1,
    plan: CPPlanSpec | str | os.PathLike | dict | None = None,
    for_training: bool | None = None,
    transport: str | TorchTransport = "torch",
    kernel: str = "auto",
) -> ContextParallelState:
    """Enable trainable Ulysses-Anything, Ring-Anything or hybrid ring x Ulysses CP on a diffusers `ModelMixin`;
    returns the model's `ContextParallelState`.

    The state is a diffusers `ParallelConfig` (also set as `model._parallel_config`, so `GradReduction.for_model`
    and diffusers read it as theirs) holding everything CP keeps for this model: `.plan`, `.layout` (its layout
    registry), `.transport` (and `.stats`), `.problems`, `.scope`.

    Args:
        model: a diffusers transformer. Call this before activation checkpointing, compile and FSDP wrapping.
        mesh: a DeviceMesh with dims ("ring", "ulysses"); may be a sub-mesh of a larger mesh. Ring 1: Ulysses-
            Anything; Ulysses 1: Ring-Anything; both > 1: the hybrid (train/cp/ring.py). Default: a new mesh whose CP
            groups are `degree` consecutive ranks, `ring` x (degree / ring) with Ulysses groups consecutive.
        degree: CP degree (ring x Ulysses) when no mesh is given (default: the world size).
        ring: ring degree when no mesh is given (default 1: Ulysses only).
        plan: a plan file path, a loaded `CPPlanSpec`, or a diffusers-format dict (default: the shipped plan for the
            model's class in `cp_plans/`). The plan is validated against the model.
        for_training: True → refuse now if the plan cannot train correctly; None (default) → refuse the first
            forward that would compute gradients; False → no training guard (inference only).
        transport: "torch" (all_to_all_single, everywhere) or "symm_mem" (intra-node CUDA symmetric memory after a
            self-test, else torch with the reason said once); set up on the CP subgroup only. Or another model's
            `state.transport`, to share one symmetric-memory buffer (and its stats) between two models.
        kernel: the attention kernel the CP attention calls (kernels.py): "auto" (the fastest that runs each call on
            this device), a kernel's name, or "backend" (the op pair of the model's diffusers attention backend).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before enable_context_parallel")
    if getattr(model, "_parallel_config", None) is not None:  # diffusers' attribute, None until parallelism is on
        raise RuntimeError(f"parallelism is already enabled on this {type(model).__name__}")

    check_kernel(kernel, torch.device(cp_device_type()))
    spec = _resolve_plan(model, plan)
    validate_plan(spec, model)
    problems = training_problems(spec, model)
    if for_training and problems:
        raise UserError(f"{type(model).__name__} cannot be trained under context parallelism: " + "; ".join(problems))
    if spec.cp_processors:  # the plan's processor swap (a function of the family's home), before CP collects them
        module_name, _, function = spec.cp_processors.partition(":")
        getattr(importlib.import_module(module_name), function)(model)
    processors = _cp_processors(model, spec)

    install_ulysses_anything_backward()  # Ulysses, ring and ring x Ulysses (patch.py)
    mesh = _resolve_mesh(mesh, degree, ring)
    if mesh["ring"].size() * mesh["ulysses"].size() < 2:
        raise ValueError("a CP degree of 1 needs no context parallelism; do not call enable_context_parallel")
    state = ContextParallelState.on_mesh(mesh, transport=transport, plan=spec, problems=tuple(problems),
                                         scope=type(model).__name__, kernel=kernel)  # fmt: skip
    # diffusers' own attributes: its attention dispatch hands a processor's `_parallel_config` to the Ulysses
    # function, which reads the model's registry and transport from it.
    model._parallel_config = state
    for proc in processors:
        proc._parallel_config = state
    _install_guard(model, state, enforce=for_training is not False)
    _checkpoint_with_layout_by_default(model, state)
    # The plan, then the gathers of paths it also splits (diffusers' lookup expands their wildcards).
    _apply_hooks(model, state, spec.plan)
    _apply_hooks(model, state, spec.extra_gathers)
    if spec.replicated_tail:
        _scale_output_grad(model, state)
    return state
