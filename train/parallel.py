"""The degrees of parallelism, the device mesh, and the one place where parallelism is applied to the model.

Mesh dims, outermost first: ("dp_replicate", "dp_shard", "ring", "ulysses"). CP is Ulysses only (ring = 1), so CP
groups are `cp` consecutive ranks: the fastest links carry the per-layer all-to-alls. FSDP2 shards over dp_shard×cp
(CP ranks hold the same parameters, so sharding over them too saves memory) and replicates over dp_replicate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .cp import ContextParallelState, enable_context_parallel
from .cp.reduce import GradReduction


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int

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
        shape = (self.dp_replicate, self.dp_shard, 1, self.cp)
        world = init_device_mesh(device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard", "ring", "ulysses"))
        dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        shard_cp = world["dp_shard", "ring", "ulysses"]._flatten("dp_shard_cp")
        fsdp = world["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else shard_cp
        return Mesh(self, world, dp, fsdp)


@dataclass(frozen=True)
class Mesh:
    dims: ParallelDims
    world: DeviceMesh
    dp: DeviceMesh  # flattened dp_replicate×dp_shard: ranks holding the same CP position in different replicas
    fsdp: DeviceMesh  # what FSDP2 shards (and replicates) over: covers dp×cp

    @property
    def cp(self) -> DeviceMesh:
        return self.world["ring", "ulysses"]  # the ("ring", "ulysses") sub-mesh diffusers' CP hooks expect

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.world["ulysses"].get_group()

    @property
    def cp_rank(self) -> int:
        return self.world["ulysses"].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    def describe(self) -> str:
        d = self.dims
        return (
            f"mesh dp_replicate={d.dp_replicate} × dp_shard={d.dp_shard} × cp={d.cp} (ring 1 × ulysses {d.cp}) "
            f"= {d.world_size} ranks; this rank: dp {self.dp_rank}, cp {self.cp_rank}"
        )


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: every element of every ModuleList directly on the model (blocks, single blocks, ...)."""
    return [b for child in model.children() if isinstance(child, torch.nn.ModuleList) for b in child]


def check_replicated(model: torch.nn.Module) -> None:
    """Every rank must start from the same weights (FSDP2 shards each rank's own copy and never broadcasts): compare
    a cheap fingerprint of all parameters across the world before anything is sharded."""
    with torch.no_grad():
        fp = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
        for i, p in enumerate(model.parameters()):
            x = p.detach().double()
            fp[0] += x.sum() * (1 + i % 7)
            fp[1] += x.square().sum()
    seen = [torch.zeros_like(fp) for _ in range(dist.get_world_size())]
    dist.all_gather(seen, fp)
    if any(not torch.equal(s, seen[0]) for s in seen):
        raise RuntimeError("ranks hold different initial weights (seed every rank alike before creating parameters)")


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
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None,
    cp_transport: str = "torch",
) -> Parallelized:
    """Apply, in this order (each step needs the previous one in place):

    1. CP hooks (diffusers' split/gather hooks + our trainable Ulysses): they wrap module forwards by name, so they
       must see the original modules, before checkpoint or FSDP wrappers hide or replace them.
    2. Activation checkpointing: the recompute re-issues the same all-to-alls in the same order on every rank.
    3. (compile would go here: after checkpointing, before FSDP, per block — not enabled on CPU.)
    4. FSDP2: `fully_shard` each block, then the root, over dp×cp with gradient divide factor dp, so gradients are
       SUMMED over CP and averaged over DP. Without FSDP, a plain all-reduce does the same after backward.

    Returns the gradient reduction in force (its self-check has already passed) and the model's CP state (its plan,
    layout registry and transport; None when cp = 1).
    """
    check_replicated(model)
    cp = None
    if mesh.dims.cp > 1:
        cp = enable_context_parallel(model, mesh=mesh.cp, plan=cp_plan, for_training=True, transport=cp_transport)
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    dp_group = mesh.dp.get_group() if mesh.dims.dp > 1 else None
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in repeated_blocks(model):
            fully_shard(block, mesh=mesh.fsdp, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        fully_shard(model, mesh=mesh.fsdp, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        reduction = GradReduction("fsdp2", mesh.cp_group, dp_group, reduce_mesh=mesh.fsdp)
        reduction.configure_fsdp(model)
    else:
        reduction = GradReduction("allreduce", mesh.cp_group, dp_group)
    reduction.self_check()
    return Parallelized(reduction, cp)
