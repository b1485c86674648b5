"""fp8 frozen base weights under LoRA (`finetune.fp8_base`): the transformer blocks' linear weights stored in float8.

Every `nn.Linear` inside the transformer blocks (attention projections, FFN, modulation: the bulk of the weights; the
embedders, norms and output projection outside the blocks stay in the model's dtype) becomes an `Fp8Linear`:

- its weight as float8 e4m3 codes, one per element, with one scale per output channel (row). The scale is a power of
  two (the smallest with |w| / scale ≤ 448, e4m3's largest value, for the whole row), so the division is exact, the
  row's largest value lands in [224, 448], and the scale survives any cast (FSDP2 casts floating parameters to
  `param_dtype` when it gathers them). An element keeps 4 significant bits: relative error ≤ 2^-4 (half an ulp)
  above e4m3's normal range; below it, absolute ≤ 2^-10 × scale.
- the codes are held as a uint8 parameter (their bit pattern): FSDP2 shards, gathers and reshards them as bytes
  (its mixed-precision cast skips non-floating parameters, so the gather moves one byte per weight, not two), gloo and
  DCP handle them, and nothing else in the stack needs float8 kernels.
- its forward upcasts the codes to the compute dtype (autocast's, else the input's) one matmul at a time, and its
  backward does it again: only the codes (the parameter itself) are saved for backward, never an upcast copy. The
  input gradient is the plain linear's in that dtype; the frozen weight has none.

The rows are FSDP2's dim-0 shards, so a rank quantizes the rows it holds with nothing from its peers: the sharded start
(train/modeling.py) reads each rank's bf16 slice of the pretrained safetensors one block at a time and quantizes it in
place. Frozen weights only: LoRA adapters (added after this, around these modules) train in fp32 or bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as uint8, per-row fp32 power-of-two scales) of a 2-D weight."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    # amax / 448 = m · 2^e with m in [0.5, 1): 2^e is the smallest power of two that scales the row into range
    _, exponent = torch.frexp(amax / E4M3_MAX)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), exponent), torch.ones_like(amax))
    codes = (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)  # clamp: a no-op, kept as a guard
    return codes.view(torch.uint8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight the codes stand for, in `dtype` (exact in bf16/fp32: 4 significant bits times a power of two)."""
    return codes.view(E4M3).to(dtype) * scale.to(dtype)[:, None]


class _Fp8Matmul(torch.autograd.Function):
    """y = x Wᵀ + b with W upcast from its codes in forward and again in backward (nothing upcast is saved)."""

    @staticmethod
    def forward(ctx, x, codes, scale, bias, dtype):  # noqa: ANN001 (autograd.Function signature)
        ctx.save_for_backward(codes, scale)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        bias = None if bias is None else bias.to(dtype)
        return F.linear(x.to(dtype), dequantize(codes, scale, dtype), bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        codes, scale = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad.to(ctx.dtype) @ dequantize(codes, scale, ctx.dtype)).to(ctx.x_dtype)
        return grad_x, None, None, None, None


class Fp8Linear(torch.nn.Linear):
    """A frozen linear layer whose weight is float8 codes (uint8 parameter `weight`) with per-row scales
    (`weight_scale`). A `torch.nn.Linear` subclass, so peft wraps it with LoRA like any linear layer; `weight` keeps
    the checkpoint's name (the sharded start maps the pretrained tensor onto it)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        torch.nn.Module.__init__(self)
        self.out_features, self.in_features = codes.shape
        self.weight = torch.nn.Parameter(codes, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Fp8Linear:
        """Quantized from `linear`'s weight; on the meta device, the same shapes, no values."""
        w = linear.weight
        if w.is_meta:
            codes = torch.empty(w.shape, dtype=torch.uint8, device="meta")
            scale = torch.empty(w.shape[0], dtype=torch.float32, device="meta")
        else:
            codes, scale = quantize(w)
        return cls(codes, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        return _Fp8Matmul.apply(x, self.weight, self.weight_scale, self.bias, dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight these codes stand for (this rank's rows under FSDP2)."""
        codes, scale = self.weight, self.weight_scale
        codes, scale = (t.to_local() if hasattr(t, "to_local") else t for t in (codes, scale))
        return dequantize(codes, scale, dtype)

    # DoRA (finetune.dora) divides by the row norms of the base weight, which peft reads through
    # `dequantize_module_weight(base_layer)`: a layer with `W_q` (its name for quantized codes) is asked to
    # `dequantize()`. Under FSDP2 this runs inside the forward, on the gathered (whole) codes and scales. The norm is
    # detached in peft's DoRA, so the input gradient stays `_Fp8Matmul`'s exact one.
    @property
    def W_q(self) -> torch.Tensor:  # noqa: N802 (peft's attribute name)
        """The codes, under the name peft's `dequantize_module_weight` looks for."""
        return self.weight

    def dequantize(self) -> torch.Tensor:
        """The weight in fp32, for peft (DoRA's weight norm)."""
        return self.dequantized(torch.float32)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8 e4m3 + per-row scale"


def convert(blocks: list[torch.nn.Module]) -> int:
    """Replace every frozen `nn.Linear` inside `blocks` by an `Fp8Linear` (quantized, or meta on a meta model);
    returns how many. Before LoRA is added: peft then wraps these."""
    n = 0
    for block in blocks:
        targets = [(name, m) for name, m in block.named_modules() if type(m) is torch.nn.Linear]
        for name, linear in targets:
            parent, _, attr = name.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, attr, Fp8Linear.from_linear(linear))
            n += 1
    return n


def modules(model: torch.nn.Module) -> dict[str, Fp8Linear]:
    """The model's `Fp8Linear` layers by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def quantize_state(state: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """A whole state dict with the weights of the `Fp8Linear`s named `names` (their module names) replaced by codes
    and `weight_scale` entries added (rank 0's random init, broadcast to the shards)."""
    out = dict(state)
    for name in names:
        if f"{name}.weight" in out and out[f"{name}.weight"].is_floating_point():
            out[f"{name}.weight"], out[f"{name}.weight_scale"] = quantize(out[f"{name}.weight"])
    return out
