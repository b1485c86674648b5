"""Model-level parity: every family's tiny model under every CP layout vs the pipeline-form serial oracle.

The oracle (train/tools/oracle.py): the plain diffusers transformer, no CP, on one training step's inputs exactly as
the family's pipeline builds them (train/step.py `prepare`): a batch of 2 with each sample's prompt padded to a
different length and the real text mask, the whole text. The CP run is the same step on a model with
`enable_context_parallel`, gradients SUM-reduced over the whole CP group. Compared: output (absolute), loss and EVERY
parameter gradient (relative, max |cp - serial| / max |serial|).

Layouts (ring x Ulysses), one shared process group per world size (tests/harness.py `rank_job`):
Ulysses 2, 3, 4; ring 2 x 1; ring 2 x Ulysses 2; ring 4 x 1. Per layout fp32; fp32 with the trainer's activation
checkpointing (per block) on Ulysses 2, ring 2 x 1 and ring 2 x Ulysses 2; fp64 for the Ulysses layouts and ring 4 x 1
(exact up to rounding).
Tiny models have 7 heads and token counts that 2, 3 and 4 do not divide. On the Ulysses fp32 run also: no size
exchange in any layer (layout registry), the same result with the registry in verify mode, MEAN over CP is wrong
(1/cp, at CP 2), and the collectives counted underneath torch.distributed (every c10d op, by a dispatch mode) are 4
all-to-alls per CP attention call, all of them through the model's transport. HunyuanVideo without its plan's
`joint_key_mask` is refused on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.harness import rank_job, session_dir
from train.cp.plans import plan_for
from train.tools.oracle import Errors, compare, run_step
from train.tools.tiny_models import FAMILY_NAMES, build_model, family_case, get_family

pytestmark = pytest.mark.slow

# Relative gradient error. fp32 CP reorders sums (other sequence chunks per rank); fp64 shows the math is exact.
TOL = {"float32": 2e-5, "float64": 1e-10}
OUT_TOL = {"float32": 1e-5, "float64": 1e-10}  # absolute: outputs are O(1)
# Wan's norms and modulation call `.float()`: an fp64 Wan-based model computes partly in fp32.
_WAN_CLASSES = {"WanTransformer3DModel", "ChronoEditTransformer3DModel", "SkyReelsV2Transformer3DModel",
                "WanVACETransformer3DModel", "WanAnimateTransformer3DModel"}  # fmt: skip
# Cosmos' cross-attention attends the whole text from each rank's queries, and diffusers' RMSNorm (its norm_k) takes
# the variance in fp32: each rank's partial key gradient is rounded to fp32 before the CP sum (fp64: 2e-8).
# Z-Image's replicated refiners likewise (their norm_k, and RoPE in fp32) once CP 3+ spreads the image tokens.
# Krea 2's RMSNorm runs in fp32 (`.float()`, every norm of the model) and its text fusion is replicated: each rank's
# partial text-fusion gradient is rounded to fp32 before the CP sum (fp64: 3e-7 at CP 3, 9e-16 at CP 2).
_FP32_NORM_CLASSES = {"CosmosTransformer3DModel", "ZImageTransformer2DModel", "Krea2Transformer2DModel"}
FP32_INSIDE = {n for n in FAMILY_NAMES if get_family(n).transformer_class in _WAN_CLASSES | _FP32_NORM_CLASSES}
# world -> (ring, ulysses) layouts; variants: (dtype, checkpointing)
LAYOUTS = {2: ((1, 2), (2, 1)), 3: ((1, 3),), 4: ((1, 4), (2, 2), (4, 1))}
VARIANTS = {"fp32": ("float32", False), "fp32_ckpt": ("float32", True), "fp64": ("float64", False)}
FP64_LAYOUTS = {(1, 2), (1, 3), (1, 4), (4, 1)}
# Activation checkpointing recomputes each block's forward inside backward: once per kind of attention path (Ulysses,
# ring, ring x Ulysses) proves the recompute sees the layout the first forward saw; degree is the fp32/fp64 runs'.
CKPT_LAYOUTS = {(1, 2), (2, 1), (2, 2)}
# HunyuanVideo 1.5's pipeline form carries 729 masked vision tokens (2339 keys): its fp64 and checkpointed runs
# would double this module's time; its fp32 run covers every layout.
HEAVY = {"hunyuan_video15"}
# Kandinsky 5's time embedding feeds float32 sinusoids to its first linear (the class keeps it in fp32, as it does
# the modulations): a float64 model does not run, in diffusers either. Its fp32 runs carry the proof, with the family's
# float32-RoPE processor (train/models/kandinsky5/attention.py).
NO_FP64 = {n for n in FAMILY_NAMES if get_family(n).transformer_class == "Kandinsky5Transformer3DModel"}


def _variants(layout: tuple[int, int], family: str) -> list[str]:
    names = ["fp32"] + (["fp32_ckpt"] if layout in CKPT_LAYOUTS else []) + (["fp64"] if layout in FP64_LAYOUTS else [])
    return ["fp32"] if family in HEAVY else [n for n in names if n != "fp64" or family not in NO_FP64]


class C10dCounter(TorchDispatchMode):
    """Every c10d op (all_to_all, all_gather, send, recv, ...) the process issues, counted below torch.distributed's
    Python API: independent of our transport's own counters."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _cp_attention_calls():
    """Counts the attention calls diffusers routes into context parallelism (`_templated_context_parallel_attention`,
    looked up at call time by every CP-capable backend), whichever of our attention classes then serves them, and the
    head-sharded whole-sequence attentions of family processors (train/cp/whole.py: its Q/K/V all-to-all node)."""
    from diffusers.models import attention_dispatch

    from train.cp.a2a import SeqToHeads

    original, calls = attention_dispatch._templated_context_parallel_attention, [0]
    apply = SeqToHeads.apply

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    def counted_apply(*args, **kwargs):
        calls[0] += 1
        return apply(*args, **kwargs)

    attention_dispatch._templated_context_parallel_attention = counted
    SeqToHeads.apply = counted_apply
    try:
        yield calls
    finally:
        attention_dispatch._templated_context_parallel_attention = original
        SeqToHeads.apply = apply


def _serial(family: str, dtype: torch.dtype):
    """The oracle's step on the pipeline-form inputs. Computed once per session, by rank 0 of the first group that
    needs it (into the session folder, tests/harness.py `session_dir`); every rank of every group reads that result:
    the same deterministic computation, not 2 + 3 + 4 copies of it on 2 cores."""
    inputs = family_case(family, seed=1, dtype=dtype, batch_size=2)
    path = session_dir() / f"oracle-{family}-{str(dtype).removeprefix('torch.')}.pt"
    if dist.get_rank() == 0 and not path.exists():
        torch.save(run_step(build_model(family, seed=0, dtype=dtype), inputs), path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)  # whole or absent
    dist.barrier()
    return inputs, torch.load(path, weights_only=False)


def _cp(family: str, dtype: torch.dtype, mesh, inputs, checkpointing: bool, extra: bool):
    from train.cp import GradReduction, enable_context_parallel

    model = build_model(family, seed=0, dtype=dtype)
    state = enable_context_parallel(model, mesh=mesh)
    if checkpointing:  # the trainer's per-block checkpoint, replaying the layout registry in the recompute (diffusers'
        # own `enable_gradient_checkpointing` path drops Chroma's attention_mask in its single-stream blocks)
        from train.parallel import apply_activation_levers, repeated_blocks

        apply_activation_levers(repeated_blocks(model), 1, offload=False, compile=False, layout=state.layout)
    reduction = GradReduction("allreduce", cp_group=state.cp_group)
    before = state.layout.exchanges
    state.stats.reset()
    t0 = time.perf_counter()
    # The dispatch mode sees every op: counted on the runs that check the count only.
    with _cp_attention_calls() as calls, C10dCounter() if extra else contextlib.nullcontext() as counter:
        result = run_step(model, inputs, reduce=reduction.reduce_gradients)
    info = {"exchanges": state.layout.exchanges - before, "seconds": time.perf_counter() - t0}
    if extra:  # Ulysses fp32: the collectives, MEAN instead of SUM, verify mode
        collectives = sum(counter.ops.values()) - counter.ops["allreduce_"]  # the reduction's all-reduces aside
        info.update(attention=calls[0], ops=dict(counter.ops), transport=state.stats.calls, collectives=collectives)
        group = state.cp_group
        if dist.get_world_size() == 2:  # MEAN's 1/cp error needs one degree to be seen
            mean = lambda ps: [
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group) for p in ps if p.grad is not None
            ]  # noqa: E731,E501
            info["mean"] = run_step(model, inputs, reduce=mean)
        state.layout.verify = True
        try:
            info["verified"] = run_step(model, inputs, reduce=reduction.reduce_gradients)
        finally:
            state.layout.verify = False
    return result, info


def _refused_without_joint_mask(mesh) -> str:
    """HunyuanVideo with its plan minus `joint_key_mask`: the first training forward raises on every rank, before
    any collective of the attention (the ranks are still in step afterwards)."""
    from train.cp import enable_context_parallel
    from train.cp.masks import MaskPlacementError
    from train.cp.plans import plan_for

    plan = dataclasses.replace(plan_for("HunyuanVideoTransformer3DModel"), joint_key_mask=())
    model = build_model("hunyuan_video", seed=0)
    enable_context_parallel(model, mesh=mesh, plan=plan)
    said = ""
    try:
        run_step(model, family_case("hunyuan_video", seed=1, batch_size=2))
    except MaskPlacementError as e:
        said = str(e)
    dist.barrier()
    return said


def _parity(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    results: dict = {}
    serial: dict = {}
    for layout in LAYOUTS[world]:
        mesh = init_device_mesh("cpu", layout, mesh_dim_names=("ring", "ulysses"))
        for family in FAMILY_NAMES:
            for variant in _variants(layout, family):
                dtype_name, checkpointing = VARIANTS[variant]
                dtype = getattr(torch, dtype_name)
                if (family, dtype_name) not in serial:
                    serial[family, dtype_name] = _serial(family, dtype)
                inputs, ref = serial[family, dtype_name]
                extra = layout[0] == 1 and variant == "fp32"
                cp, info = _cp(family, dtype, mesh, inputs, checkpointing, extra)
                errors = compare(cp, ref)
                if "mean" in info:
                    info["mean"] = min(compare(info["mean"], ref).grads.values())
                if extra:
                    info["verified"] = compare(info["verified"], ref).grad
                results[layout, family, variant] = (errors, info)
        if layout == (1, world) and world > 1:
            results[layout, "refused"] = _refused_without_joint_mask(mesh)
    return results


rank_job(*LAYOUTS)(_parity)


def _tol(family: str, variant: str) -> tuple[float, float]:
    dtype = VARIANTS[variant][0]
    if family in FP32_INSIDE:
        dtype = "float32"
    return TOL[dtype], OUT_TOL[dtype]


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_every_family_matches_the_pipeline_form_serial_run(group, world: int) -> None:
    ranks = group(_parity, world)
    print(f"\nCP over {world} ranks vs the pipeline-form serial run (batch 2, padded text of two lengths)")
    print(f"{'layout':<8} {'family':<16} {'variant':<10} {'out abs':>9} {'loss rel':>9} {'grad rel':>9}  worst")
    for key, value in ranks[0].items():
        if key[1] == "refused":
            continue
        (ring, uly), family, variant = key
        e: Errors = value[0]
        print(f"{ring}x{uly:<6} {family:<16} {variant:<10} {e.out:9.2e} {e.loss:9.2e} {e.grad:9.2e}  {e.worst} "
              f"({value[1]['seconds']:.2f} s)")  # fmt: skip
    for rank, res in enumerate(ranks):
        for key, value in res.items():
            if key[1] == "refused":
                assert "joint_key_mask" in value and "would mask the wrong keys" in value, (rank, value)
                continue
            layout, family, variant = key
            errors, info = value
            tol, out_tol = _tol(family, variant)
            where = f"rank {rank} {layout} {family} {variant}"
            assert errors.out <= out_tol, f"{where}: output off by {errors.out:.3g}"
            assert errors.loss <= tol, f"{where}: loss off by {errors.loss:.3g}"
            assert errors.grad <= tol, f"{where}: gradient of {errors.worst} off by {errors.grad:.3g}"
            if layout[0] > 1:
                continue
            # Ulysses: no size exchange in any layer, first forward and checkpoint recomputes included (plans with the
            # layout registry; Kandinsky 5's cross-attention keys are not built from the splits: it exchanges sizes).
            registry = plan_for(get_family(family).transformer_class).layout_registry
            assert info["exchanges"] == 0 or not registry, (where, info["exchanges"])
            if variant != "fp32":
                continue
            assert info["verified"] <= tol, (where, "verify mode", info["verified"])
            # MEAN over CP (what a plain DDP/FSDP setup does) is 1/cp of the right gradient (checked at CP 2).
            assert world != 2 or info["mean"] >= 0.5 * (1 - 1 / world), (where, "MEAN matched", info["mean"])
            # Counted under torch.distributed: 4 all-to-alls per CP attention call (Q/K/V, O, dO, dQ/dK/dV), and
            # every collective went through the model's transport (none issued around it).
            assert info["attention"] > 0 and info["ops"].get("alltoall_base_", 0) == 4 * info["attention"], info
            assert info["collectives"] == info["transport"], info
