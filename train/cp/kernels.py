"""Attention kernels the CP paths call directly, each a forward that returns (out, LSE) and a backward that takes them.

Why not diffusers' op pairs: its `native` pair (the default backend, the only one on CPU) saves Q/K/V and re-runs
the whole attention forward inside its backward; its `_native_flash` / `_native_cudnn` pairs copy every tensor to
(B, H, S, D) and back around the kernel in both passes. Here the Ulysses all-to-all writes Q/K/V straight into the
storage the kernel reads (`Kernel.storage`), the output goes back from the storage the kernel wrote, and the backward
gets the saved output and LSE: one kernel call per pass, no layout copy around it.

Every kernel takes and returns logical heads-major tensors: q (B, H, Sq, D), k/v (B, H, Skv, D), an additive bias
broadcastable to (B, H, Sq, Skv) in q's dtype or None; out (B, H, Sq, Dv) and lse (B, H, Sq) in fp32 (fp64 for
fp64). `storage` is the memory order the kernel reads and writes without copying: "bshd" kernels (torch's CPU flash,
FlashAttention, torch's CUDA flash and memory-efficient kernels) get (B, S, H, D) storage seen through a transposed
view; "bhsd" kernels (cuDNN) get contiguous heads-major tensors. A fully masked query row gets out 0; its LSE is
whatever the kernel returns (the ring masks those rows itself).

`auto` picks, for the device, dtype and whether the call has a mask, the first available of `AUTO_ORDER`. The CUDA
order is the one expected for Hopper at bf16 (cuDNN, then FlashAttention 2 when installed, then torch's flash, then
the memory-efficient kernel, the only one of them that takes a bias); `bench.gpu_trainer` times each on the device.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from train.errors import UserError

__all__ = ["AUTO_ORDER", "KERNELS", "NAMES", "Kernel", "acc_dtype", "as_bias", "check", "pick"]

HALF = (torch.float16, torch.bfloat16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A mask as an additive bias in the query dtype: bool keep-masks → 0 / -inf (exact), additive masks cast."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


@dataclass(frozen=True)
class Kernel:
    name: str
    device: str  # "cpu", "cuda" or "any"
    storage: str  # "bshd" or "bhsd": the memory order the all-to-all writes for it
    masks: bool  # takes an additive bias
    dtypes: tuple[torch.dtype, ...] | None  # None: any floating dtype
    forward: Callable  # (q, k, v, bias, scale) -> (out, lse, aux)
    backward: Callable  # (dout, q, k, v, out, lse, bias, scale, aux) -> (dq, dk, dv)
    needs: str | None = None  # an optional package it calls
    head_dims: int = 0  # > 0: the head dim must be a multiple of 8 up to this (the fused CUDA kernels' limit)

    def available(self, device: torch.device) -> bool:
        if self.device not in ("any", device.type):
            return False
        return self.needs is None or importlib.util.find_spec(self.needs) is not None

    def refuses(self, device: torch.device, dtype: torch.dtype, masked: bool, head_dim: int = 64) -> str | None:
        """Why this kernel cannot run a call (None when it can)."""
        if not self.available(device):
            need = f" with the {self.needs} package installed" if self.needs else ""
            return f"runs on {self.device}{need} only, and this rank's device is {device.type}"
        if self.dtypes is not None and dtype not in self.dtypes:
            return f"runs {', '.join(str(d).removeprefix('torch.') for d in self.dtypes)} only, and q is {dtype}"
        if masked and not self.masks:
            return "takes no attention mask, and this model passes one (padded text or a joint mask)"
        if self.head_dims and (head_dim % 8 or head_dim > self.head_dims):
            return f"takes head dims that are multiples of 8 up to {self.head_dims}, and this model's is {head_dim}"
        return None


# -- math: explicit, any device and dtype, O(Sq · Skv) memory; the reference and the last resort ----------------------


def _math_forward(q, k, v, bias, scale):
    acc = acc_dtype(q.dtype)
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), k.to(acc)) * scale
    if bias is not None:
        s = s + bias.to(acc)
    lse = s.logsumexp(-1)  # -inf where every key is masked
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return torch.einsum("bhqk,bhkd->bhqd", p, v.to(acc)).to(q.dtype), lse, ()


def _math_backward(dout, q, k, v, out, lse, bias, scale, aux=()):
    """P = exp(S - LSE), D = rowsum(dO · O): the attention backward given the (merged) out and LSE."""
    acc = acc_dtype(q.dtype)
    q_, k_, v_, do = (t.to(acc) for t in (q, k, v, dout))
    s = torch.einsum("bhqd,bhkd->bhqk", q_, k_) * scale
    if bias is not None:
        s = s + bias.to(acc)
    p = torch.exp(s - lse.to(acc)[..., None])
    dv = torch.einsum("bhqk,bhqd->bhkd", p, do)
    dp = torch.einsum("bhqd,bhkd->bhqk", do, v_)
    ds = p * (dp - (do * out.to(acc)).sum(-1)[..., None])
    dq = torch.einsum("bhqk,bhkd->bhqd", ds, k_) * scale
    dk = torch.einsum("bhqk,bhqd->bhkd", ds, q_) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# -- torch's CPU flash kernel: (B, S, H, D) storage, strided inputs, additive bias, fp32/fp64/bf16/fp16 -------------


def _cpu_flash_forward(q, k, v, bias, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                          scale=scale)  # fmt: skip
    return out, lse, ()


def _cpu_flash_backward(dout, q, k, v, out, lse, bias, scale, aux=()):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale
    )


# -- CUDA: torch's flash (FlashAttention 2 inside), memory-efficient and cuDNN kernels ------------------------------


def _cuda_flash_forward(q, k, v, bias, scale):
    out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, False, False, scale=scale
    )
    return out, lse, (cq, ck, mq, mk, seed, offset)


def _cuda_flash_backward(dout, q, k, v, out, lse, bias, scale, aux):
    cq, ck, mq, mk, seed, offset = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), cq, ck, mq, mk, 0.0, False, seed, offset, scale=scale
    )


def _aligned_bias(bias, q, k):
    """The memory-efficient kernel reads the bias with its last dim's stride a multiple of 16 elements (what SDPA
    pads to): a padded allocation seen through a view of the true length, broadcast to (B, H, Sq, Skv)."""
    if bias is None:
        return None
    n = bias.shape[-1]
    if n % 16:
        bias = F.pad(bias, (0, 16 - n % 16))[..., :n]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _cuda_efficient_forward(q, k, v, bias, scale):
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _aligned_bias(bias, q, k), True, 0.0, False, scale=scale
    )
    return out, lse[..., : q.shape[2]], (seed, offset, lse.shape[-1])  # its LSE is padded to a multiple of 32 rows


def _cuda_efficient_backward(dout, q, k, v, out, lse, bias, scale, aux):
    seed, offset, rows = aux
    lse = F.pad(lse.float(), (0, rows - lse.shape[-1])).contiguous()
    bias = _aligned_bias(bias, q, k)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], False, scale=scale
    )
    return dq, dk, dv


def _cudnn_forward(q, k, v, bias, scale):
    q, k, v = (t.contiguous() for t in (q, k, v))  # cuDNN gets heads-major storage (no copy from our all-to-all)
    out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, False, False, scale=scale
    )
    trailing = lse.dim() == 4  # (B, H, S, 1) on newer torch
    return out, lse.squeeze(-1) if trailing else lse, (cq, ck, mq, mk, seed, offset, trailing)


def _cudnn_backward(dout, q, k, v, out, lse, bias, scale, aux):
    cq, ck, mq, mk, seed, offset, trailing = aux
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    lse = lse.float().contiguous()
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1) if trailing else lse, seed, offset, None, cq, ck, mq, mk, 0.0, False,
        scale=scale,
    )  # fmt: skip


# -- FlashAttention 2 (the flash-attn package, an optional extra), through diffusers' own op pair --------------------


class _Ctx:
    """What diffusers' flash-attn backward op reads from its autograd ctx."""

    def __init__(self, saved: tuple, scale: float) -> None:
        self.saved_tensors, self.scale = saved, scale
        self.dropout_p, self.is_causal, self.window_size, self.softcap = 0.0, False, (-1, -1), 0.0
        self.alibi_slopes, self.deterministic = None, False

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def _fa2_forward(q, k, v, bias, scale):
    from diffusers.models.attention_dispatch import _flash_attention_forward_op

    ctx = _Ctx((), scale)
    out, lse = _flash_attention_forward_op(ctx, *(t.transpose(1, 2) for t in (q, k, v)), scale=scale,
                                           return_lse=True)  # fmt: skip
    return out.transpose(1, 2), lse.transpose(1, 2), (ctx.saved_tensors[-1],)  # keep the RNG state only


def _fa2_backward(dout, q, k, v, out, lse, bias, scale, aux):
    from diffusers.models.attention_dispatch import _flash_attention_backward_op

    t = lambda x: x.transpose(1, 2)  # noqa: E731
    ctx = _Ctx((t(q), t(k), t(v), t(out), t(lse), *aux), scale)
    grads = _flash_attention_backward_op(ctx, t(dout).contiguous())
    return tuple(g.transpose(1, 2) for g in grads)


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("cpu_flash", "cpu", "bshd", True, None, _cpu_flash_forward, _cpu_flash_backward),
        Kernel("cuda_cudnn", "cuda", "bhsd", False, HALF, _cudnn_forward, _cudnn_backward, head_dims=128),
        Kernel("flash_attn", "cuda", "bshd", False, HALF, _fa2_forward, _fa2_backward, "flash_attn", 256),
        Kernel("cuda_flash", "cuda", "bshd", False, HALF, _cuda_flash_forward, _cuda_flash_backward, head_dims=256),
        Kernel(
            "cuda_efficient",
            "cuda",
            "bshd",
            True,
            (*HALF, torch.float32),
            _cuda_efficient_forward,
            _cuda_efficient_backward,
        ),  # fmt: skip
        Kernel("math", "any", "bshd", True, None, _math_forward, _math_backward),
    )
}
AUTO_ORDER = ("cpu_flash", "cuda_cudnn", "flash_attn", "cuda_flash", "cuda_efficient", "math")
NAMES = ("auto", "backend", *KERNELS)  # backend: the op pair of the model's diffusers attention backend


def pick(name: str, device: torch.device, dtype: torch.dtype, masked: bool, head_dim: int = 64) -> Kernel:
    """The kernel for one call: `name`, or with "auto" the first of AUTO_ORDER that can run it. A named kernel that
    cannot is a user error (the same on every rank: device type, dtype, mask presence and head dim agree across a
    CP group)."""
    if name == "auto":
        return next(k for k in map(KERNELS.get, AUTO_ORDER) if k.refuses(device, dtype, masked, head_dim) is None)
    kernel = KERNELS[name]
    why = kernel.refuses(device, dtype, masked, head_dim)
    if why is not None:
        raise UserError(f"parallel.attention_kernel {name} {why}; set parallel.attention_kernel: auto")
    return kernel


def check(name: str, device: torch.device) -> None:
    """At startup, before any collective: `name` is a kernel choice, and a named kernel runs on this device (dtype
    and mask are checked per call, also before any collective)."""
    if name not in NAMES:
        raise ValueError(f"unknown attention kernel {name!r}; one of {', '.join(NAMES)}")
    kernel = KERNELS.get(name)
    if kernel is not None and not kernel.available(device):
        raise UserError(f"parallel.attention_kernel {name} {kernel.refuses(device, None, False)}; set "
                        "parallel.attention_kernel: auto")  # fmt: skip
