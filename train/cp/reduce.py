"""Gradient reduction under context parallelism: SUM over the CP ranks, MEAN over the data-parallel ranks only.

Why SUM: the loss is computed on the gathered output, identically on every CP rank, and the gather's backward hands
each rank the gradient of its own tokens only. So each CP rank holds a PARTIAL gradient of every replicated
parameter (the part its tokens contributed) and the serial gradient is their sum. Averaging (what DDP/FSDP do by
default over all ranks) is silently 1/cp too small. Data-parallel ranks see different samples, so those are averaged.

Three ways to apply it, one rule:
- `allreduce`: no wrapper; call `reduce_gradients()` after backward (bucketed all-reduces);
- `ddp`: DistributedDataParallel over the dp×cp group with a comm hook that sums and divides by dp;
- `fsdp2`: `fully_shard` over a mesh covering dp×cp with gradient divide factor dp (and force-sum on gloo, which
  rejects the PREMUL_SUM that a divide factor ≠ group size would otherwise use).

`GradReduction.self_check()` proves at startup that the installed reduction is SUM over CP and MEAN over DP: a
one-parameter probe, wrapped the same way, whose local gradient is (cp_rank + 1) × (dp_rank + 1). With ring × Ulysses
CP the CP group is the whole ring × Ulysses group (cp_rank = ring index × U + Ulysses index): the probe's expected
sum cp(cp+1)/2 is reached only when every ring and Ulysses rank is summed; a reduction over the Ulysses (or ring)
sub-group alone gives a rank-dependent value and fails the check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

Mode = Literal["allreduce", "ddp", "fsdp2"]


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    return sorted(dist.get_process_group_ranks(group)) if group is not None else [dist.get_rank()]


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0


def _all_reduce_flat(grads: list[torch.Tensor], group: dist.ProcessGroup, divide: int) -> None:
    """All-reduce SUM a list of gradients as one flat buffer per dtype/device, then divide."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for bucket in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if divide != 1:
            flat.div_(divide)
        pos = 0
        for g in bucket:
            g.copy_(flat[pos : pos + g.numel()].view_as(g))
            pos += g.numel()


@dataclass
class GradReduction:
    """How gradients are reduced for one run: the CP group, the DP group, and the mechanism.

    `cp_group`: ranks that share one sample and split its sequence. `dp_group`: ranks holding the same CP position in
    different data-parallel replicas (None when dp = 1). `reduce_mesh` (ddp/fsdp2): the mesh whose group spans
    exactly dp×cp ranks — FSDP2 shards over it, DDP reduces over it.
    """

    mode: Mode
    cp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None = None
    reduce_mesh: DeviceMesh | None = None

    def __post_init__(self) -> None:
        self.cp = _size(self.cp_group)
        self.dp = _size(self.dp_group)
        if self.mode not in ("allreduce", "ddp", "fsdp2"):
            raise ValueError(f"unknown gradient reduction mode {self.mode!r}; use allreduce, ddp or fsdp2")
        if self.mode in ("ddp", "fsdp2"):
            self._check_reduce_mesh()

    @classmethod
    def for_model(cls, parallel_config, dp_group: dist.ProcessGroup | None = None) -> GradReduction:
        """Plain all-reduce reduction for a model set up by `enable_context_parallel` (the state it returned; any
        diffusers `ParallelConfig` with a context-parallel config will do). The CP group is the whole ring × Ulysses
        group (its flattened mesh): every rank of it, ring and Ulysses alike, holds a partial gradient."""
        return cls("allreduce", parallel_config.context_parallel_config._flattened_mesh.get_group(), dp_group)

    def _check_reduce_mesh(self) -> None:
        """Refuse a layout whose reduction cannot equal SUM over cp × MEAN over dp."""
        if self.reduce_mesh is None:
            raise ValueError(f"mode={self.mode} needs reduce_mesh: a mesh spanning the dp×cp ranks")
        covered = {int(r) for r in self.reduce_mesh.mesh.flatten().tolist()}
        needed = set(_group_ranks(self.cp_group)) | set(_group_ranks(self.dp_group))
        if len(covered) != self.cp * self.dp or not needed <= covered:
            raise ValueError(
                f"the {self.mode} reduction mesh covers ranks {sorted(covered)}, but SUM over CP and MEAN over DP "
                f"needs the {self.dp}×{self.cp} dp×cp ranks including {sorted(needed)}: a mesh without the CP ranks "
                "leaves partial gradients unsummed, one with extra ranks mixes other replicas in"
            )
        if self.mode == "ddp" and self.reduce_mesh.ndim != 1:
            raise ValueError("mode=ddp needs a 1-D reduce_mesh (flatten the dp and cp dims)")

    # -- applying it ------------------------------------------------------------------------------------------------
    def wrap_ddp(self, module: torch.nn.Module, **ddp_kwargs) -> torch.nn.Module:
        """DDP over dp×cp with a comm hook that SUMs and divides by dp (DDP alone would divide by dp×cp)."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        assert self.mode == "ddp"
        ddp = DDP(module, process_group=self.reduce_mesh.get_group(), **ddp_kwargs)
        divide = self.dp

        # No annotations: DDP checks them literally, and this module's annotations are strings.
        def sum_cp_mean_dp(group, bucket):
            buf = bucket.buffer().div_(divide)
            fut = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        ddp.register_comm_hook(self.reduce_mesh.get_group(), sum_cp_mean_dp)
        return ddp

    def configure_fsdp(self, module: torch.nn.Module) -> None:
        """Set divide factor dp on every FSDP2 module (their reduce-scatter spans dp×cp ranks, so the sum covers cp)."""
        from torch.distributed.fsdp import FSDPModule

        assert self.mode == "fsdp2"
        fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
        if not fsdp_modules:
            raise ValueError("configure_fsdp found no fully_shard-ed module: apply fully_shard before configuring")
        gloo = "gloo" in str(dist.get_backend(self.reduce_mesh.get_group(0)))
        for m in fsdp_modules:
            m.set_gradient_divide_factor(float(self.dp))
            if gloo:  # gloo rejects PREMUL_SUM: sum, then divide
                m.set_force_sum_reduction_for_comms(True)

    def reduce_gradients(self, params) -> None:
        """mode=allreduce: after backward, SUM each gradient over CP, then MEAN over DP."""
        assert self.mode == "allreduce"
        grads = [p.grad for p in params if p.grad is not None]
        if self.cp > 1:
            _all_reduce_flat(grads, self.cp_group, 1)
        if self.dp > 1:
            _all_reduce_flat(grads, self.dp_group, self.dp)

    # -- the startup self-check -------------------------------------------------------------------------------------
    def self_check(self, cp_group: dist.ProcessGroup | None = None) -> float:
        """Run a probe through this reduction and confirm SUM over CP, MEAN over DP. Returns the reduced value.

        The probe's local gradient is (cp_rank + 1)(dp_rank + 1); the right answer is cp(cp+1)/2 · (dp+1)/2. MEAN over
        CP would give (cp+1)/2 · (dp+1)/2, and a reduction that forgets an axis gives a rank-dependent value.
        `cp_group`: the ranks whose gradients must be summed, taken from the model rather than from this reduction
        (the trainer passes the CP state's whole ring × Ulysses group), so a reduction over a sub-group of it (the
        Ulysses dim alone) fails here; default: this reduction's own CP group.
        """
        truth = self.cp_group if cp_group is None else cp_group
        cp = _size(truth)
        device = torch.device("cpu")
        if self.reduce_mesh is not None:
            device = torch.device(self.reduce_mesh.device_type, torch.accelerator.current_device_index()) if (
                self.reduce_mesh.device_type != "cpu") else device  # fmt: skip
        local = float((_rank(truth) + 1) * (_rank(self.dp_group) + 1))
        expected = cp * (cp + 1) / 2 * (self.dp + 1) / 2
        probe = torch.nn.Linear(1, 1, bias=False, device=device)
        torch.nn.init.ones_(probe.weight)
        x = torch.full((1, 1), local, device=device)
        if self.mode == "allreduce":
            probe(x).sum().backward()
            self.reduce_gradients(probe.parameters())
            got = probe.weight.grad.item()
        elif self.mode == "ddp":
            ddp = self.wrap_ddp(probe)
            ddp(x).sum().backward()
            got = probe.weight.grad.item()
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(probe, mesh=self.reduce_mesh)
            self.configure_fsdp(probe)
            probe(x).sum().backward()
            got = probe.weight.grad.full_tensor().item()
        if abs(got - expected) > 1e-5 * expected:
            mean = (cp + 1) / 2 * (self.dp + 1) / 2
            hint = " (that is MEAN over CP)" if abs(got - mean) <= 1e-5 * mean else ""
            if cp != self.cp:
                hint += f" (the reduction sums over {self.cp} of the {cp} CP ranks)"
            raise RuntimeError(
                f"gradient reduction self-check failed ({self.mode}, cp={cp}, dp={self.dp}): probe gradient "
                f"{got} != {expected} expected for SUM over CP and MEAN over DP{hint}"
            )
        return got
