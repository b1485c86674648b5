"""Attention masks as CP attention receives them: their shapes, and the key order of a joint sequence's mask.

Where the keys come from. A rank's attention keys are its shards of the sequences the plan split, concatenated in
the order the processor concatenates them: joint attention takes [video_r | text_r]. The all-to-all (Ulysses) or the
ring delivers every rank's keys in rank order: [video_0 text_0 | video_1 text_1 | ...]. A mask split like the keys
(each rank holds the columns of its own keys) follows them for free. A mask that a forward builds WHOLE over the joint
sequence in model order ([video | text], HunyuanVideo's `attention_mask` from the kept-token count) does not: its
columns would mask the wrong keys.

The plan says so (`joint_key_mask: [path:input, ...]`: the split inputs the joint sequence is made of, in model order,
each rank's keys being the same concatenation of its shards). Every split hook records the global length of what it
split under that name, so `place_mask` knows each segment's length and, from the split rule (`tensor_split`), every
rank's shard of it: it reorders the mask's key columns (and its query rows, when it has one per query) into rank
order, identically on every rank and without a collective. A whole mask over a concatenation of splits that no
declaration explains is refused, on every rank before any collective, naming the plan key to add: never applied
wrongly.
"""

from __future__ import annotations

import torch

from train.errors import UserError

from .layout import split_sizes

__all__ = ["MaskPlacementError", "joint_order", "normalise_mask", "place_mask"]


class MaskPlacementError(UserError):
    """A whole attention mask over a joint sequence that the plan does not declare (same on every rank)."""


def normalise_mask(mask: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """Masks as SDPA broadcasts them: (B, 1, Mq, Mk) for every head, or (B, heads, Mq, Mk) per head."""
    if mask is None:
        return None
    if mask.dim() == 2:  # (B, S_kv) key padding
        return mask[:, None, None, :]
    if mask.dim() == 4 and mask.shape[1] in (1, heads):
        return mask
    raise ValueError(
        f"context parallelism supports attention masks of shape (B, S_kv), (B, 1, S_q|1, S_kv) or per head "
        f"(B, {heads}, S_q|1, S_kv); got {tuple(mask.shape)}."
    )


def joint_order(lengths: tuple[int, ...], world: int) -> list[int]:
    """Model-order positions of a joint sequence (segments of `lengths`, each whole, one after the other) in the
    order the ranks' keys arrive: rank 0's shard of every segment, then rank 1's, ..."""
    shards = [split_sizes(n, world) for n in lengths]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    order: list[int] = []
    for r in range(world):
        for start, sizes in zip(starts, shards):
            first = start + sum(sizes[:r])
            order.extend(range(first, first + sizes[r]))
    return order


def _order(state, lengths: tuple[int, ...], world: int, device: torch.device) -> torch.Tensor:
    key = ("joint_order", lengths, world, device)
    memo = state.layout.memo
    if key not in memo:
        memo[key] = torch.tensor(joint_order(lengths, world), dtype=torch.long, device=device)
    return memo[key]


def place_mask(mask: torch.Tensor | None, kv_len: int, parallel_config) -> torch.Tensor | None:
    """The (normalised) mask with a whole joint mask's keys, and per-query rows, in rank order (see the module
    docstring). `kv_len`: this rank's key count. Masks split like the keys (as many columns as this rank has keys,
    on every rank), or whole over one split sequence (rank order is model order), pass unchanged. Without a model CP
    state (diffusers' own API, op-level use) nothing is known: unchanged."""
    from .state import ContextParallelState

    if mask is None or not isinstance(parallel_config, ContextParallelState) or parallel_config.plan is None:
        return mask
    if mask.shape[-1] == kv_len:  # split like the keys (a whole mask has more: every rank holds keys)
        return mask
    layout, plan = parallel_config.layout, parallel_config.plan
    world = parallel_config.context_parallel_config._flattened_mesh.size()
    m = mask.shape[-1]
    if plan.joint_key_mask:
        lengths = tuple(layout.segments.get(name, -1) for name in plan.joint_key_mask)
        if -1 not in lengths and m == sum(lengths):
            order = _order(parallel_config, lengths, world, mask.device)
            mask = mask.index_select(-1, order)
            if mask.shape[-2] == m:  # one row per query of the same joint sequence: the rows arrive alike
                mask = mask.index_select(-2, order)
            return mask
    totals = {sum(p) for p in layout.partitions}
    joint = {a + b for a in totals for b in totals}  # the registry's rule: a sequence is one split or two
    if m not in totals and m in joint and world > 1:
        raise MaskPlacementError(
            f"{parallel_config.scope}: an attention mask of {m} keys is whole over a sequence made of two CP "
            f"splits (recorded lengths {sorted(totals)}), in model order, while the ranks hold their shards of each "
            f"split side by side: it would mask the wrong keys. Declare the segments in the plan "
            f"({plan.path.name}: joint_key_mask: [<module path>:<input>, ...], in model order), or feed no mask"
        )
    return mask
