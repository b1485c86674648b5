"""Trainable Ulysses-Anything attention: any sequence length, any head count, any CP degree, with a backward.

diffusers 0.42.1 ships `TemplatedUlyssesAnythingAttention` with a forward only (its backward raises), pads heads up
to a multiple of the degree (and asserts when it cannot), assembles split key masks in the wrong order when a non-last
shard is shorter, and gathers uneven outputs with an all_gather that gloo rejects. `install_ulysses_anything_backward`
replaces those pieces in diffusers' module namespace, where they are looked up at call time.

Layout. Rank r holds `s_r` tokens of every head (B, s_r, H, D). Heads are split unevenly with `tensor_split`
(rank r gets `h_r` heads, possibly 0) instead of zero-padded, so no padding bytes travel and every head count works.
One all-to-all-v moves Q, K and V together: rank r sends rank j the block (B, s_r, h_j, D) of each tensor and receives
(B, s_i, h_r, D) from every rank i, then concatenates along the sequence: (B, S, h_r, D). The output goes back the
inverse way. Every all-to-all only permutes elements, so its backward is the inverse all-to-all.

Masks. A mask broadcast over heads (B, 1, Mq, Mk) or per head (B, H, Mq, Mk) (LTX's processors expand the text mask to
(B, H, 1, S_kv)) reaches the attention in the global layout: its key dim, when split like the keys, rides in the same
all-to-all (rank r sends rank j its keys of the heads j owns, so a per-head mask arrives with exactly the h_r heads
this rank attends over); a mask split along queries, or in a dtype the payload cannot carry exactly, is gathered whole
and then cut to this rank's heads.

Per-model state. The function reads the model's layout registry and transport from the `_parallel_config` diffusers
passes it: the model's `ContextParallelState` (state.py). With parallelism enabled through diffusers' own API that is
a plain `ParallelConfig`: then every call exchanges sizes, through a plain transport.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import TorchTransport, all_gather_uneven, exchange_ints
from .layout import LayoutRegistry, split_sizes
from .state import ContextParallelState

__all__ = ["UlyssesAnythingAttention", "GatherAnything", "install_ulysses_anything_backward", "split_sizes"]


def _offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


@dataclass(frozen=True)
class _Layout:
    """Everything both passes need, identical on every rank (built from exchanged sizes only)."""

    rank: int
    world: int
    q_sizes: tuple[int, ...]  # local query tokens on each rank
    kv_sizes: tuple[int, ...]  # local key/value tokens on each rank
    heads: tuple[int, ...]  # heads each rank attends over after the exchange


@dataclass(frozen=True)
class Rider:
    """Extra 1-D data (in the payload dtype) that travels in an all-to-all: `pieces[j]` goes to rank j, and
    `sizes[i][j]` is what rank i sends rank j (the same table on every rank, built from exchanged sizes only)."""

    pieces: tuple[torch.Tensor, ...]
    sizes: tuple[tuple[int, ...], ...]

    @classmethod
    def whole(cls, x: torch.Tensor, sizes: tuple[int, ...]) -> Rider:
        """`x` sent whole to every rank; rank i's is `sizes[i]` elements."""
        return cls((x,) * len(sizes), tuple((n,) * len(sizes) for n in sizes))


def _max_elems(xs: list[torch.Tensor], seq_sizes: list[tuple[int, ...]], lay: _Layout, riders=()) -> int:
    """The largest send or receive total of any rank for this exchange (both directions move the same blocks):
    the same number on every rank, so fixed-buffer transports decide alike whether it fits."""
    B, H = xs[0].shape[0], sum(lay.heads)
    send = max(
        sum(B * sizes[i] * H * x.shape[-1] for x, sizes in zip(xs, seq_sizes)) + sum(sum(rd.sizes[i]) for rd in riders)
        for i in range(lay.world)
    )
    recv = max(
        sum(B * sum(sizes) * lay.heads[j] * x.shape[-1] for x, sizes in zip(xs, seq_sizes))
        + sum(row[j] for rd in riders for row in rd.sizes)
        for j in range(lay.world)
    )
    return max(send, recv)


def _seq_to_heads(
    xs: list[torch.Tensor],
    seq_sizes: list[tuple[int, ...]],
    lay: _Layout,
    group,
    transport: TorchTransport,
    site: str,
    riders: list[Rider] = (),
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """(B, s_r, H, D_t) per tensor → (B, S_t, h_r, D_t): scatter heads, gather sequence, one all-to-all for all.

    `riders` travel in the same all-to-all: each rank gets each rank's piece for it (returned per rider, one piece
    per source rank). That is how a split key mask (per head: only the heads the destination owns), or each rank's
    true lengths, travel without a collective of their own."""
    r, heads = lay.rank, lay.heads
    h_off = _offsets(list(heads))
    dtype, device = xs[0].dtype, xs[0].device
    B = xs[0].shape[0]
    # Send buffer, ordered by destination rank, then by tensor: one copy of each block straight into place.
    in_splits = [
        sum(B * sizes[r] * heads[j] * x.shape[-1] for x, sizes in zip(xs, seq_sizes))
        + sum(rd.sizes[r][j] for rd in riders)
        for j in range(lay.world)
    ]
    send = torch.empty(sum(in_splits), dtype=dtype, device=device)
    pos = 0
    for j in range(lay.world):
        for x in xs:
            blk = x[:, :, h_off[j] : h_off[j] + heads[j]]
            send[pos : pos + blk.numel()].view(blk.shape).copy_(blk)
            pos += blk.numel()
        for rd in riders:
            piece = rd.pieces[j]
            send[pos : pos + piece.numel()].copy_(piece)
            pos += piece.numel()
    out_splits = [
        sum(B * sizes[i] * heads[r] * x.shape[-1] for x, sizes in zip(xs, seq_sizes))
        + sum(rd.sizes[i][r] for rd in riders)
        for i in range(lay.world)
    ]
    max_elems = _max_elems(xs, seq_sizes, lay, riders)
    recv = transport.all_to_all(send, in_splits, out_splits, group, site, max_elems)
    # Received: for each source rank i, for each tensor, a (B, s_i, h_r, D) block. Concatenate along the sequence.
    pieces: list[list[torch.Tensor]] = [[] for _ in xs]
    rode: list[list[torch.Tensor]] = [[] for _ in riders]
    pos = 0
    for i in range(lay.world):
        for t, (x, sizes) in enumerate(zip(xs, seq_sizes)):
            shape = (B, sizes[i], heads[r], x.shape[-1])
            n = shape[0] * shape[1] * shape[2] * shape[3]
            pieces[t].append(recv[pos : pos + n].view(shape))
            pos += n
        for t, rd in enumerate(riders):
            n = rd.sizes[i][r]
            rode[t].append(recv[pos : pos + n])
            pos += n
    return [torch.cat(p, dim=1) for p in pieces], rode


def _heads_to_seq(
    xs: list[torch.Tensor], seq_sizes: list[tuple[int, ...]], lay: _Layout, group, transport: TorchTransport, site: str
):
    """(B, S_t, h_r, D_t) per tensor → (B, s_r, H, D_t): the inverse of `_seq_to_heads`."""
    r, heads = lay.rank, lay.heads
    dtype, device = xs[0].dtype, xs[0].device
    B = xs[0].shape[0]
    offs = [_offsets(list(sizes)) for sizes in seq_sizes]
    in_splits = [
        sum(B * sizes[j] * heads[r] * x.shape[-1] for x, sizes in zip(xs, seq_sizes)) for j in range(lay.world)
    ]
    send = torch.empty(sum(in_splits), dtype=dtype, device=device)
    pos = 0
    for j in range(lay.world):
        for x, sizes, off in zip(xs, seq_sizes, offs):
            blk = x[:, off[j] : off[j] + sizes[j]]
            send[pos : pos + blk.numel()].view(blk.shape).copy_(blk)
            pos += blk.numel()
    out_splits = [
        sum(B * sizes[r] * heads[i] * x.shape[-1] for x, sizes in zip(xs, seq_sizes)) for i in range(lay.world)
    ]
    recv = transport.all_to_all(send, in_splits, out_splits, group, site, _max_elems(xs, seq_sizes, lay))
    pieces: list[list[torch.Tensor]] = [[] for _ in xs]
    pos = 0
    for i in range(lay.world):
        for t, (x, sizes) in enumerate(zip(xs, seq_sizes)):
            shape = (B, sizes[r], heads[i], x.shape[-1])
            n = shape[0] * shape[1] * shape[2] * shape[3]
            pieces[t].append(recv[pos : pos + n].view(shape))
            pos += n
    return [torch.cat(p, dim=2) for p in pieces]


def _normalise_mask(mask: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """Masks as SDPA broadcasts them: (B, 1, Mq, Mk) for every head, or (B, heads, Mq, Mk) per head."""
    if mask is None:
        return None
    if mask.dim() == 2:  # (B, S_kv) key padding
        return mask[:, None, None, :]
    if mask.dim() == 4 and mask.shape[1] in (1, heads):
        return mask
    raise ValueError(
        f"Ulysses context parallelism supports attention masks of shape (B, S_kv), (B, 1, S_q|1, S_kv) or per head "
        f"(B, {heads}, S_q|1, S_kv); got {tuple(mask.shape)}."
    )


def _own_heads(mask: torch.Tensor, lay: _Layout, rank: int) -> torch.Tensor:
    """A per-head mask's rows of the heads `rank` attends over (a mask broadcast over heads stays as it is)."""
    if mask.shape[1] == 1:
        return mask
    return mask.narrow(1, sum(lay.heads[:rank]), lay.heads[rank])


def _key_split(lens: list[list[int]], lay: _Layout) -> bool:
    """The mask's key dim is split like the keys (else it is whole on every rank); from exchanged data only."""
    return lay.world > 1 and [row[3] for row in lens] == list(lay.kv_sizes)


def _query_split(lens: list[list[int]], lay: _Layout) -> bool:
    mq = [row[2] for row in lens]
    return lay.world > 1 and mq == list(lay.q_sizes) and any(n != 1 for n in mq)


def _mask_rider(mask: torch.Tensor | None, lens: list[list[int]], lay: _Layout, dtype: torch.dtype) -> list[Rider]:
    """A split key mask that can ride in the Q/K/V all-to-all, in the payload dtype; or nothing. Rank j gets this
    rank's keys (Bm, Hm_j, Mq, s_kv) of the heads it owns (Hm_j = h_j per head, 1 for a mask broadcast over heads).

    Bool masks (0/1 are exact in any float dtype) and masks already in the payload dtype qualify; a mask split on
    queries too, or an additive mask of another dtype (casting would round it), takes a gather of its own."""
    if mask is None or not _key_split(lens, lay) or _query_split(lens, lay):
        return []
    if mask.dtype != torch.bool and mask.dtype != dtype:
        return []
    Bm, Mq = mask.shape[0], mask.shape[2]
    hm = [lay.heads[j] if mask.shape[1] > 1 else 1 for j in range(lay.world)]
    pieces = tuple(_own_heads(mask, lay, j).to(dtype).contiguous().view(-1) for j in range(lay.world))
    sizes = tuple(tuple(Bm * hm[j] * Mq * n for j in range(lay.world)) for n in lay.kv_sizes)
    return [Rider(pieces, sizes)]


def _mask_keys(mask: torch.Tensor, pieces: list[torch.Tensor], lay: _Layout) -> torch.Tensor:
    """The rider's pieces back to the key dim: (Bm, Hm_r, Mq, S_kv), this rank's heads only."""
    Bm, Mq = mask.shape[0], mask.shape[2]
    hm = lay.heads[lay.rank] if mask.shape[1] > 1 else 1
    return torch.cat([p.view(Bm, hm, Mq, n) for p, n in zip(pieces, lay.kv_sizes)], dim=-1)


def _encode(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Ints as payload elements, bit for bit (an all-to-all only copies bytes): 8 bytes each."""
    return torch.tensor(values, dtype=torch.int64, device=device).view(torch.uint8).view(dtype)


def _decode(piece: torch.Tensor) -> list[int]:
    return piece.clone().view(torch.uint8).view(torch.int64).tolist()


def _assemble_mask(mask, lens: list[list[int]], lay: _Layout, group, transport, keys) -> torch.Tensor | None:
    """Bring a mask to the global (post all-to-all) layout, with this rank's heads only (a per-head mask), deciding
    from exchanged sizes only: same on all ranks. `keys`: the mask's key dim as it came back from the Q/K/V
    all-to-all (the rider, already this rank's heads), if it travelled there."""
    if mask is None:
        return None
    mq, mk = [row[2] for row in lens], [row[3] for row in lens]
    s_q, s_kv = sum(lay.q_sizes), sum(lay.kv_sizes)
    own = False  # the mask holds only this rank's heads already
    if keys is not None:  # (Bm, Hm_r, Mq, S_kv): global keys, own heads
        mask, own = (keys != 0 if mask.dtype == torch.bool else keys), True
    elif _key_split(lens, lay):
        # Split key padding: concatenate the shards in rank order.
        mask = all_gather_uneven(mask, -1, mk, group, "mask", transport)
    elif any(n != s_kv for n in mk):
        raise ValueError(
            f"attention mask key length per rank {mk} matches neither the local key lengths {list(lay.kv_sizes)} "
            f"nor the global key length {s_kv}"
        )
    if _query_split(lens, lay):
        mask = all_gather_uneven(mask, -2, mq, group, "mask", transport)
    elif any(n not in (1, s_q) for n in mq):
        raise ValueError(
            f"attention mask query length per rank {mq} matches neither 1, the local query lengths "
            f"{list(lay.q_sizes)} nor the global query length {s_q}"
        )
    return mask if own else _own_heads(mask, lay, lay.rank)


def _pad_seq(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[1] == n else torch.cat([x, x.new_zeros((x.shape[0], n - x.shape[1], *x.shape[2:]))], dim=1)


def _trim_seq(x: torch.Tensor, chunks: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """Keep the first `sizes[i]` of each source's `chunks[i]` rows (drop the padding)."""
    if chunks == sizes:
        return x
    return torch.cat([x.narrow(1, off, n) for off, n in zip(_offsets(list(chunks)), sizes)], dim=1)


def _qkv_to_heads(query, key, value, attn_mask, group, world: int, rank: int, layout, transport):
    """The forward's one Q/K/V all-to-all. Returns head-sharded q, k, v, the mask in the global layout, the layout.

    Every rank's local lengths come from the layout registry (layout.py), identical on every rank and without a
    collective; never from a cache keyed by local length (that is how ranks hang). When the registry can only bound
    them (two recorded splits too close to tell apart on some rank), the chunks are padded to the bounds, each rank's
    true lengths travel in the same all-to-all, and the padding is dropped on arrival. Without a registry (op-level
    use, or a plan without `layout_registry: true`) the lengths are exchanged first. `layout` is None without a CP
    state (parallelism enabled through diffusers' own API): exchanged too."""
    mask_q = -1 if attn_mask is None else attn_mask.shape[-2]
    mask_k = -1 if attn_mask is None else attn_mask.shape[-1]
    values = [query.shape[1], key.shape[1], mask_q, mask_k]
    if layout is None:
        rows, exact = exchange_ints(values, query.device, group, "sizes", transport), True
    else:
        rows, exact = layout.resolve(
            values, query.device, group, "sizes", transport, ties=(None, None, 0, 1), bounds_ok=attn_mask is None
        )
    heads = tuple(split_sizes(query.shape[2], world))
    if exact:
        lay = _Layout(rank, world, tuple(r[0] for r in rows), tuple(r[1] for r in rows), heads)
        riders = _mask_rider(attn_mask, rows, lay, query.dtype)
        (q, k, v), rode = _seq_to_heads(
            [query, key, value], [lay.q_sizes, lay.kv_sizes, lay.kv_sizes], lay, group, transport, "qkv", riders
        )
        keys = _mask_keys(attn_mask, rode[0], lay) if riders else None
        return q, k, v, _assemble_mask(attn_mask, rows, lay, group, transport, keys), lay
    q_cap, kv_cap = tuple(r[0] for r in rows), tuple(r[1] for r in rows)
    padded = _Layout(rank, world, q_cap, kv_cap, heads)
    header = _encode(values, query.dtype, query.device)
    xs = [_pad_seq(query, q_cap[rank]), _pad_seq(key, kv_cap[rank]), _pad_seq(value, kv_cap[rank])]
    (q, k, v), rode = _seq_to_heads(
        xs, [q_cap, kv_cap, kv_cap], padded, group, transport, "qkv", [Rider.whole(header, (header.numel(),) * world)]
    )
    lens = [_decode(piece) for piece in rode[0]]
    lay = _Layout(rank, world, tuple(r[0] for r in lens), tuple(r[1] for r in lens), heads)
    q = _trim_seq(q, q_cap, lay.q_sizes)
    k, v = (_trim_seq(t, kv_cap, lay.kv_sizes) for t in (k, v))
    return q, k, v, None, lay


def _model_state(parallel_config) -> tuple[LayoutRegistry | None, TorchTransport]:
    """The model's layout registry and transport, from its CP state. A plain diffusers `ParallelConfig` (parallelism
    enabled through diffusers' own API) has neither: no registry (sizes exchanged per call), a plain transport."""
    if isinstance(parallel_config, ContextParallelState):
        return parallel_config.layout, parallel_config.transport
    return None, TorchTransport()


class UlyssesAnythingAttention(torch.autograd.Function):
    """Drop-in, differentiable replacement for diffusers' `TemplatedUlyssesAnythingAttention` (same `.apply` args)."""

    @classmethod
    @torch.compiler.disable  # under a compiled block: a graph break here, the all-to-alls and backend op run eagerly
    def apply(cls, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *args, **kw):
        # User errors are raised here, before the first collective, so every rank fails the same way and none hangs.
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if training and dropout_p > 0:
            raise ValueError(
                f"attention dropout {dropout_p} is not supported when training under Ulysses CP: the backward "
                "recomputes attention and would draw a different dropout mask. Set attention dropout to 0."
            )
        attn_mask = _normalise_mask(attn_mask, query.shape[2])
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
        layout, transport = _model_state(_parallel_config)
        q, k, v, attn_mask, lay = _qkv_to_heads(query, key, value, attn_mask, group, world, rank, layout, transport)

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
        (out,) = _heads_to_seq([out], [lay.q_sizes], lay, group, transport, "out")
        if not return_lse:
            return out
        (lse,) = _heads_to_seq([lse.unsqueeze(-1)], [lay.q_sizes], lay, group, transport, "lse")
        lse = lse.squeeze(-1)
        ctx.mark_non_differentiable(lse)  # the LSE is an auxiliary output; its gradient is not propagated
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, *_grad_lse):
        lay, group, transport = ctx.layout, ctx.group, ctx.transport
        (d_out,), _ = _seq_to_heads([grad_out], [lay.q_sizes], lay, group, transport, "d_out")
        if ctx.empty:
            dq = d_out.new_empty(d_out.shape[:-1] + (ctx.kv_shapes[0][-1],))
            dk, dv = d_out.new_empty(ctx.kv_shapes[0]), d_out.new_empty(ctx.kv_shapes[1])
        else:
            dq, dk, dv, *_ = ctx.backward_op(ctx, d_out)
        seq = [lay.q_sizes, lay.kv_sizes, lay.kv_sizes]
        dq, dk, dv = _heads_to_seq([dq, dk, dv], seq, lay, group, transport, "d_qkv")
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


def _all_gather_anything(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return GatherAnything.apply(tensor, dim, group)


# diffusers' own objects that `install_ulysses_anything_backward` replaced, kept for `uninstall_...`. Module state on
# purpose: it records a patch of diffusers' module namespace, which is itself process-wide. Written once, by the first
# install (while diffusers' own objects are still in place), never changed after; it holds nothing per model.
_STOCK: dict[str, object] = {}


def _installed() -> bool:
    from diffusers.models import attention_dispatch

    return attention_dispatch.TemplatedUlyssesAnythingAttention is UlyssesAnythingAttention


def install_ulysses_anything_backward() -> None:
    """Make diffusers' Ulysses-Anything path trainable and correct for uneven shapes, on gloo and NCCL. Idempotent.

    Patches, in diffusers' own module namespaces (looked up at call time, so every CP-capable backend benefits):
    - `attention_dispatch.TemplatedUlyssesAnythingAttention` → `UlyssesAnythingAttention` (backward, uneven heads
      without padding, correct split-mask assembly, LSE as a non-differentiable output);
    - `hooks.context_parallel.AllGatherAnythingFunction` / `_all_gather_anything` → `GatherAnything` (uneven output
      gather that gloo accepts, exact backward slice).
    Models enabled with `enable_context_parallel` also get their own split/gather hooks (enable.py), which record
    each split in the model's layout registry, so their layers need no per-call size exchange. Models enabled through
    diffusers' own API train too, exchanging sizes in every call.
    """
    from diffusers.hooks import context_parallel as cp_hooks
    from diffusers.models import attention_dispatch

    if _installed():
        return
    if not _STOCK:
        _STOCK.update(
            attention=attention_dispatch.TemplatedUlyssesAnythingAttention,
            gather_fn=cp_hooks.AllGatherAnythingFunction,
            gather=cp_hooks._all_gather_anything,
        )
    attention_dispatch.TemplatedUlyssesAnythingAttention = UlyssesAnythingAttention
    cp_hooks.AllGatherAnythingFunction = GatherAnything
    cp_hooks._all_gather_anything = _all_gather_anything


def uninstall_ulysses_anything_backward() -> None:
    """Restore diffusers' originals (used by tests and benchmarks that demonstrate the stock defects)."""
    from diffusers.hooks import context_parallel as cp_hooks
    from diffusers.models import attention_dispatch

    if not _installed():
        return
    attention_dispatch.TemplatedUlyssesAnythingAttention = _STOCK["attention"]
    cp_hooks.AllGatherAnythingFunction = _STOCK["gather_fn"]
    cp_hooks._all_gather_anything = _STOCK["gather"]
