"""Collectives used by CP attention, behind one small transport object that also counts what it sends.

Every collective our Ulysses path issues goes through the transport of the model's CP state (`state.transport`, one
per `enable_context_parallel` call; state.py), so a benchmark (or a test) can read from `state.transport.stats` how
many collectives each call site issued and how many bytes left the rank, and a faster transport can be swapped in.
Nothing here is per process: two models never share a transport unless their caller hands one to both.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (the old name warns on every call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class SiteStats:
    calls: int = 0
    bytes_sent: int = 0  # bytes that leave this rank (the part addressed to itself is not counted)


@dataclass
class CommStats:
    sites: dict[str, SiteStats] = field(default_factory=lambda: defaultdict(SiteStats))

    def record(self, site: str, bytes_sent: int) -> None:
        s = self.sites[site]
        s.calls += 1
        s.bytes_sent += bytes_sent

    def reset(self) -> None:
        self.sites.clear()

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.sites.values())

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.sites.values())


class TorchTransport:
    """Plain `torch.distributed`: works on every backend (gloo on CPU, NCCL on GPU), uneven splits included."""

    name = "torch"

    def __init__(self, stats: CommStats | None = None) -> None:
        self.stats = stats if stats is not None else CommStats()

    def all_to_all(
        self,
        flat: torch.Tensor,
        in_splits: list[int],
        out_splits: list[int],
        group: dist.ProcessGroup,
        site: str,
        max_elems: int | None = None,
    ) -> torch.Tensor:
        """1-D all-to-all-v: `in_splits[j]` elements of `flat` go to rank j, `out_splits[i]` arrive from rank i.

        `max_elems`: the largest send or receive total of ANY rank (the same on every rank), for transports with a
        fixed buffer; they must decide alike on every rank whether a call fits.
        """
        rank = dist.get_rank(group)
        self.stats.record(site, (sum(in_splits) - in_splits[rank]) * flat.element_size())
        out = flat.new_empty(sum(out_splits))
        dist.all_to_all_single(out, flat, out_splits, in_splits, group=group)
        return out

    def all_gather(self, x: torch.Tensor, group: dist.ProcessGroup, site: str) -> torch.Tensor:
        """Equal-size all-gather into a new leading dim of size world."""
        world = dist.get_world_size(group)
        self.stats.record(site, x.numel() * x.element_size() * (world - 1))
        out = x.new_empty((world * x.numel(),))
        _all_gather_single(out, x.contiguous().view(-1), group=group)
        return out.view(world, *x.shape)

    def close(self) -> None:
        """Nothing to release. Transports are closed explicitly, never in __del__ (no collective under GC)."""


class SymmMemTransport(TorchTransport):
    """Intra-node all-to-all-v through torch symmetric memory (NVSHMEM `all_to_all_vdev`), for one CP group.

    Built only by `select_transport`, on the CP subgroup (never WORLD: ranks outside the group never join), and
    only after a self-test against the plain path on the real hardware agreed on every rank of the group. Calls that
    do not fit its buffers, or whose dtype it does not move, take the plain path — decided from `max_elems` and the
    dtype, which are the same on every rank.
    """

    name = "symm_mem"
    DTYPES = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self, group: dist.ProcessGroup, device: torch.device, capacity_bytes: int, stats: CommStats) -> None:
        super().__init__(stats)
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name, world = group.group_name, dist.get_world_size(group)
        symm_mem.set_backend("NVSHMEM")
        symm_mem.enable_symm_mem_for_group(self.group_name)
        self.capacity = capacity_bytes
        self.inp = symm_mem.empty(capacity_bytes, dtype=torch.uint8, device=device)
        self.out = symm_mem.empty(capacity_bytes, dtype=torch.uint8, device=device)
        self.splits = symm_mem.empty(world, dtype=torch.int64, device=device)
        self.offsets = symm_mem.empty((2, world), dtype=torch.int64, device=device)
        for t in (self.inp, self.out, self.splits, self.offsets):
            symm_mem.rendezvous(t, self.group_name)

    def all_to_all(self, flat, in_splits, out_splits, group, site, max_elems=None):
        esz = flat.element_size()
        if flat.dtype not in self.DTYPES or max_elems is None or max_elems * esz > self.capacity:
            return super().all_to_all(flat, in_splits, out_splits, group, site, max_elems)
        rank = dist.get_rank(group)
        self.stats.record(site, (sum(in_splits) - in_splits[rank]) * esz)
        n_in, n_out = flat.numel() * esz, sum(out_splits) * esz
        self.inp[:n_in].copy_(flat.view(torch.uint8))
        self.splits.copy_(torch.tensor([n * esz for n in in_splits], dtype=torch.int64))
        torch.ops.symm_mem.all_to_all_vdev(self.inp, self.out, self.splits, self.offsets, self.group_name)
        return self.out[:n_out].clone().view(flat.dtype)

    def close(self) -> None:
        """Drop the buffers (symmetric memory is freed by the allocator; no collective here)."""
        self.inp = self.out = self.splits = self.offsets = None


def _note(reason: str) -> None:
    """Said once per `select_transport` call, i.e. once per model CP is enabled on."""
    print(f"[ctxtrain] CP transport: {reason}", flush=True)


def _self_test(transport: TorchTransport, group: dist.ProcessGroup, device: torch.device) -> bool:
    """An uneven all-to-all-v through `transport` must equal the plain path's, on this hardware."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    in_splits = [1 + (rank + j) % 3 for j in range(world)]
    out_splits = [1 + (i + rank) % 3 for i in range(world)]
    flat = torch.arange(sum(in_splits), device=device, dtype=torch.float32) + 100 * rank
    plain = TorchTransport(CommStats()).all_to_all(flat, in_splits, out_splits, group, "selftest")
    fast = transport.all_to_all(flat, in_splits, out_splits, group, "selftest", max_elems=3 * world)
    return bool(torch.equal(plain, fast))


def select_transport(
    kind: str, group: dist.ProcessGroup, device: torch.device, capacity_bytes: int = 256 << 20
) -> TorchTransport:
    """A new all-to-all transport for one CP group, with its own `CommStats`; plain torch with the reason said when
    the fast path cannot serve the group.

    "torch": always. "symm_mem": intra-node CUDA groups where torch has NVSHMEM, after a self-test; else torch.
    Every rank of the group must call this together (it may run collectives on the group, never on WORLD).
    """
    if kind not in ("torch", "symm_mem"):
        raise ValueError(f"unknown CP transport {kind!r}; use 'torch' or 'symm_mem'")
    stats = CommStats()
    if kind == "torch":
        return TorchTransport(stats)
    reason = _symm_mem_unavailable(group, device)
    if reason is None:
        try:
            candidate = SymmMemTransport(group, device, capacity_bytes, stats)
            ok = _self_test(candidate, group, device)
        except Exception as e:  # init failure: fall back, but only if every rank agrees (below)
            candidate, ok = None, False
            _note(f"symm_mem init failed on this rank ({type(e).__name__}: {e})")
        flag = torch.tensor([1 if ok else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # one decision for the whole group
        if flag.item() == 1:
            return candidate
        if candidate is not None:
            candidate.close()
        reason = "symm_mem self-test or init failed on some rank of the group"
    _note(f"symm_mem requested, using torch all_to_all_single: {reason}")
    return TorchTransport(stats)


def _symm_mem_unavailable(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why the fast path cannot serve this group (None = it may): decided from facts every rank shares."""
    if device.type != "cuda":
        return f"device {device.type} (symmetric memory is CUDA only)"
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            return "this torch build has no NVSHMEM"
    except ImportError:
        return "this torch build has no symmetric memory"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    nodes = {r // max(local, 1) for r in dist.get_process_group_ranks(group)}
    if len(nodes) > 1:
        return f"the CP group spans {len(nodes)} nodes (symmetric memory is intra-node)"
    return None


def exchange_ints(
    values: list[int], device: torch.device, group: dist.ProcessGroup, site: str, transport: TorchTransport
) -> list[list[int]]:
    """All-gather a few ints from every rank: returns one list per rank, identical on all ranks."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    return transport.all_gather(t, group, site).tolist()


def all_gather_uneven(
    x: torch.Tensor, dim: int, sizes: list[int], group: dist.ProcessGroup, site: str, transport: TorchTransport
) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, where rank i holds `sizes[i]` entries of that dim.

    gloo's all_gather rejects tensors of different sizes, so pad each shard to the largest, gather, then trim EACH
    shard before concatenating (trimming after concatenation misplaces keys when a non-last shard is shorter).
    """
    dim = dim % x.dim()
    pad = max(sizes) - x.shape[dim]
    is_bool = x.dtype == torch.bool
    if is_bool:  # not every backend reduces/gathers bool
        x = x.to(torch.uint8)
    if pad:
        pad_shape = list(x.shape)
        pad_shape[dim] = pad
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    gathered = transport.all_gather(x, group, site)  # (world, ..., max, ...)
    out = torch.cat([gathered[i].narrow(dim, 0, n) for i, n in enumerate(sizes)], dim=dim)
    return out.bool() if is_bool else out
