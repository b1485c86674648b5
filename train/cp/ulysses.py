"""Trainable Ulysses-Anything attention: any sequence length, any head count, any CP degree, with a backward.

diffusers 0.42.1 ships `TemplatedUlyssesAnythingAttention` with a forward only (its backward raises), pads heads up
to a multiple of the degree (and asserts when it cannot), assembles split key masks in the wrong order when a non-last
shard is shorter, and gathers uneven outputs with an all_gather that gloo rejects. `install_ulysses_anything_backward`
replaces those pieces in diffusers' module namespace, where they are looked up at call time (patch.py).

The all-to-all, its layout and the mask riding in it are a2a.py's (the ring x Ulysses hybrid uses them too); a joint
mask's key order is masks.py's. Per-model state: the function reads the model's layout registry and transport from
the `_parallel_config` diffusers passes it, the model's `ContextParallelState` (state.py). With parallelism enabled
through diffusers' own API that is a plain `ParallelConfig`: then every call exchanges sizes, through a plain transport.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from train.errors import UserError

from . import patch
from .a2a import heads_to_seq, model_state, qkv_to_heads, seq_to_heads
from .comm import TorchTransport, all_gather_uneven, exchange_ints
from .layout import LayoutRegistry
from .masks import normalise_mask, place_mask

__all__ = ["GatherAnything", "UlyssesAnythingAttention", "all_gather_anything", "install_ulysses_anything_backward"]


class UlyssesAnythingAttention(torch.autograd.Function):
    """Drop-in, differentiable replacement for diffusers' `TemplatedUlyssesAnythingAttention` (same `.apply` args)."""

    @classmethod
    @torch.compiler.disable  # under a compiled block: a graph break here, the all-to-alls and backend op run eagerly
    def apply(cls, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *args, **kw):
        # User errors are raised here, before the first collective, so every rank fails the same way and none hangs.
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if training and dropout_p > 0:
            raise UserError(
                f"attention dropout {dropout_p} is not supported when training under Ulysses CP: the backward "
                "recomputes attention and would draw a different dropout mask. Set attention dropout to 0."
            )
        parallel_config = args[2] if len(args) > 2 else kw.get("_parallel_config")
        attn_mask = place_mask(normalise_mask(attn_mask, query.shape[2]), key.shape[1], parallel_config)
        return super().apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *args)

    @staticmethod
    def forward(
        ctx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
        return_lse: bool,
        forward_op,
        backward_op,
        _parallel_config=None,
    ):
        group = _parallel_config.context_parallel_config._ulysses_mesh.get_group()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        layout, transport = model_state(_parallel_config)
        q, k, v, attn_mask, lay = qkv_to_heads(query, key, value, attn_mask, group, world, rank, layout, transport)

        ctx.forward_op, ctx.backward_op, ctx._parallel_config = forward_op, backward_op, _parallel_config
        ctx.layout, ctx.group, ctx.transport, ctx.empty = lay, group, transport, lay.heads[rank] == 0
        if ctx.empty:  # fewer heads than ranks: this rank attends over nothing but still joins every collective
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32) if return_lse else None
        else:
            out = forward_op(
                ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                _save_ctx=True, _parallel_config=_parallel_config,
            )  # fmt: skip
            lse = None
            if return_lse:
                out, lse, *_ = out
        ctx.kv_shapes = (k.shape, v.shape)
        (out,) = heads_to_seq([out], [lay.q_sizes], lay, group, transport, "out")
        if not return_lse:
            return out
        (lse,) = heads_to_seq([lse.unsqueeze(-1)], [lay.q_sizes], lay, group, transport, "lse")
        lse = lse.squeeze(-1)
        ctx.mark_non_differentiable(lse)  # the LSE is an auxiliary output; its gradient is not propagated
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, *_grad_lse):
        lay, group, transport = ctx.layout, ctx.group, ctx.transport
        (d_out,), _ = seq_to_heads([grad_out], [lay.q_sizes], lay, group, transport, "d_out")
        if ctx.empty:
            dq = d_out.new_empty(d_out.shape[:-1] + (ctx.kv_shapes[0][-1],))
            dk, dv = d_out.new_empty(ctx.kv_shapes[0]), d_out.new_empty(ctx.kv_shapes[1])
        else:
            dq, dk, dv, *_ = ctx.backward_op(ctx, d_out)
        seq = [lay.q_sizes, lay.kv_sizes, lay.kv_sizes]
        dq, dk, dv = heads_to_seq([dq, dk, dv], seq, lay, group, transport, "d_qkv")
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


class GatherAnything(torch.autograd.Function):
    """Concatenate uneven per-rank shards along `dim`; backward returns exactly this rank's slice.

    Replaces diffusers' `AllGatherAnythingFunction`, whose forward uses an uneven all_gather (rejected by gloo) and
    whose backward re-derives the slice with `tensor_split`, which is wrong when shards are not tensor_split sizes.
    `layout` / `transport`: the model's (its CP state's gather hook passes them); None (diffusers' own hooks): shard
    sizes are exchanged, through a plain transport.
    """

    @staticmethod
    def forward(
        ctx,
        tensor: torch.Tensor,
        dim: int,
        group: dist.ProcessGroup,
        layout: LayoutRegistry | None = None,
        transport: TorchTransport | None = None,
    ):
        dim = dim % tensor.dim()
        transport = transport or TorchTransport()
        values, site = [tensor.shape[dim]], "gather_sizes"
        if layout is None:
            rows = exchange_ints(values, tensor.device, group, site, transport)
        else:
            rows = layout.lengths(values, tensor.device, group, site, transport)
        sizes = [row[0] for row in rows]
        ctx.dim, ctx.offset, ctx.size = dim, sum(sizes[: dist.get_rank(group)]), tensor.shape[dim]
        return all_gather_uneven(tensor.contiguous(), dim, sizes, group, "gather", transport)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(ctx.dim, ctx.offset, ctx.size), None, None, None, None


def all_gather_anything(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return GatherAnything.apply(tensor, dim, group)


def install_ulysses_anything_backward() -> None:
    """Make diffusers' context-parallel attention trainable and correct for uneven shapes, on gloo and NCCL: its
    Ulysses-Anything attention and uneven gather (this module), its ring and ring x Ulysses attention (ring.py).
    Idempotent; patch.py lists what it replaces. Models enabled with `enable_context_parallel` also get their own
    split/gather hooks (enable.py), which record each split in the model's layout registry, so their layers need no
    per-call size exchange. Models enabled through diffusers' own API train too, exchanging sizes in every call."""
    patch.install()
