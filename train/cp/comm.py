"""Collectives used by CP attention, behind one small transport object that also counts what it sends.

Every collective issued by our Ulysses path goes through `get_transport()`, so a benchmark (or a test) can read how
many collectives each call site issued and how many bytes left the rank, and a faster transport can be swapped in.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


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

    def __init__(self) -> None:
        self.stats = CommStats()

    def all_to_all(
        self, flat: torch.Tensor, in_splits: list[int], out_splits: list[int], group: dist.ProcessGroup, site: str
    ) -> torch.Tensor:
        """1-D all-to-all-v: `in_splits[j]` elements of `flat` go to rank j, `out_splits[i]` arrive from rank i."""
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
        """Nothing to release; explicit so faster transports have the same lifecycle (never a collective in __del__)."""


# torch 2.13 renamed all_gather_into_tensor (the old name warns on every call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_TRANSPORT = TorchTransport()


def get_transport() -> TorchTransport:
    return _TRANSPORT


def exchange_ints(values: list[int], device: torch.device, group: dist.ProcessGroup, site: str) -> list[list[int]]:
    """All-gather a few ints from every rank: returns one list per rank, identical on all ranks."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    return get_transport().all_gather(t, group, site).tolist()


def all_gather_uneven(x: torch.Tensor, dim: int, sizes: list[int], group: dist.ProcessGroup, site: str) -> torch.Tensor:
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
    gathered = get_transport().all_gather(x, group, site)  # (world, ..., max, ...)
    out = torch.cat([gathered[i].narrow(dim, 0, n) for i, n in enumerate(sizes)], dim=dim)
    return out.bool() if is_bool else out
