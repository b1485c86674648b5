"""Trainable Ring-Anything attention and the hybrid ring × Ulysses-Anything attention, for uneven shapes.

diffusers 0.42.1's `TemplatedRingAnythingAttention` (uneven sequences over a ring) has a forward only and refuses
masks; `_templated_unified_attention` (ring × Ulysses) needs even splits. This module replaces both.

Ring (`RingAnythingAttention`, same `.apply` contract as diffusers' templated CP attention). Rank r of the ring group
(W ranks) keeps its queries (B, sq_r, H, D); the key/value blocks (B, skv_j, H, D), each with its slice of the key
mask, travel around the ring by send/recv (rank r sends to r+1, receives from r-1; W-1 hops, each overlapped with the
block attention on the block already here). Every block gives (out_j, lse_j); the online-softmax merge
`lse = logaddexp(lse_a, lse_b)`, `out = e^(lse_a-lse) out_a + e^(lse_b-lse) out_b` (in fp32, fp64 for fp64 inputs)
makes the global result. Backward (the FlashAttention ring backward): the blocks travel around again, and each block's
backward gets the MERGED out and LSE, so it computes its share of dQ (summed locally) and of dK/dV with the global
softmax; block j's dK/dV accumulator starts on the rank after its owner, travels with block j and, one hop after the
last contribution, arrives at its owner (who adds its own share). Per call and rank: one size exchange (a 4-int
all-gather), W-1 shifts forward, W shifts backward; K/V and dK/dV each travel W-1 hops (the ring minimum).
No block is padded: every rank knows every block's length from the size exchange.

Block attention op. The backend's own forward/backward ops (the ones diffusers passes in) are used when they return
LSE (diffusers' flash / cuDNN / native-flash ops): each block's forward returns LSE; the backward re-runs that block's
forward to fill the op's context (cum_seq, max_k, ... differ per uneven block) and calls the backward op with the
merged out/LSE overriding its saved ones, as diffusers' ring backward does. diffusers' `native` ops (the only CP
backend on CPU) return no LSE, so for them this module uses:
- on CPU, torch's CPU flash kernel `aten._scaled_dot_product_flash_attention_for_cpu` and its `_backward`: it returns
  (out, logsumexp), takes an additive `attn_mask` in the query dtype (per head, broadcast, any key length), runs fp32,
  fp64 and bf16, and its backward takes out/LSE from outside: exactly the ring's need. Out and LSE match SDPA (fp32
  ≤ 5e-7, fp64 ≤ 1e-15). One gap: a query row whose keys in a BLOCK are all masked gets LSE 0 (not -inf); the ring
  sets those rows' LSE to -inf from the mask itself before merging, so a fully padded block weighs nothing.
- elsewhere, the explicit math attention (`math_attention_forward_op` / `math_attention_backward_op`, also usable as a
  diffusers-style op pair): scores, logsumexp, softmax in fp32 (fp64), O(S_q · S_kv) memory per block.
Masks are applied as an additive bias in the query dtype (bool → 0 / -inf), which is exact.

Masks. (B, S_kv), (B, 1, Mq, Mk) or per head (B, H, Mq, Mk) — per-head masks are cheap in a ring (heads are not
split). The key dim is split like the keys (the slice travels with its block, in the same message, exact as 0/-inf
or in the payload dtype) or whole (each rank slices its blocks' columns, nothing travels). The query dim is 1,
whole (each rank keeps its own rows) or split like the queries (already local) — but not split on both dims
(a rank would need mask entries that only another rank holds): refused with an error on every rank alike.

Hybrid (`ring_ulysses_attention`, `_templated_unified_attention`'s signature). diffusers' mesh ("ring", "ulysses")
numbers rank = ring_index · U + ulysses_index: Ulysses groups are consecutive ranks (one node), ring groups stride
across them. The sequence is split over all R·U ranks in that order, so Ulysses group i holds a contiguous stretch.
Step 1, Ulysses-Anything inside the group (ulysses.py's all-to-all): (B, s_r, H, D) → (B, S_i, h_u, D), uneven
sequences and uneven heads (tensor_split sizes, h_u may be 0), the key mask riding along. Step 2, the ring above over
the R groups' stretches, on h_u heads (every rank of a ring group has the same Ulysses index, hence the same heads:
with h_u = 0 the whole ring group skips it, no collective). Step 3, the inverse all-to-all. Each step is its own
autograd node; the gradients flow back through them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from train.errors import UserError

from .a2a import HeadsToSeq, SeqToHeads, attention_kernel, heads_to_seq, model_state, offsets, own_heads
from .comm import TorchTransport, exchange_ints
from .kernels import KERNELS, Kernel
from .kernels import acc_dtype as _acc_dtype
from .kernels import as_bias as _bias
from .masks import normalise_mask, place_mask

__all__ = ["RingAnythingAttention", "math_attention_backward_op", "math_attention_forward_op", "ring_ulysses_attention"]


def _math_forward(q, k, v, bias, scale):
    """(B, Sq, H, D) × (B, Skv, H, D) → out (B, Sq, H, Dv) in q's dtype, lse (B, Sq, H) in the accumulation dtype."""
    out, lse, _ = KERNELS["math"].forward(*(t.transpose(1, 2) for t in (q, k, v)), bias, scale)
    return out.transpose(1, 2), lse.transpose(1, 2)


def _math_backward(dout, q, k, v, out, lse, bias, scale):
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    return tuple(g.transpose(1, 2) for g in KERNELS["math"].backward(t(dout), t(q), t(k), t(v), t(out), t(lse), bias,
                                                                      scale, ()))  # fmt: skip


def math_attention_forward_op(
    ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
    return_lse=False, _save_ctx=True, _parallel_config=None,
):  # fmt: skip
    """A diffusers-style forward op (model layout (B, S, H, D)) that returns LSE: explicit math, any device/dtype."""
    if dropout_p or is_causal or enable_gqa:
        raise ValueError("the math attention op supports no dropout, causal masking or GQA")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out, lse = _math_forward(query, key, value, _bias(attn_mask, query.dtype), scale)
    if _save_ctx:
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.attn_mask, ctx.scale = attn_mask, scale
    return (out, lse) if return_lse else out


def math_attention_backward_op(ctx, grad_out, *args, query=None, key=None, value=None, out=None, lse=None, **kwargs):
    """The matching backward op; like diffusers' LSE ops, the ring overrides query/key/value/out/lse."""
    sq, sk, sv, so, sl = ctx.saved_tensors
    pick = lambda a, b: b if a is None else a  # noqa: E731
    q, k, v, o, l_ = pick(query, sq), pick(key, sk), pick(value, sv), pick(out, so), pick(lse, sl)
    return _math_backward(grad_out, q, k, v, o, l_, _bias(ctx.attn_mask, q.dtype), ctx.scale)


# -- block attention: which op --------------------------------------------------------------------------------------


class _OpCtx:
    """A stand-in for an autograd ctx: what diffusers' forward ops store for their backward ops."""

    saved_tensors: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


class _KernelOps:
    """A kernel of kernels.py on the ring's (B, S, H, D) blocks, through transposed views (no copy for its
    "bshd" kernels; cuDNN's wrapper copies to heads-major). Each block's forward returns its kernel context (RNG
    state, sequence offsets: a few scalars), which the ring keeps for that block's backward."""

    def __init__(self, kernel: Kernel, scale: float) -> None:
        self.kernel, self.scale = kernel, scale

    def forward(self, q, k, v, bias):
        out, lse, aux = self.kernel.forward(*(t.transpose(1, 2) for t in (q, k, v)), bias, self.scale)
        return out.transpose(1, 2), lse.transpose(1, 2), aux

    def backward(self, dout, q, k, v, out, lse, bias, aux):
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        grads = self.kernel.backward(t(dout), t(q), t(k), t(v), t(out), t(lse).contiguous(), bias, self.scale, aux)
        return tuple(g.transpose(1, 2) for g in grads)


class _BackendOps:
    """The backend's own LSE-returning op pair (diffusers' flash, cuDNN, native-flash ops, or the math pair)."""

    def __init__(self, forward_op, backward_op, scale: float, parallel_config) -> None:
        self.fwd, self.bwd, self.scale, self.pc = forward_op, backward_op, scale, parallel_config

    def _run(self, ctx, q, k, v, bias, save: bool):
        out, lse, *_ = self.fwd(
            ctx, q, k, v, bias, 0.0, False, self.scale, False, True, _save_ctx=save, _parallel_config=self.pc
        )
        return out, lse.squeeze(-1) if lse.dim() == 4 else lse

    def forward(self, q, k, v, bias):
        return (*self._run(_OpCtx(), q, k, v, bias, save=False), None)

    def backward(self, dout, q, k, v, out, lse, bias, aux):
        # The op's context (sequence lengths, RNG state) belongs to one block: re-run this block's forward to fill it.
        ctx = _OpCtx()
        self._run(ctx, q, k, v, bias, save=True)
        dq, dk, dv, *_ = self.bwd(ctx, dout, query=q, key=k, value=v, out=out, lse=lse)
        return dq, dk, dv


def _block_ops(forward_op, backward_op, scale: float, parallel_config, query: torch.Tensor, bias):
    """The model's CP kernel (kernels.py); with "backend", the backend's LSE op pair, except diffusers' `native` pair,
    which returns no LSE: torch's CPU flash kernel on CPU, the math kernel elsewhere."""
    from diffusers.models import attention_dispatch

    kernel = attention_kernel(parallel_config, query, bias, False, False)
    if kernel is None and forward_op is attention_dispatch._native_attention_forward_op:
        kernel = KERNELS["cpu_flash" if query.device.type == "cpu" else "math"]
    if kernel is None:
        return _BackendOps(forward_op, backward_op, scale, parallel_config)
    return _KernelOps(kernel, scale)


# -- the ring -------------------------------------------------------------------------------------------------------


def _shift(sends: list[torch.Tensor], recvs: list[torch.Tensor], group, transport: TorchTransport, site: str):
    """Send `sends` to the next rank of the ring and receive `recvs` from the previous one; returns the works.

    Counted in `transport.stats` as one call per shift (its bytes: what leaves this rank)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (rank + 1) % world), dist.get_global_rank(group, (rank - 1) % world)
    transport.stats.record(site, sum(t.numel() * t.element_size() for t in sends))
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recvs]
    return dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


@dataclass(frozen=True)
class _RingLayout:
    """What both passes need, identical on every rank of the ring (built from exchanged sizes only)."""

    rank: int
    world: int
    q_sizes: tuple[int, ...]
    kv_sizes: tuple[int, ...]
    mask: str  # "none", "travel" (key dim split like the keys), "whole" (global key dim)
    rows: str  # the mask's query dim: "one" (broadcast), "local" (this rank's queries), "global" (all queries)

    def block(self, t: int) -> int:
        """The block on this rank at step t."""
        return (self.rank - t) % self.world


def _ring_layout(query, key, bias, group, transport) -> _RingLayout:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mq, mk = (-1, -1) if bias is None else (bias.shape[2], bias.shape[3])
    rows = exchange_ints([query.shape[1], key.shape[1], mq, mk], query.device, group, "ring_sizes", transport)
    q_sizes, kv_sizes = tuple(r[0] for r in rows), tuple(r[1] for r in rows)
    mqs, mks = [r[2] for r in rows], [r[3] for r in rows]
    if bias is None:
        return _RingLayout(rank, world, q_sizes, kv_sizes, "none", "one")
    s_q, s_kv = sum(q_sizes), sum(kv_sizes)
    if world > 1 and mks == list(kv_sizes):
        mask = "travel"
    elif all(n == s_kv for n in mks):
        mask = "whole"
    else:
        raise ValueError(
            f"attention mask key length per ring rank {mks} matches neither the local key lengths {list(kv_sizes)} "
            f"nor the global key length {s_kv}"
        )
    if all(n == 1 for n in mqs):
        rows_kind = "one"
    elif all(n == s_q for n in mqs):
        rows_kind = "global"
    elif mqs == list(q_sizes):
        rows_kind = "local"
    else:
        raise ValueError(
            f"attention mask query length per ring rank {mqs} matches neither 1, the local query lengths "
            f"{list(q_sizes)} nor the global query length {s_q}"
        )
    if mask == "travel" and rows_kind == "local":
        raise ValueError(
            "ring attention cannot use a mask split along both queries and keys: each rank would need the mask "
            "entries of its queries against other ranks' keys, which only those ranks hold. Pass the mask whole "
            "along one of the two dims."
        )
    return _RingLayout(rank, world, q_sizes, kv_sizes, mask, rows_kind)


class _Ring:
    """One ring attention call: the forward and the backward passes (see the module docstring)."""

    def __init__(self, lay: _RingLayout, ops, group, transport: TorchTransport) -> None:
        self.lay, self.ops, self.group, self.transport = lay, ops, group, transport

    # A block on the move: key, value, and (mode "travel") the key mask slice, packed in one payload-dtype buffer.
    def _pack(self, k, v, bias_piece, extra=()) -> torch.Tensor:
        parts = [k.reshape(-1), v.reshape(-1)]
        if bias_piece is not None and self.lay.mask == "travel":
            parts.append(bias_piece.reshape(-1))
        return torch.cat(parts + [e.reshape(-1).to(k.dtype) for e in extra])

    def _block_numel(self, j: int, k, v, bias) -> tuple[int, int, int]:
        B, _, H, D = k.shape
        n = self.lay.kv_sizes[j]
        m = bias.shape[0] * bias.shape[1] * bias.shape[2] * n if self.lay.mask == "travel" else 0
        return B * n * H * D, B * n * H * v.shape[-1], m

    def _unpack(self, buf, j: int, k, v, bias):
        B, _, H, _ = k.shape
        n = self.lay.kv_sizes[j]
        nk, nv, nm = self._block_numel(j, k, v, bias)
        kj = buf[:nk].view(B, n, H, k.shape[-1])
        vj = buf[nk : nk + nv].view(B, n, H, v.shape[-1])
        mj = buf[nk + nv : nk + nv + nm].view(*bias.shape[:3], n) if nm else None
        return kj, vj, mj, buf[nk + nv + nm :]

    def _block_bias(self, bias, travelled, j: int):
        """The bias of this rank's queries against block j's keys."""
        lay = self.lay
        if lay.mask == "none":
            return None
        if lay.mask == "travel":
            b = travelled
        else:
            b = bias.narrow(3, offsets(list(lay.kv_sizes))[j], lay.kv_sizes[j])
        if lay.rows == "global":
            b = b.narrow(2, offsets(list(lay.q_sizes))[lay.rank], lay.q_sizes[lay.rank])
        return b.contiguous()

    @staticmethod
    def _dead_rows(b) -> torch.Tensor | None:
        """(Bm, Sq|1, Hm) rows whose keys in this block are all masked (their LSE must be -inf), or None."""
        if b is None:
            return None
        dead = torch.isneginf(b).all(-1)
        return dead.transpose(1, 2) if dead.any() else None

    def forward(self, q, k, v, bias):
        lay = self.lay
        acc = _acc_dtype(q.dtype)
        own_piece = bias if lay.mask == "travel" else None
        buf = self._pack(k, v, own_piece) if lay.world > 1 else None
        kj, vj, mj = k, v, own_piece
        out = lse = None
        self.aux = []  # each block's kernel context, for its backward
        for t in range(lay.world):
            j = lay.block(t)
            works = None
            if t < lay.world - 1:  # the next block is in flight while this one is computed
                nxt = sum(self._block_numel(lay.block(t + 1), k, v, bias))
                recv = buf.new_empty(nxt)
                works = _shift([buf], [recv], self.group, self.transport, "ring_kv")
            b = self._block_bias(bias, mj, j)
            o, s, aux = self.ops.forward(q, kj, vj, b)
            self.aux.append(aux)
            o, s = o.to(acc), s.to(acc)
            dead = self._dead_rows(b)
            if dead is not None:
                s = s.masked_fill(dead, float("-inf"))
                o = o.masked_fill(dead[..., None], 0.0)
            out, lse = (o, s) if out is None else _merge(out, lse, o, s)
            if works is not None:
                _wait(works)
                buf = recv
                kj, vj, mj, _ = self._unpack(buf, lay.block(t + 1), k, v, bias)
        return out, lse

    def backward(self, dout, q, k, v, bias, out, lse):
        """dQ of this rank's queries, dK/dV of this rank's own block. `out`/`lse`: the merged forward results.

        Block j's dK/dV accumulator starts on the rank after its owner (the owner keeps its own share) and travels
        with the block; one hop after the last contribution it reaches the owner: W - 1 hops of K/V and W - 1 of
        dK/dV, the ring minimum (the first shift carries the block alone, the last the accumulator alone)."""
        lay = self.lay
        acc = _acc_dtype(q.dtype)
        B, _, H, _ = k.shape
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        own = carried = None  # this rank's share of its own block's dK/dV; the accumulator of the block now here
        kj, vj, mj = k, v, bias if lay.mask == "travel" else None
        for t in range(lay.world):
            b = self._block_bias(bias, mj, lay.block(t))
            gq, gk, gv = self.ops.backward(dout, q, kj, vj, out, lse, b, self.aux[t])
            dq += gq
            grads = torch.cat([gk.reshape(-1), gv.reshape(-1)]).to(acc)
            if t == 0:
                own = grads
            else:
                carried = grads if carried is None else carried + grads
            if lay.world == 1:
                break
            nxt = lay.block(t + 1)
            nk, nv, nm = self._block_numel(nxt, k, v, bias)
            send, recv = [], []
            if t < lay.world - 1:  # the block moves on
                send.append(self._pack(kj, vj, mj))
                recv.append(send[0].new_empty(nk + nv + nm))
            if t > 0:  # its accumulator too (the block that arrives next has one unless it is the first hop)
                send.append(carried)
                recv.append(carried.new_empty(nk + nv))
            site = "ring_kv_bwd" if t == 0 else "ring_kv_grad" if t < lay.world - 1 else "ring_grad"
            _wait(_shift(send, recv, self.group, self.transport, site))
            if t < lay.world - 1:
                kj, vj, mj, _ = self._unpack(recv[0], nxt, k, v, bias)
            carried = recv[-1] if t > 0 else None
        if carried is not None:  # the other ranks' shares of this rank's block, home after the last hop
            own = own + carried
        nk = B * lay.kv_sizes[lay.rank] * H * k.shape[-1]
        dk, dv = own[:nk].view(k.shape), own[nk:].view(v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _merge(out_a, lse_a, out_b, lse_b):
    """Online-softmax merge of two partial attentions over disjoint key sets (rows with no key stay -inf / 0)."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isneginf(lse), 0.0, lse)
    return out_a * torch.exp(lse_a - ref)[..., None] + out_b * torch.exp(lse_b - ref)[..., None], lse


def _check_args(query, key, value, dropout_p, is_causal, enable_gqa) -> None:
    """User errors, raised before the first collective, so every rank fails alike and none hangs."""
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if training and dropout_p > 0:
        raise UserError(
            f"attention dropout {dropout_p} is not supported when training under ring CP: the backward recomputes "
            "attention block by block and would draw different dropout masks. Set attention dropout to 0."
        )
    if is_causal:
        raise ValueError("causal attention is not supported by ring CP (the models it serves attend bidirectionally)")
    if enable_gqa:
        raise ValueError("grouped-query attention is not supported by ring CP")


class RingAnythingAttention(torch.autograd.Function):
    """Trainable drop-in for diffusers' `TemplatedRingAnythingAttention` / `TemplatedRingAttention` (same `.apply`
    args): uneven sequence lengths, any head count, key-padding and per-head masks, forward and backward."""

    @classmethod
    @torch.compiler.disable  # P2P and the backend op run eagerly under a compiled block
    def apply(cls, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *args, **kw):
        _check_args(query, key, value, dropout_p, is_causal, enable_gqa)
        parallel_config = args[2] if len(args) > 2 else kw.get("_parallel_config")
        attn_mask = place_mask(normalise_mask(attn_mask, query.shape[2]), key.shape[1], parallel_config)
        return cls.placed(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *args)

    @classmethod
    @torch.compiler.disable
    def placed(cls, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *args):
        """`apply` for a normalised mask already in rank order (the hybrid places it for the whole CP group)."""
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
        group = _parallel_config.context_parallel_config._ring_mesh.get_group()
        _, transport = model_state(_parallel_config)
        ctx.empty = query.shape[2] == 0
        if ctx.empty:  # a hybrid's Ulysses group with no heads: every rank of this ring group has none; no collective
            ctx.shapes = (query.shape, key.shape, value.shape)
            out = query.new_empty((*query.shape[:-1], value.shape[-1]))
            return (out, query.new_empty(query.shape[:-1], dtype=torch.float32)) if return_lse else out
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        bias = _bias(attn_mask, query.dtype)
        lay = _ring_layout(query, key, bias, group, transport)
        ops = _block_ops(forward_op, backward_op, scale, _parallel_config, query, bias)
        ring = _Ring(lay, ops, group, transport)
        q, k, v = (t.contiguous() for t in (query, key, value))
        out, lse = ring.forward(q, k, v, bias)
        out = out.to(query.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, bias, out, lse)
        if not return_lse:
            return out
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, *_grad_lse):
        none = (None,) * 9
        if ctx.empty:
            qs, ks, vs = ctx.shapes
            return (grad_out.new_zeros(qs), grad_out.new_zeros(ks), grad_out.new_zeros(vs), *none)
        q, k, v, bias, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.ring.backward(grad_out.contiguous(), q, k, v, bias, out, lse)
        return (dq, dk, dv, *none)


# -- hybrid: Ulysses inside the "ulysses" mesh dim, ring over the "ring" dim ----------------------------------------


@torch.compiler.disable
def ring_ulysses_attention(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op, backward_op,
    _parallel_config=None, scatter_idx: int = 2, gather_idx: int = 1,
):  # fmt: skip
    """Hybrid ring × Ulysses-Anything attention, a drop-in for diffusers' `_templated_unified_attention` (same args;
    `scatter_idx` / `gather_idx` are diffusers' fixed (2, 1): heads scatter, sequence gathers)."""
    _check_args(query, key, value, dropout_p, is_causal, enable_gqa)
    attn_mask = place_mask(normalise_mask(attn_mask, query.shape[2]), key.shape[1], _parallel_config)
    cp = _parallel_config.context_parallel_config
    group = cp._ulysses_mesh.get_group()
    _, transport = model_state(_parallel_config)
    # A mask whose key dim is split like the keys rides in the Ulysses all-to-all and reaches the ring split like its
    # blocks. A mask with the GLOBAL key dim (whole on every rank) skips the all-to-all: the ring slices its columns
    # per block and its rows per stretch itself; only its heads are cut here, to this rank's Ulysses heads.
    whole = attn_mask is not None and attn_mask.shape[-1] != key.shape[-3]
    held: dict = {}
    q, k, v = SeqToHeads.apply(query, key, value, None if whole else attn_mask, group, None, transport, held)
    mask = held["mask"]
    if whole:
        mask = own_heads(attn_mask, held["layout"], dist.get_rank(group))
    out = RingAnythingAttention.placed(
        q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op, backward_op,
        _parallel_config,
    )  # fmt: skip
    lay = held["layout"]
    if not return_lse:
        return HeadsToSeq.apply(out, lay, group, transport)
    out, lse = out
    with torch.no_grad():
        (lse,) = heads_to_seq([lse.unsqueeze(-1).contiguous()], [lay.q_sizes], lay, group, transport, "lse")
    return HeadsToSeq.apply(out, lay, group, transport), lse.squeeze(-1)
