"""The degrees of parallelism, the device mesh, and the one place where parallelism is applied to the model.

Mesh dims, outermost first: ("dp_replicate", "dp_shard", "ring", "ulysses"), cp = ring × ulysses. A CP group is `cp`
consecutive ranks, and inside it rank = ring index × ulysses + Ulysses index: each Ulysses group is `ulysses`
consecutive ranks (one node: its per-layer all-to-alls stay on the fastest links) and each ring group strides across
them (its point-to-point shifts cross nodes). FSDP2 shards over dp_shard×cp (CP ranks hold the same parameters, so
sharding over them too saves memory) and replicates over dp_replicate.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .cp import ContextParallelState, enable_context_parallel
from .cp.layout import LayoutRegistry
from .cp.reduce import GradReduction


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    ring: int = 1  # ring degree inside cp (recipe parallel.cp_ring); ulysses = cp // ring

    def __post_init__(self) -> None:
        if self.ring < 1 or self.cp % self.ring:
            raise ValueError(f"ring degree {self.ring} must divide cp {self.cp}")

    @property
    def ulysses(self) -> int:
        return self.cp // self.ring

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    def build(self, device_type: str) -> Mesh:
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"dp_replicate {self.dp_replicate} × dp_shard {self.dp_shard} × cp {self.cp} = {self.world_size}, "
                f"but {dist.get_world_size()} processes were launched"
            )
        shape = (self.dp_replicate, self.dp_shard, self.ring, self.ulysses)
        world = init_device_mesh(device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard", "ring", "ulysses"))
        dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        cp = world["ring", "ulysses"]._flatten("cp")  # the whole CP group: rank = ring index × U + Ulysses index
        shard_cp = world["dp_shard", "ring", "ulysses"]._flatten("dp_shard_cp")
        fsdp = world["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else shard_cp
        return Mesh(self, world, dp, fsdp, cp)


@dataclass(frozen=True)
class Mesh:
    dims: ParallelDims
    world: DeviceMesh
    dp: DeviceMesh  # flattened dp_replicate×dp_shard: ranks holding the same CP position in different replicas
    fsdp: DeviceMesh  # what FSDP2 shards (and replicates) over: covers dp×cp
    cp_flat: DeviceMesh  # flattened ring×ulysses: the ranks that share one sample (gradients SUM over all of them)

    @property
    def cp(self) -> DeviceMesh:
        return self.world["ring", "ulysses"]  # the ("ring", "ulysses") sub-mesh diffusers' CP hooks expect

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.cp_flat.get_group()

    @property
    def cp_rank(self) -> int:
        return self.cp_flat.get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    def describe(self) -> str:
        d = self.dims
        return (
            f"mesh dp_replicate={d.dp_replicate} × dp_shard={d.dp_shard} × cp={d.cp} (ring {d.ring} × ulysses "
            f"{d.ulysses}) "
            f"= {d.world_size} ranks; this rank: dp {self.dp_rank}, cp {self.cp_rank}"
        )


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: every element of every ModuleList directly on the model (blocks, single blocks, ...)."""
    return [b for child in model.children() if isinstance(child, torch.nn.ModuleList) for b in child]


def check_replicated(tensors: Iterable[torch.Tensor], what: str = "initial weights") -> None:
    """Every rank must start from the same weights (FSDP2 shards each rank's own copy and never broadcasts): compare
    a cheap fingerprint of `tensors` (the whole parameters, or the sources shards are filled from) across the world
    before anything is sharded."""
    with torch.no_grad():
        fp = torch.zeros(2, dtype=torch.float64)
        for i, t in enumerate(tensors):
            x = t.detach().double().cpu()
            fp[0] += x.sum() * (1 + i % 7)
            fp[1] += x.square().sum()
    seen = [torch.zeros_like(fp) for _ in range(dist.get_world_size())]
    dist.all_gather(seen, fp)
    if any(not torch.equal(s, seen[0]) for s in seen):
        raise RuntimeError(f"ranks hold different {what} (seed every rank alike before creating parameters, and "
                           "give every node the same checkpoint)")  # fmt: skip


# The ops whose outputs selective checkpointing keeps (`train.checkpoint_policy`): every attention kernel the serial
# model or the CP path calls (kernels.py; diffusers' native backend reaches the same aten ops), then the matmuls.
_ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)  # fmt: skip
_MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm")


def _kept_ops(policy: str) -> set:
    names = _ATTENTION_OPS + (_MATMUL_OPS if policy == "keep_attention_matmul" else ())
    ops = {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}
    if hasattr(torch.ops, "flash_attn") and hasattr(torch.ops.flash_attn, "_flash_attn_forward"):
        ops.add(torch.ops.flash_attn._flash_attn_forward.default)  # flash-attn >= 2.7 registers its ops
    return ops


@contextmanager
def _entered(contexts: list):
    with ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def checkpoint_contexts(policy: str, layout: LayoutRegistry | None):
    """`checkpoint`'s context_fn, or None for a plain checkpoint. With CP, the recompute replays the layout registry
    its forward saw (layout.py: no size exchange in the recompute). A selective `policy` keeps the outputs of the
    listed ops from the forward (with the CP attention: the kernel's output and LSE, which its backward takes) and
    recomputes the rest (norms, modulation, activations, the all-to-alls, re-issued in the same order on every rank):
    torch's selective checkpointing, which needs the recompute to run the forward's ops, hence the replayed registry."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    if policy == "full" and layout is None:
        return None
    kept = _kept_ops(policy) if policy != "full" else set()

    def decide(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn():
        pairs = [layout.checkpoint_contexts()] if layout is not None else []
        pairs += [create_selective_checkpoint_contexts(decide)] if kept else []
        return _entered([f for f, _ in pairs]), _entered([r for _, r in pairs])

    return context_fn


def apply_activation_levers(
    blocks: list[torch.nn.Module],
    checkpoint_every: int | None,
    offload: bool,
    compile: bool,
    policy: str = "full",
    layout: LayoutRegistry | None = None,
) -> list[int]:
    """Wrap each block's forward (under FSDP's hooks, over the CP hooks): recompute every `checkpoint_every`-th
    block in backward (non-reentrant: the recompute re-issues the block's all-to-alls in the same order on every
    rank), all of it ("full") or all but the outputs a selective `policy` keeps (`checkpoint_contexts`; `layout`:
    the CP model's registry, replayed in the recompute), keep the tensors the blocks save in host memory
    (`save_on_cpu`), then torch.compile the result per block. Returns the indices of the recomputed blocks."""
    from torch.autograd.graph import save_on_cpu
    from torch.utils.checkpoint import checkpoint

    recomputed = [i for i in range(len(blocks)) if checkpoint_every and i % checkpoint_every == 0]
    context_fn = checkpoint_contexts(policy, layout)
    extra = {} if context_fn is None else {"context_fn": context_fn}
    for i, block in enumerate(blocks):
        inner = block.forward  # the CP-hooked forward, when CP is on

        def forward(*args, _inner=inner, _recompute=i in recomputed, **kwargs):
            with save_on_cpu(pin_memory=torch.cuda.is_available()) if offload else nullcontext():
                if _recompute and torch.is_grad_enabled():
                    return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)
                return _inner(*args, **kwargs)

        if checkpoint_every or offload or compile:
            block.forward = torch.compile(forward) if compile else forward
    return recomputed


@dataclass(frozen=True)
class Parallelized:
    """What `parallelize` applied: the gradient reduction in force, and the model's CP state (None when cp = 1)."""

    reduction: GradReduction
    cp: ContextParallelState | None


def parallelize(
    model: torch.nn.Module,
    mesh: Mesh,
    *,
    cp_plan: str | None,
    gradient_checkpointing: bool,
    fsdp: bool,
    checkpoint_every: int = 1,
    checkpoint_policy: str = "full",
    offload_activations: bool = False,
    compile: bool = False,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None,
    cp_transport: str = "torch",
    attention_kernel: str = "auto",
    cpu_offload: bool = False,
) -> Parallelized:
    """Apply, in this order (each step needs the previous one in place):

    1. CP hooks (diffusers' split/gather hooks + our trainable Ulysses / ring attention): they wrap module forwards
       by name, so they must see the original modules, before checkpoint or FSDP wrappers hide or replace them.
    2. Activation levers, per block: checkpointing (every k-th block, whole or selective; the recompute re-issues
       the same all-to-alls in the same order on every rank) and offload of saved activations to host memory.
    3. torch.compile of each block's (checkpointed) forward: after checkpointing so the recompute is compiled too,
       before FSDP so FSDP's hooks stay outside the compiled region. The CP attention (its all-to-alls and
       backend op, a custom autograd function) is left out of the graph: a graph break at the attention op.
    4. FSDP2: `fully_shard` each block, then the root, over dp×cp with gradient divide factor dp, so gradients are
       SUMMED over CP (every ring and Ulysses rank) and averaged over DP. Without FSDP, a plain all-reduce over the
       whole CP group does the same after backward. `cpu_offload`: the shards, their gradients (and so the optimizer
       state) in host memory, pinned on a GPU machine (FSDP2's CPUOffloadPolicy).

    Returns the gradient reduction in force (its self-check has already passed) and the model's CP state (its plan,
    layout registry and transport; None when cp = 1).
    """
    if not any(p.is_meta for p in model.parameters()):  # a sharded start checks its sources instead (modeling.py)
        check_replicated(model.parameters())
    cp = None
    if mesh.dims.cp > 1:
        cp = enable_context_parallel(model, mesh=mesh.cp, plan=cp_plan, for_training=True, transport=cp_transport,
                                     kernel=attention_kernel)  # fmt: skip
    apply_activation_levers(repeated_blocks(model), checkpoint_every if gradient_checkpointing else None,
                            offload=offload_activations, compile=compile, policy=checkpoint_policy,
                            layout=cp.layout if cp is not None else None)  # fmt: skip
    dp_group = mesh.dp.get_group() if mesh.dims.dp > 1 else None
    if fsdp:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
        policy = dict(mesh=mesh.fsdp, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
        for block in repeated_blocks(model):
            fully_shard(block, **policy)
        fully_shard(model, **policy)
        reduction = GradReduction("fsdp2", mesh.cp_group, dp_group, reduce_mesh=mesh.fsdp)
        reduction.configure_fsdp(model)
    else:
        reduction = GradReduction("allreduce", mesh.cp_group, dp_group)
    reduction.self_check(cp.cp_group if cp is not None else None)  # SUM over the model's whole ring × Ulysses group
    return Parallelized(reduction, cp)
