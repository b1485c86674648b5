"""The all-to-all both CP attention paths share (Ulysses-Anything, and the Ulysses step of ring x Ulysses).

Layout. Rank r holds `s_r` tokens of every head (B, s_r, H, D). Heads are split unevenly with `tensor_split`
(rank r gets `h_r` heads, possibly 0) instead of zero-padded, so no padding bytes travel and every head count works.
One all-to-all-v moves Q, K and V together: rank r sends rank j the block (B, s_r, h_j, D) of each tensor and receives
(B, s_i, h_r, D) from every rank i, then concatenates along the sequence: (B, S, h_r, D). The output goes back the
inverse way. Every all-to-all only permutes elements, so its backward is the inverse all-to-all.

Masks. A mask broadcast over heads (B, 1, Mq, Mk) or per head (B, H, Mq, Mk) reaches the attention in the global
layout (masks.py has already put a joint mask's keys in rank order): its key dim, when split like the keys, rides in
the same all-to-all (rank r sends rank j its keys of the heads j owns, so a per-head mask arrives with exactly the h_r
heads this rank attends over); a mask split along queries, or in a dtype the payload cannot carry exactly, is gathered
whole and then cut to this rank's heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from train.errors import UserError

from .comm import TorchTransport, all_gather_uneven, exchange_ints
from .kernels import pick
from .layout import LayoutRegistry, split_sizes
from .state import ContextParallelState

__all__ = [
    "HeadsToSeq", "Layout", "Rider", "SeqToHeads", "attention_kernel", "heads_to_seq", "model_state", "offsets",
    "own_heads", "qkv_to_heads", "seq_to_heads",
]  # fmt: skip


def offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


@dataclass(frozen=True)
class Layout:
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


def _max_elems(xs: list[torch.Tensor], seq_sizes: list[tuple[int, ...]], lay: Layout, riders=()) -> int:
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


def seq_to_heads(
    xs: list[torch.Tensor],
    seq_sizes: list[tuple[int, ...]],
    lay: Layout,
    group,
    transport: TorchTransport,
    site: str,
    riders: list[Rider] = (),
    heads_major: bool = False,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """(B, s_r, H, D_t) per tensor → (B, S_t, h_r, D_t): scatter heads, gather sequence, one all-to-all for all.
    `heads_major`: assemble (B, h_r, S_t, D_t) instead, the storage a heads-major kernel reads (kernels.py): the
    transposition happens in the one copy that assembles the received blocks, so none runs before the kernel.

    `riders` travel in the same all-to-all: each rank gets each rank's piece for it (returned per rider, one piece
    per source rank). That is how a split key mask (per head: only the heads the destination owns), or each rank's
    true lengths, travel without a collective of their own."""
    r, heads = lay.rank, lay.heads
    h_off = offsets(list(heads))
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
    if not heads_major:
        return [torch.cat(p, dim=1) for p in pieces], rode
    out = []
    for p in pieces:
        y = p[0].new_empty((B, heads[r], sum(b.shape[1] for b in p), p[0].shape[-1]))
        for off, b in zip(offsets([b.shape[1] for b in p]), p):
            y[:, :, off : off + b.shape[1]].copy_(b.transpose(1, 2))
        out.append(y)
    return out, rode


def heads_to_seq(
    xs: list[torch.Tensor],
    seq_sizes: list[tuple[int, ...]],
    lay: Layout,
    group,
    transport: TorchTransport,
    site: str,
    heads_major: bool = False,
):
    """(B, S_t, h_r, D_t) per tensor → (B, s_r, H, D_t): the inverse of `seq_to_heads`. `heads_major`: the tensors
    are (B, h_r, S_t, D_t) (any strides: a kernel's output as it wrote it), read straight into the send buffer."""
    r, heads = lay.rank, lay.heads
    dtype, device = xs[0].dtype, xs[0].device
    B = xs[0].shape[0]
    offs = [offsets(list(sizes)) for sizes in seq_sizes]
    in_splits = [
        sum(B * sizes[j] * heads[r] * x.shape[-1] for x, sizes in zip(xs, seq_sizes)) for j in range(lay.world)
    ]
    send = torch.empty(sum(in_splits), dtype=dtype, device=device)
    pos = 0
    for j in range(lay.world):
        for x, sizes, off in zip(xs, seq_sizes, offs):
            blk = x.narrow(2 if heads_major else 1, off[j], sizes[j])
            blk = blk.transpose(1, 2) if heads_major else blk
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


def own_heads(mask: torch.Tensor, lay: Layout, rank: int) -> torch.Tensor:
    """A per-head mask's rows of the heads `rank` attends over (a mask broadcast over heads stays as it is)."""
    if mask.shape[1] == 1:
        return mask
    return mask.narrow(1, sum(lay.heads[:rank]), lay.heads[rank])


def _key_split(lens: list[list[int]], lay: Layout) -> bool:
    """The mask's key dim is split like the keys (else it is whole on every rank); from exchanged data only."""
    return lay.world > 1 and [row[3] for row in lens] == list(lay.kv_sizes)


def _query_split(lens: list[list[int]], lay: Layout) -> bool:
    mq = [row[2] for row in lens]
    return lay.world > 1 and mq == list(lay.q_sizes) and any(n != 1 for n in mq)


def _mask_rider(mask: torch.Tensor | None, lens: list[list[int]], lay: Layout, dtype: torch.dtype) -> list[Rider]:
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
    pieces = tuple(own_heads(mask, lay, j).to(dtype).contiguous().view(-1) for j in range(lay.world))
    sizes = tuple(tuple(Bm * hm[j] * Mq * n for j in range(lay.world)) for n in lay.kv_sizes)
    return [Rider(pieces, sizes)]


def _mask_keys(mask: torch.Tensor, pieces: list[torch.Tensor], lay: Layout) -> torch.Tensor:
    """The rider's pieces back to the key dim: (Bm, Hm_r, Mq, S_kv), this rank's heads only."""
    Bm, Mq = mask.shape[0], mask.shape[2]
    hm = lay.heads[lay.rank] if mask.shape[1] > 1 else 1
    return torch.cat([p.view(Bm, hm, Mq, n) for p, n in zip(pieces, lay.kv_sizes)], dim=-1)


def _encode(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Ints as payload elements, bit for bit (an all-to-all only copies bytes): 8 bytes each."""
    return torch.tensor(values, dtype=torch.int64, device=device).view(torch.uint8).view(dtype)


def _decode(piece: torch.Tensor) -> list[int]:
    return piece.clone().view(torch.uint8).view(torch.int64).tolist()


def _assemble_mask(mask, lens: list[list[int]], lay: Layout, group, transport, keys) -> torch.Tensor | None:
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
    return mask if own else own_heads(mask, lay, lay.rank)


def _pad_seq(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[1] == n else torch.cat([x, x.new_zeros((x.shape[0], n - x.shape[1], *x.shape[2:]))], dim=1)


def _trim_seq(x: torch.Tensor, chunks: tuple[int, ...], sizes: tuple[int, ...], dim: int = 1) -> torch.Tensor:
    """Keep the first `sizes[i]` of each source's `chunks[i]` rows along `dim` (drop the padding)."""
    if chunks == sizes:
        return x
    return torch.cat([x.narrow(dim, off, n) for off, n in zip(offsets(list(chunks)), sizes)], dim=dim)


def qkv_to_heads(query, key, value, attn_mask, group, world: int, rank: int, layout, transport, heads_major=False):
    """The forward's one Q/K/V all-to-all. Returns head-sharded q, k, v ((B, S, h_r, D), or (B, h_r, S, D) with
    `heads_major`), the mask in the global layout, the layout.

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
        lay = Layout(rank, world, tuple(r[0] for r in rows), tuple(r[1] for r in rows), heads)
        riders = _mask_rider(attn_mask, rows, lay, query.dtype)
        (q, k, v), rode = seq_to_heads([query, key, value], [lay.q_sizes, lay.kv_sizes, lay.kv_sizes], lay, group,
                                       transport, "qkv", riders, heads_major)  # fmt: skip
        keys = _mask_keys(attn_mask, rode[0], lay) if riders else None
        return q, k, v, _assemble_mask(attn_mask, rows, lay, group, transport, keys), lay
    q_cap, kv_cap = tuple(r[0] for r in rows), tuple(r[1] for r in rows)
    padded = Layout(rank, world, q_cap, kv_cap, heads)
    header = _encode(values, query.dtype, query.device)
    xs = [_pad_seq(query, q_cap[rank]), _pad_seq(key, kv_cap[rank]), _pad_seq(value, kv_cap[rank])]
    rider = [Rider.whole(header, (header.numel(),) * world)]
    (q, k, v), rode = seq_to_heads(xs, [q_cap, kv_cap, kv_cap], padded, group, transport, "qkv", rider, heads_major)
    lens = [_decode(piece) for piece in rode[0]]
    lay = Layout(rank, world, tuple(r[0] for r in lens), tuple(r[1] for r in lens), heads)
    dim = 2 if heads_major else 1
    q = _trim_seq(q, q_cap, lay.q_sizes, dim)
    k, v = (_trim_seq(t, kv_cap, lay.kv_sizes, dim) for t in (k, v))
    return q, k, v, None, lay


class SeqToHeads(torch.autograd.Function):
    """The Q/K/V all-to-all (sequence → heads) as an autograd node; `out` receives the mask in the group's global
    layout (this rank's heads) and the layout, which the output's inverse needs. `layout`: the model's registry when
    `group` is the whole CP group its splits are recorded over (no size exchange); None for the Ulysses group of ring
    x Ulysses (its splits are not the registry's): sizes are exchanged."""

    @staticmethod
    def forward(ctx, query, key, value, mask, group, layout, transport, out: dict):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        q, k, v, mask, lay = qkv_to_heads(query, key, value, mask, group, world, rank, layout, transport)
        ctx.lay, ctx.group, ctx.transport = lay, group, transport
        out.update(mask=mask, layout=lay)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        lay = ctx.lay
        seq = [lay.q_sizes, lay.kv_sizes, lay.kv_sizes]
        dq, dk, dv = heads_to_seq([dq, dk, dv], seq, lay, ctx.group, ctx.transport, "d_qkv")
        return dq, dk, dv, None, None, None, None, None


class HeadsToSeq(torch.autograd.Function):
    """The output's inverse all-to-all (heads → sequence) as an autograd node."""

    @staticmethod
    def forward(ctx, x, lay, group, transport):
        ctx.lay, ctx.group, ctx.transport = lay, group, transport
        (y,) = heads_to_seq([x], [lay.q_sizes], lay, group, transport, "out")
        return y

    @staticmethod
    def backward(ctx, grad):
        lay = ctx.lay
        (d,), _ = seq_to_heads([grad.contiguous()], [lay.q_sizes], lay, ctx.group, ctx.transport, "d_out")
        return d, None, None, None


def model_state(parallel_config) -> tuple[LayoutRegistry | None, TorchTransport]:
    """The model's layout registry and transport, from its CP state. A plain diffusers `ParallelConfig` (parallelism
    enabled through diffusers' own API) has neither: no registry (sizes exchanged per call), a plain transport."""
    if isinstance(parallel_config, ContextParallelState):
        return parallel_config.layout, parallel_config.transport
    return None, TorchTransport()


def attention_kernel(parallel_config, query: torch.Tensor, mask, is_causal: bool, enable_gqa: bool):
    """The kernel (kernels.py) a CP attention call runs, or None for the backend's own op pair: what the model's CP
    state names ("backend" with a plain diffusers `ParallelConfig`). The kernels do neither causal attention nor
    GQA: `auto` leaves such a call to the backend op, a named kernel refuses it. Decided from what every rank of the
    group shares (device type, dtype, whether there is a mask): the same on every rank, before any collective."""
    name = parallel_config.kernel if isinstance(parallel_config, ContextParallelState) else "backend"
    if name == "backend":
        return None
    if is_causal or enable_gqa:
        if name == "auto":
            return None
        raise UserError(f"parallel.attention_kernel {name} does no causal or grouped-query attention, which this "
                        "model asks for; set parallel.attention_kernel: auto or backend")  # fmt: skip
    return pick(name, query.device, query.dtype, mask is not None, query.shape[-1])
