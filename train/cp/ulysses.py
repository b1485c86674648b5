"""Trainable Ulysses-Anything attention: any sequence length, any head count, any CP degree, with a backward.

diffusers 0.42.1 ships `TemplatedUlyssesAnythingAttention` with a forward only (its backward raises), pads heads up
to a multiple of the degree (and asserts when it cannot), assembles split key masks in the wrong order when a non-last
shard is shorter, and gathers uneven outputs with an all_gather that gloo rejects. `install_ulysses_anything_backward`
replaces those pieces in diffusers' module namespace, where they are looked up at call time (patch.py).

The all-to-all, its layout and the mask riding in it are a2a.py's (the ring x Ulysses hybrid uses them too); a joint
mask's key order is masks.py's. Per-model state: the function reads the model's layout registry and transport from
the `_parallel_config` diffusers passes it, the model's `ContextParallelState` (state.py). With parallelism enabled
through diffusers' own API that is a plain `ParallelConfig`: then every call exchanges sizes, through a plain transport.

The attention between the two all-to-alls: the model's kernel (`parallel.attention_kernel`, kernels.py), called on
Q/K/V in the storage the all-to-all wrote for it, its output read back from the storage it wrote, its backward given
the saved output and LSE (no forward in the backward); with "backend" (and with a plain `ParallelConfig`) the op pair
diffusers passes in, as diffusers' own templated attention calls it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from train.errors import UserError

from . import patch
from .a2a import attention_kernel, heads_to_seq, model_state, qkv_to_heads, seq_to_heads
from .comm import TorchTransport, all_gather_uneven, exchange_ints
from .kernels import Kernel, as_bias
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
        # the kernels draw no dropout: an inference call with dropout (training refuses it above) keeps the backend op
        kernel = None if dropout_p else attention_kernel(parallel_config, query, attn_mask, is_causal, enable_gqa)
        forward_op = args[0] if args else kw["forward_op"]
        backward_op = args[1] if len(args) > 1 else kw["backward_op"]
        return super().apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                             forward_op, backward_op, parallel_config, kernel)  # fmt: skip

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
        kernel: Kernel | None = None,
    ):
        group = _parallel_config.context_parallel_config._ulysses_mesh.get_group()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        layout, transport = model_state(_parallel_config)
        heads_major = kernel is not None and kernel.storage == "bhsd"
        q, k, v, attn_mask, lay = qkv_to_heads(query, key, value, attn_mask, group, world, rank, layout, transport,
                                               heads_major)  # fmt: skip

        ctx.forward_op, ctx.backward_op, ctx._parallel_config = forward_op, backward_op, _parallel_config
        ctx.layout, ctx.group, ctx.transport, ctx.empty = lay, group, transport, lay.heads[rank] == 0
        ctx.kernel = kernel
        if kernel is not None:
            return _kernel_forward(ctx, kernel, q, k, v, attn_mask, scale, return_lse)
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
        if ctx.kernel is not None:
            return _kernel_backward(ctx, grad_out)
        (d_out,), _ = seq_to_heads([grad_out], [lay.q_sizes], lay, group, transport, "d_out")
        if ctx.empty:
            dq = d_out.new_empty(d_out.shape[:-1] + (ctx.kv_shapes[0][-1],))
            dk, dv = d_out.new_empty(ctx.kv_shapes[0]), d_out.new_empty(ctx.kv_shapes[1])
        else:
            dq, dk, dv, *_ = ctx.backward_op(ctx, d_out)
        seq = [lay.q_sizes, lay.kv_sizes, lay.kv_sizes]
        dq, dk, dv = heads_to_seq([dq, dk, dv], seq, lay, group, transport, "d_qkv")
        return dq, dk, dv, *(None,) * 10


def _kernel_forward(ctx, kernel: Kernel, q, k, v, mask, scale, return_lse: bool):
    """One kernel call on the head-sharded Q/K/V as the all-to-all delivered them (kernels.py: logical (B, h, S, D),
    in the storage the kernel reads); its output and LSE are saved for the backward, which then runs no forward."""
    lay, group, transport = ctx.layout, ctx.group, ctx.transport
    if kernel.storage == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bias = as_bias(mask, q.dtype)
    if ctx.empty:
        out, lse, aux = q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32), ()
    else:
        out, lse, aux = kernel.forward(q, k, v, bias, scale)
    ctx.save_for_backward(q, k, v, out, lse, bias)
    ctx.scale, ctx.aux = scale, aux
    (o,) = heads_to_seq([out], [lay.q_sizes], lay, group, transport, "out", heads_major=True)
    if not return_lse:
        return o
    (lse,) = heads_to_seq([lse.transpose(1, 2).unsqueeze(-1)], [lay.q_sizes], lay, group, transport, "lse")
    lse = lse.squeeze(-1)
    ctx.mark_non_differentiable(lse)
    return o, lse


def _kernel_backward(ctx, grad_out: torch.Tensor):
    lay, group, transport, kernel = ctx.layout, ctx.group, ctx.transport, ctx.kernel
    q, k, v, out, lse, bias = ctx.saved_tensors
    (d_out,), _ = seq_to_heads([grad_out], [lay.q_sizes], lay, group, transport, "d_out",
                               heads_major=kernel.storage == "bhsd")  # fmt: skip
    if kernel.storage == "bshd":
        d_out = d_out.transpose(1, 2)
    if ctx.empty:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:
        dq, dk, dv = kernel.backward(d_out, q, k, v, out, lse, bias, ctx.scale, ctx.aux)
    seq = [lay.q_sizes, lay.kv_sizes, lay.kv_sizes]
    dq, dk, dv = heads_to_seq([dq, dk, dv], seq, lay, group, transport, "d_qkv", heads_major=True)
    return dq, dk, dv, *(None,) * 10


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
