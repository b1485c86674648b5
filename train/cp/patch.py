"""The one place that patches diffusers' module namespaces with our CP attention, and restores them.

diffusers looks its context-parallel attention classes and gather functions up in its module namespaces at call time,
so replacing those names routes every CP-capable backend through our code:

- `attention_dispatch.TemplatedUlyssesAnythingAttention` -> `UlyssesAnythingAttention` (ulysses.py: a backward,
  uneven heads without padding, split masks assembled right, LSE a non-differentiable output);
- `hooks.context_parallel.AllGatherAnythingFunction` / `_all_gather_anything` -> `GatherAnything` (an uneven output
  gather gloo accepts, with an exact backward slice);
- `attention_dispatch.TemplatedRingAnythingAttention` / `TemplatedRingAttention` -> `RingAnythingAttention` and
  `_templated_unified_attention` -> `ring_ulysses_attention` (ring.py: trainable ring and ring x Ulysses).

Module state on purpose: it records a patch of diffusers' namespaces, which are themselves process-wide. `_STOCK` is
written once, by the first install (while diffusers' own objects are in place), and holds nothing per model.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

__all__ = ["install", "installed", "stock_diffusers"]

_DISPATCH, _HOOKS = "diffusers.models.attention_dispatch", "diffusers.hooks.context_parallel"
# (diffusers module, attribute) -> (our module, attribute), resolved lazily (ours import diffusers).
_PATCHES: dict[tuple[str, str], tuple[str, str]] = {
    (_DISPATCH, "TemplatedUlyssesAnythingAttention"): (
        "train.cp.ulysses",
        "UlyssesAnythingAttention",
    ),
    (_HOOKS, "AllGatherAnythingFunction"): ("train.cp.ulysses", "GatherAnything"),
    (_HOOKS, "_all_gather_anything"): ("train.cp.ulysses", "all_gather_anything"),
    (_DISPATCH, "TemplatedRingAnythingAttention"): (
        "train.cp.ring",
        "RingAnythingAttention",
    ),
    (_DISPATCH, "TemplatedRingAttention"): ("train.cp.ring", "RingAnythingAttention"),
    (_DISPATCH, "_templated_unified_attention"): (
        "train.cp.ring",
        "ring_ulysses_attention",
    ),
}
_STOCK: dict[tuple[str, str], object] = {}


def _ours(target: tuple[str, str]) -> object:
    module, name = _PATCHES[target]
    return getattr(importlib.import_module(module), name)


def installed() -> bool:
    return all(getattr(importlib.import_module(m), a) is _ours((m, a)) for m, a in _PATCHES)


def install() -> None:
    """Route diffusers' Ulysses, ring and ring x Ulysses attention and its uneven gather through ours. Idempotent."""
    for target in _PATCHES:
        module = importlib.import_module(target[0])
        current, ours = getattr(module, target[1]), _ours(target)
        if current is ours:
            continue
        _STOCK.setdefault(target, current)
        setattr(module, target[1], ours)


@contextlib.contextmanager
def stock_diffusers() -> Iterator[None]:
    """diffusers' own objects inside the block (tests and benchmarks that show the stock defects), ours after it."""
    install()  # records the originals
    for (module, name), original in _STOCK.items():
        setattr(importlib.import_module(module), name, original)
    try:
        yield
    finally:
        install()
