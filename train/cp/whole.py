"""For CP attention processors whose attention needs the whole sequence's structure: head shards over every token,
and where a rank's token shard sits in the whole sequence.

Ulysses moves Q/K/V from sequence shards to head shards inside one attention call (ulysses.py), so a processor that
hands its whole sequence to one `dispatch_attention_fn` call needs nothing else. Some cannot: Qwen-Image 2.1's
processor cuts its joint [text | image] sequence into block-causal segments by position in the whole sequence and
attends each separately; Wan Animate's face adapter attends each token to the motion features of its own latent frame,
grouping the queries by frame. On a rank's shard those positions are other tokens. Their family's CP processor
(installed by the plan's `cp_processors`) uses one of:

- `heads_on_whole_sequence`: after the projections, one all-to-all over the whole CP group (ring x Ulysses ranks
  alike) gives every token of this rank's heads; the model's own segment logic then runs unchanged, locally, and the
  returned inverse brings the output back to this rank's tokens of every head. Exact: attention is per head.
- `shard_span`: this rank's first token and the whole length, for a processor that groups tokens by global position
  and can work on the shard (token-wise attention: each query's keys depend on its position only).

Both take every rank's shard sizes from the model's layout registry (layout.py): no size exchange when the splits
identify them, the same decision on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .a2a import HeadsToSeq, SeqToHeads, model_state
from .comm import exchange_ints

__all__ = ["heads_on_whole_sequence", "shard_span"]


def _cp_group(parallel_config) -> dist.ProcessGroup:
    """The whole CP group (ring x Ulysses ranks, flattened), the group the plan's split hooks split over."""
    return parallel_config.context_parallel_config._flattened_mesh.get_group()


def heads_on_whole_sequence(
    parallel_config, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(B, s_r, H, D) shards of q, k, v → (B, S, h_r, D): every token, this rank's heads (any head count: a rank may
    get none). Returns them and the inverse for the attention output ((B, S, h_r, D) → (B, s_r, H, D)). Q and K/V
    may have different lengths (each its own split)."""
    group = _cp_group(parallel_config)
    layout, transport = model_state(parallel_config)
    held: dict = {}
    q, k, v = SeqToHeads.apply(query, key, value, None, group, layout, transport, held)
    lay = held["layout"]
    return q, k, v, lambda out: HeadsToSeq.apply(out.contiguous(), lay, group, transport)


def shard_span(parallel_config, local_len: int, device: torch.device) -> tuple[int, int]:
    """(start, total): this rank's shard is tokens [start, start + local_len) of a sequence of `total` tokens."""
    group = _cp_group(parallel_config)
    layout, transport = model_state(parallel_config)
    if layout is None:  # parallelism enabled through diffusers' own API: no registry, exchange
        rows = exchange_ints([local_len], device, group, "span", transport)
    else:
        rows = layout.lengths([local_len], device, group, "span", transport)
    rank = dist.get_rank(group)
    return sum(row[0] for row in rows[:rank]), sum(row[0] for row in rows)
