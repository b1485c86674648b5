"""The attention kernels CP calls (train/cp/kernels.py), one process: each kernel that runs on CPU against serial
SDPA (output, LSE, dQ/dK/dV through its own backward, which takes the saved output and LSE), and which kernel `auto`
and a named kernel pick per device, dtype and mask. Their parity under CP at 2-4 ranks: test_cp_attention.py
(Ulysses) and test_cp_ring.py (ring, ring × Ulysses); on a GPU, `bench.gpu_trainer` checks the CUDA kernels against
each other.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.harness import rank_job
from train.cp.kernels import KERNELS, as_bias, pick
from train.errors import UserError

# (dtype, tolerance on out / LSE / gradients, max abs vs the fp64 reference)
DTYPES = [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 6e-2)]


def _reference(q, k, v, bias, dout):
    """fp64 SDPA on (B, H, S, D), its LSE from the scores, and its gradients."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    b = None if bias is None else bias.double()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=b)
    out.backward(dout.double())
    s = q.detach() @ k.detach().transpose(-1, -2) * q.shape[-1] ** -0.5
    lse = (s if b is None else s + b).logsumexp(-1)
    return out.detach(), lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("name", ["cpu_flash", "math"])
@pytest.mark.parametrize("dtype,tol", DTYPES, ids=[str(d).removeprefix("torch.") for d, _ in DTYPES])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_kernel_matches_sdpa(name: str, dtype: torch.dtype, tol: float, masked: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    B, H, Sq, Skv, D = 2, 3, 13, 11, 16
    # (B, S, H, D) storage seen heads-major: what the all-to-all delivers to a "bshd" kernel.
    q, k, v = (torch.randn(B, S, H, D, generator=gen, dtype=dtype).transpose(1, 2) for S in (Sq, Skv, Skv))
    dout = torch.randn(B, Sq, H, D, generator=gen, dtype=dtype).transpose(1, 2)
    keep = torch.rand(B, H, Sq, Skv, generator=gen) > 0.4
    keep[..., 0] = True
    bias = as_bias(keep, dtype) if masked else None
    kernel = KERNELS[name]
    out, lse, aux = kernel.forward(q, k, v, bias, D**-0.5)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, bias, D**-0.5, aux)
    ref = _reference(q, k, v, bias, dout)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for what, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref):
        assert got.shape == want.shape, what
        err = (got.double() - want).abs().max().item()
        assert err <= tol, f"{name} {dtype} {what}: {err:.3g} > {tol}"


def test_pick_per_device_dtype_and_mask() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # a device object only: no GPU needed to decide
    bf16, fp32, fp64 = torch.bfloat16, torch.float32, torch.float64
    assert pick("auto", cpu, fp32, masked=True).name == "cpu_flash"
    assert pick("auto", cuda, bf16, masked=False).name == "cuda_cudnn"
    assert pick("auto", cuda, bf16, masked=True).name == "cuda_efficient"  # the CUDA kernel that takes a bias
    assert pick("auto", cuda, fp32, masked=False).name == "cuda_efficient"
    assert pick("auto", cuda, fp64, masked=True).name == "math"
    assert pick("auto", cuda, bf16, masked=False, head_dim=192).name == "cuda_flash"  # cuDNN: up to 128 here
    assert pick("auto", cuda, bf16, masked=False, head_dim=36).name == "cuda_efficient"  # not a multiple of 8
    assert pick("math", cpu, bf16, masked=True).name == "math"
    with pytest.raises(UserError, match="runs on cuda only, and this rank's device is cpu; set parallel.attention"):
        pick("cuda_flash", cpu, bf16, masked=False)
    with pytest.raises(UserError, match="cuda_flash takes no attention mask"):
        pick("cuda_flash", cuda, bf16, masked=True)
    with pytest.raises(UserError, match="cuda_cudnn runs float16, bfloat16 only, and q is torch.float32"):
        pick("cuda_cudnn", cuda, fp32, masked=False)
    if KERNELS["flash_attn"].available(cuda):
        assert pick("flash_attn", cuda, bf16, masked=False).name == "flash_attn"
    else:  # the optional extra is not installed here: refused by name, never picked by auto
        with pytest.raises(UserError, match="with the flash_attn package installed"):
            pick("flash_attn", cuda, bf16, masked=False)


# -- selective activation checkpointing under CP (train.checkpoint_policy) -------------------------------------------

POLICIES = ("none", "full", "keep_attention", "keep_attention_matmul")
SAC_FAMILIES = ("wan", "flux")  # cross-attention video blocks; joint text + image attention
SAC_TOL = 2e-5  # fp32, relative (test_cp_models.py's)


class _OpCounter(TorchDispatchMode):
    """Attention-kernel and matmul ops that really run (an output selective checkpointing keeps is handed back by
    its own mode, above this one, without running the op)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = self.matmul = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.attention += name == "_scaled_dot_product_flash_attention_for_cpu"
        self.matmul += name in ("mm", "addmm", "bmm")
        return func(*args, **(kwargs or {}))


@rank_job(2, 4)
def _selective_checkpointing(rank: int, world: int) -> dict:
    """Each family's step under CP (Ulysses 2; ring 2 × Ulysses 2 on 4 ranks), blocks wrapped the way the trainer
    wraps them (train.parallel.apply_activation_levers), per policy, against the pipeline-form serial oracle."""
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import GradReduction, enable_context_parallel
    from train.parallel import apply_activation_levers, repeated_blocks
    from train.tools.oracle import compare, run_step
    from train.tools.tiny_models import build_model, family_case

    mesh = init_device_mesh("cpu", (1, 2) if world == 2 else (2, 2), mesh_dim_names=("ring", "ulysses"))
    results = {}
    for family in SAC_FAMILIES:
        inputs = family_case(family, seed=1, batch_size=2)
        serial = run_step(build_model(family, seed=0), inputs)
        for policy in POLICIES:
            model = build_model(family, seed=0)
            state = enable_context_parallel(model, mesh=mesh)
            if policy != "none":
                apply_activation_levers(repeated_blocks(model), 1, offload=False, compile=False, policy=policy,
                                        layout=state.layout)  # fmt: skip
            reduction = GradReduction("allreduce", cp_group=state.cp_group)
            with _OpCounter() as ops:
                cp = run_step(model, inputs, reduce=reduction.reduce_gradients)
            errors = compare(cp, serial)
            results[family, policy] = {"grad": errors.grad, "loss": errors.loss, "out": errors.out,
                                       "attention": ops.attention, "matmul": ops.matmul,
                                       "exchanges": state.layout.exchanges}  # fmt: skip
    return results


@pytest.mark.parametrize("world", [2, 4], ids=["ulysses2", "ring2xulysses2"])
def test_selective_checkpointing_under_cp(group, world: int) -> None:
    ranks = group(_selective_checkpointing, world)
    print(f"\n{'ring 2 x Ulysses 2' if world == 4 else 'Ulysses 2'}, rank 0: per step, attention kernels and matmuls "
          "that ran, gradient error vs the serial oracle")  # fmt: skip
    for (family, policy), r in ranks[0].items():
        counts = f"attention {r['attention']:>3}  matmul {r['matmul']:>4}"
        print(f"  {family:<5} {policy:<22} {counts}  grad {r['grad']:.1e}")
    for rank, res in enumerate(ranks):
        for family in SAC_FAMILIES:
            base = res[family, "none"]
            for policy in POLICIES:
                r, where = res[family, policy], f"rank {rank} {family} {policy}"
                assert r["grad"] <= SAC_TOL and r["loss"] <= SAC_TOL and r["out"] <= SAC_TOL, (where, r)
                # The recompute replays the forward's layout registry: no size exchange (Ulysses layers).
                assert world != 2 or r["exchanges"] == 0, (where, r)
                # What the backward recomputes, counted: full re-runs every attention kernel and matmul once more;
                # keep_attention none of the kernels; keep_attention_matmul none of the matmuls either.
                extra_attention = {"none": 0, "full": 1, "keep_attention": 0, "keep_attention_matmul": 0}[policy]
                assert r["attention"] > 0 and r["attention"] == base["attention"] * (1 + extra_attention), (where, r)
                if policy in ("none", "keep_attention_matmul"):
                    assert r["matmul"] == base["matmul"], (where, r)
                else:
                    assert r["matmul"] > base["matmul"], (where, r)
