"""One model's context-parallel state: the object `enable_context_parallel` returns.

It is a diffusers `ParallelConfig` (the model's and its CP processors' `_parallel_config`, which diffusers' attention
dispatch hands to the Ulysses function on every call), extended with what our CP path needs for that model alone:

- `plan`: the CP plan in force (`CPPlanSpec`);
- `layout`: the model's layout registry (layout.py): the splits of its current forward and its remembered tables;
- `transport`: its all-to-all transport (comm.py), counting what the model sends in `transport.stats`;
- `problems`: why the model cannot train under CP (empty when it can); the startup guard refuses training forwards;
- `scope`: the model's name in messages;
- `kernel`: the attention kernel its CP attention calls (kernels.py: "auto", a kernel's name, or "backend" for the
  op pair of the model's diffusers attention backend).

Nothing of it lives in a module: two models enabled in one process (a transformer and a second expert) hold two
states, and their forwards, backwards and recomputes may interleave in any order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
from torch.distributed.device_mesh import DeviceMesh

from .comm import CommStats, TorchTransport, select_transport
from .layout import LayoutRegistry

if TYPE_CHECKING:
    from .plans import CPPlanSpec

__all__ = ["ContextParallelState", "cp_device_type", "local_device"]


def cp_device_type() -> str:
    """The device type collectives run on: the accelerator when torch has one with devices, else CPU."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None and torch.accelerator.device_count() > 0 else "cpu"


def local_device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(
        device_type, int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.accelerator.device_count()))
    )


@dataclass(eq=False)  # identity semantics: one state per model, never equal to another model's
class ContextParallelState(ParallelConfig):
    plan: CPPlanSpec | None = None  # None for op-level use (no model, no plan)
    problems: tuple[str, ...] = ()
    scope: str = ""
    layout: LayoutRegistry | None = None  # default: a new registry named `scope`
    transport: TorchTransport | None = None  # default: a new plain torch transport with its own stats
    kernel: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layout is None:
            self.layout = LayoutRegistry(self.scope)
        if self.transport is None:
            self.transport = TorchTransport()

    @classmethod
    def on_mesh(
        cls,
        mesh: DeviceMesh,
        *,
        transport: str | TorchTransport = "torch",
        plan: CPPlanSpec | None = None,
        problems: tuple[str, ...] = (),
        scope: str = "",
        kernel: str = "auto",
    ) -> ContextParallelState:
        """CP on a ("ring", "ulysses") mesh, set up without `ModelMixin.enable_parallelism` (which dies on CPU).
        Every rank of the mesh calls this together (the transport may self-test on the group).

        Ring 1: Ulysses-Anything (ulysses.py). Ulysses 1: Ring-Anything (ring.py). Both > 1: the hybrid (ring.py),
        which diffusers reaches through its unified path; diffusers allows neither "anything" flag there, and needs
        none: our split hooks always split unevenly (enable.py). Then `setup` fills the config's `_ring_mesh`,
        `_ulysses_mesh` and `_flattened_mesh` (the whole CP group, rank = ring index × U + Ulysses index).

        `transport`: "torch", "symm_mem" (see `select_transport`), or an existing state's transport to share one
        symmetric-memory buffer between models (they then share its stats too)."""
        ring, ulysses = mesh["ring"].size(), mesh["ulysses"].size()
        cp = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, ulysses_anything=ring == 1,
                                   ring_anything=ring > 1 and ulysses == 1, mesh=mesh)  # fmt: skip
        device = local_device(mesh.device_type)
        if not isinstance(transport, TorchTransport):
            transport = select_transport(transport, mesh["ulysses"].get_group(), device)
        state = cls(context_parallel_config=cp, plan=plan, problems=tuple(problems), scope=scope, transport=transport,
                    kernel=kernel)  # fmt: skip
        state.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
        return state

    @property
    def stats(self) -> CommStats:
        """What this model's CP collectives sent, per call site."""
        return self.transport.stats

    @property
    def group(self) -> dist.ProcessGroup:
        """The Ulysses process group (the whole CP group when ring = 1)."""
        return self.context_parallel_config._ulysses_mesh.get_group()

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """The whole CP group, ring × Ulysses ranks: the ranks that share one sample (gradients SUM over it)."""
        return self.context_parallel_config._flattened_mesh.get_group()
