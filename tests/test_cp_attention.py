"""Op-level parity: trainable Ulysses-Anything attention on 2, 3 and 4 gloo ranks vs single-process SDPA.

Each spawned group loops over every case (spawning costs ~10 s, a case costs milliseconds). Every case compares the
CP output and dQ/dK/dV with the serial result: within 1e-6 abs in fp32 and 1e-12 in fp64, through each attention
kernel that runs on CPU (`parallel.attention_kernel`: auto = torch's CPU flash kernel, math, and the backend's own
op pair); a kernel's backward runs no forward (counted).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.harness import rank_job
from train.cp.layout import split_sizes

TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
# parallel.attention_kernel values that run on CPU (auto: torch's CPU flash kernel), and "heads_major": the CPU flash
# kernel registered with heads-major storage in the spawned ranks (as cuDNN is), so the all-to-all assembles
# (B, h, S, D) for it, and it checks that it gets contiguous heads-major Q/K/V.
KERNELS = ("auto", "math", "backend", "heads_major")

# (name, batch, q_len, kv_len, heads, head_dim, mask): lengths the degrees do not divide, heads 7 (divisible by
# none of 2/3/4), fewer heads than ranks, cross-attention (q_len != kv_len) and every mask layout.
CASES = [
    ("self", 2, 13, 13, 7, 8, None),
    ("self_even", 1, 12, 12, 8, 8, None),
    ("cross", 2, 13, 9, 7, 8, None),
    ("cross_short_kv", 1, 17, 5, 5, 4, None),
    ("heads6", 1, 11, 11, 6, 8, None),
    ("heads3", 1, 11, 11, 3, 8, None),
    ("heads2", 2, 10, 10, 2, 8, None),
    ("heads1", 1, 9, 9, 1, 8, None),
    ("keypad_split13", 2, 13, 13, 7, 8, "keypad_split"),
    ("keypad_split_cross", 2, 11, 13, 7, 8, "keypad_split"),
    ("keypad_global", 2, 13, 13, 7, 8, "keypad_global"),
    ("keypad_global_4d", 2, 13, 9, 7, 8, "keypad_global_4d"),
    ("additive_global", 2, 13, 13, 7, 8, "additive_global"),
    ("additive_split", 1, 14, 13, 5, 8, "additive_split"),
    ("full_global", 1, 13, 11, 7, 8, "full_global"),
    ("full_query_split", 2, 13, 11, 7, 8, "full_query_split"),
    # Per-head masks (B, H, Mq, Mk), as LTX's processors expand the text mask: each rank keeps its heads' rows.
    ("perhead_split", 2, 13, 11, 7, 8, "perhead_split"),
    ("perhead_split_bool", 2, 11, 13, 7, 8, "perhead_bool_split"),
    ("perhead_split_heads3", 1, 11, 11, 3, 8, "perhead_split"),  # at CP 4 one rank owns no head
    ("perhead_global", 2, 13, 9, 7, 8, "perhead_global"),
    ("perhead_query_split", 1, 13, 11, 7, 8, "perhead_query_split"),
]
# Split key masks ride in the fused Q/K/V all-to-all; only a mask split along queries takes a gather of its own.
MASK_GATHERS = sum(str(kind).endswith("query_split") for *_, kind in CASES) * 2  # once per dtype


def _make_mask(kind: str | None, B: int, H: int, Sq: int, Skv: int, dtype: torch.dtype, gen: torch.Generator):
    """Global mask (what the serial run sees) and the dim along which CP ranks receive it split (None: whole)."""
    if kind is None:
        return None, None
    if kind.startswith("perhead"):  # a different mask per head, so a rank using another rank's rows would show
        rows = Sq if kind == "perhead_query_split" else 1
        keep = torch.rand(B, H, rows, Skv, generator=gen) > 0.4
        keep[..., 0] = True
        if kind == "perhead_bool_split":
            return keep, -1
        bias = (~keep).to(dtype) * -10000.0  # LTX's additive text bias, in the payload dtype
        return bias, {"perhead_split": -1, "perhead_global": None, "perhead_query_split": -2}[kind]
    if kind.startswith("keypad"):
        keep = torch.rand(B, Skv, generator=gen) > 0.35
        keep[:, 0] = True  # no fully masked row
        if kind == "keypad_global_4d":
            return keep[:, None, None, :], None
        return keep, -1 if kind == "keypad_split" else None
    if kind.startswith("additive"):
        bias = torch.randn(B, 1, 1, Skv, generator=gen, dtype=dtype)
        bias[..., 1::3] = -1e4
        return bias, -1 if kind == "additive_split" else None
    if kind.startswith("full"):
        keep = torch.rand(B, 1, Sq, Skv, generator=gen) > 0.3
        keep[..., 0] = True
        return keep, -2 if kind == "full_query_split" else None
    raise AssertionError(kind)


def _serial(q, k, v, mask):
    m = mask[:, None, None, :] if mask is not None and mask.dim() == 2 else mask
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m
    ).transpose(1, 2)


def _parallel_config(world: int):
    """Op-level CP state (no model): what diffusers' dispatch hands the attention; it carries our registry and
    transport. Without a plan its registry stays off (every call exchanges sizes) until a case turns it on."""
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import ContextParallelState

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    return ContextParallelState.on_mesh(mesh, scope="op")


@rank_job(2, 3, 4)
def _attention_cases(rank: int, world: int) -> dict:
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    from train.cp import install_ulysses_anything_backward

    install_ulysses_anything_backward()
    install_ulysses_anything_backward()  # idempotent
    cfg = _parallel_config(world)
    errors, relative, forwards = {}, {}, _count_kernel_forwards()
    for (seed, (name, B, Sq, Skv, H, D, mask_kind)), kernel in itertools.product(enumerate(CASES), KERNELS):
        cfg.kernel = kernel
        for dtype in (torch.float32, torch.float64):
            gen = torch.Generator().manual_seed(seed)  # same data on every rank
            q, k, v = (torch.randn(B, S, H, D, generator=gen, dtype=dtype) for S in (Sq, Skv, Skv))
            dout = torch.randn(B, Sq, H, D, generator=gen, dtype=dtype)
            mask, split = _make_mask(mask_kind, B, H, Sq, Skv, dtype, gen)
            # Serial reference.
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
            ref = _serial(qs, ks, vs, mask)
            ref.backward(dout)
            # CP: each rank holds its tensor_split shard of the sequence (and of the mask, when split).
            ql, kl, vl = (t.tensor_split(world, dim=1)[rank].clone().requires_grad_() for t in (q, k, v))
            ml = mask.tensor_split(world, dim=split)[rank] if split is not None else mask
            out = dispatch_attention_fn(
                ql, kl, vl, attn_mask=ml, backend=AttentionBackendName.NATIVE, parallel_config=cfg
            )
            before = sum(forwards.values())
            out.backward(dout.tensor_split(world, dim=1)[rank])
            shard = lambda t: t.tensor_split(world, dim=1)[rank]  # noqa: E731
            errors[(kernel, name, str(dtype))] = {
                "forwards_in_backward": sum(forwards.values()) - before,
                "out": (out - shard(ref)).abs().max().item(),
                "dq": (ql.grad - shard(qs.grad)).abs().max().item(),
                "dk": (kl.grad - shard(ks.grad)).abs().max().item(),
                "dv": (vl.grad - shard(vs.grad)).abs().max().item(),
            }
            pairs = ((out, ref), (ql.grad, qs.grad), (kl.grad, ks.grad), (vl.grad, vs.grad))
            worst = max(((a - shard(b)).abs().max() / shard(b).abs().max()).item() for a, b in pairs)
            relative[kernel, str(dtype)] = max(relative.get((kernel, str(dtype)), 0.0), worst)
    cfg.kernel = "auto"
    lse = _lse_case(rank, world, cfg)
    counted = dict(forwards)
    stats = cfg.transport.stats.sites
    calls = {site: stats[site].calls for site in ("qkv", "d_qkv", "mask")}
    registry = _registry_cases(rank, world, cfg)
    return {"errors": errors, "lse": lse, "calls": calls, "stock_mask_error": _stock_mask_error(rank, world, cfg),
            "registry": registry, "kernel_forwards": counted, "relative": relative}  # fmt: skip


def _count_kernel_forwards() -> dict[str, int]:
    """Count each CPU kernel's forward calls (this spawned rank only): `pick` reads the registry at call time."""
    import dataclasses

    from train.cp import kernels

    counts = {}
    kernels.KERNELS["heads_major"] = dataclasses.replace(kernels.KERNELS["cpu_flash"], storage="bhsd")
    for name in ("cpu_flash", "math", "heads_major"):
        kernel = kernels.KERNELS[name]
        counts[name] = 0

        def forward(q, k, v, *args, _name=name, _fwd=kernel.forward, _storage=kernel.storage):
            counts[_name] += 1
            if _storage == "bhsd":
                assert all(t.is_contiguous() for t in (q, k, v)), "heads-major storage expected"
            else:
                assert all(t.transpose(1, 2).is_contiguous() for t in (q, k, v)), "(B, S, H, D) storage expected"
            return _fwd(q, k, v, *args)

        kernels.KERNELS[name] = dataclasses.replace(kernel, forward=forward)
    return counts


def _registry_cases(rank: int, world: int, cfg) -> dict:
    """Size exchanges with the layout registry, three "forwards" with identical shapes per case.

    - "identified": recorded splits of 13 and 9 tokens; a 13-token attention has local lengths no other candidate
      shares on any rank, so no rank exchanges sizes, not even in the first forward.
    - "ambiguous": splits of 13 and 12 tokens share local lengths on some ranks (13 → [7, 6] and 12 → [6, 6] at 2),
      and one forward attends over both, in the order 13, 12, 13: the rank holding 6 tokens cannot tell them apart
      (a cache keyed by local length would hit there and miss elsewhere: a hang). Every rank knows the same upper
      bounds, pads its chunks to them and sends its true lengths along: still no exchange.
    - "ambiguous_masked": the same with a split key mask (which cannot ride padded chunks): every rank decides alike
      to exchange, once per call in the first forward, then from the remembered call positions: none.
    - "misleading" (verify mode): 12 tokens split outside the hooks while the registry only holds an 11-token split.
      Some rank's length matches the wrong split; verify mode raises the same error on every rank.
    """
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    from train.cp.layout import LayoutError, LayoutRegistry

    out = {}
    cases = (
        ("identified", (13, 9), (13,), False, False),
        ("ambiguous", (13, 12), (13, 12, 13), False, False),
        ("ambiguous_masked", (13, 12), (13, 12, 13), True, False),
        ("misleading", (11,), (12,), False, True),
    )
    for name, recorded, seqs, masked, verify in cases:
        exchanges, errors, raised = [], [], []
        cfg.layout = reg = LayoutRegistry(scope=f"op-{name}")  # each case is a model of its own: its own memos
        reg.verify = verify
        try:
            for _ in range(3):
                reg.reset(enabled=True)  # a model forward starts (the guard hook does this)
                for length in recorded:  # what the split hooks would record
                    reg.record(length, world)
                before = reg.exchanges
                for seq in seqs:
                    gen = torch.Generator().manual_seed(seq)
                    q, k, v, dout = (torch.randn(1, seq, 7, 8, generator=gen) for _ in range(4))
                    keep = torch.rand(1, seq, generator=gen) > 0.3 if masked else None
                    if keep is not None:
                        keep[:, 0] = True
                    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
                    ref = _serial(qs, ks, vs, keep)
                    ref.backward(dout)
                    shard = lambda t: t.tensor_split(world, dim=1)[rank]  # noqa: E731
                    ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
                    ml = None if keep is None else keep.tensor_split(world, dim=-1)[rank]
                    try:
                        y = dispatch_attention_fn(ql, kl, vl, attn_mask=ml, backend=AttentionBackendName.NATIVE,
                                                  parallel_config=cfg)  # fmt: skip
                        y.backward(shard(dout))
                        errors += [(a - shard(b)).abs().max().item() for a, b in
                                   ((y, ref), (ql.grad, qs.grad), (kl.grad, ks.grad), (vl.grad, vs.grad))]  # fmt: skip
                    except LayoutError as e:
                        raised.append(str(e).split(":")[0])
                exchanges.append(reg.exchanges - before)
        finally:
            reg.verify = False
        dist.barrier()  # every rank got here: nobody is stuck in a collective
        out[name] = {"exchanges": exchanges, "max_error": max(errors, default=0.0), "raised": raised}
    return out


def _stock_mask_error(rank: int, world: int, cfg) -> float:
    """diffusers' own forward on a split key-padding mask of 13 keys (it trims after concatenating the shards)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    from train.cp.patch import stock_diffusers

    with stock_diffusers():
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 13, 8, 8, generator=gen) for _ in range(3))
        keep = torch.rand(1, 13, generator=gen) > 0.35
        keep[:, 0] = True
        ref = _serial(q, k, v, keep)
        shard = lambda t: t.tensor_split(world, dim=1)[rank]  # noqa: E731
        with torch.no_grad():
            out = dispatch_attention_fn(shard(q), shard(k), shard(v), attn_mask=keep.tensor_split(world, dim=-1)[rank],
                                        backend=AttentionBackendName.NATIVE, parallel_config=cfg)  # fmt: skip
        err = torch.tensor([(out - shard(ref)).abs().max().item()])
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        return err.item()


def _math_forward_op(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                     return_lse=False, _save_ctx=True, _parallel_config=None):  # fmt: skip
    """A tiny backend with an LSE (native SDPA has none) to prove the CP path is backend-agnostic."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    lse = s.logsumexp(-1)  # (B, H, Sq)
    out = torch.einsum("bhqk,bkhd->bqhd", (s - lse[..., None]).exp(), v)
    if _save_ctx:
        ctx.save_for_backward(q, k, v)
    return (out, lse.transpose(1, 2)) if return_lse else out


def _math_backward_op(ctx, grad_out, *args, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
    with torch.enable_grad():
        out = _math_forward_op(None, q, k, v, _save_ctx=False)
        return torch.autograd.grad(out, (q, k, v), grad_out)


def _lse_case(rank: int, world: int, cfg) -> dict:
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 13, 7, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _math_forward_op(None, qs, ks, vs, return_lse=True, _save_ctx=False)
    ref.sum().backward()
    ql, kl, vl = (t.tensor_split(world, dim=1)[rank].clone().requires_grad_() for t in (q, k, v))
    out, lse = _templated_context_parallel_attention(ql, kl, vl, None, 0.0, False, None, False, True,
                                                     forward_op=_math_forward_op, backward_op=_math_backward_op,
                                                     _parallel_config=cfg)  # fmt: skip
    out.sum().backward()
    shard = lambda t: t.tensor_split(world, dim=1)[rank]  # noqa: E731
    return {
        "out": (out - shard(ref)).abs().max().item(),
        "lse": (lse - shard(ref_lse)).abs().max().item(),
        "lse_requires_grad": lse.requires_grad,
        "dq": (ql.grad - shard(qs.grad)).abs().max().item(),
    }


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_anything_matches_serial(group, world: int) -> None:
    results = group(_attention_cases, world)
    print(f"\nUlysses CP {world}, {len(CASES)} cases: max relative error of out, dQ, dK, dV vs serial SDPA, per kernel")
    for kernel, dtype in results[0]["relative"]:
        worst = max(r["relative"][kernel, dtype] for r in results)
        print(f"  {kernel:<12} {dtype:<14} {worst:.1e}")
    for rank, res in enumerate(results):
        assert len(res["errors"]) == len(CASES) * 2 * len(KERNELS)
        for (kernel, case, dtype), errs in res["errors"].items():
            tol = TOL[torch.float32 if "float32" in dtype else torch.float64]
            tol *= 4 if kernel == "math" else 1  # fp32 einsums round in another order than SDPA's fused kernel
            # The kernels' backward takes the saved output and LSE: no attention forward runs in it.
            assert errs.pop("forwards_in_backward") == 0, (kernel, case, dtype)
            for what, err in errs.items():
                assert err <= tol, f"world {world} rank {rank} {kernel} {case} {dtype}: {what} error {err:.3g} > {tol}"
        # Every forward of a rank that owns heads went through the kernel named (auto: CPU flash; +1: the LSE case).
        owns = sum(split_sizes(H, world)[rank] > 0 for _, _, _, _, H, _, _ in CASES) * 2
        counted = res["kernel_forwards"]
        assert counted == {"cpu_flash": owns + 1, "math": owns, "heads_major": owns}, counted
        lse = res["lse"]
        assert lse["out"] <= 1e-12 and lse["lse"] <= 1e-12 and lse["dq"] <= 1e-12, lse
        assert not lse["lse_requires_grad"]
        # The CP path really ran: one fused Q/K/V all-to-all per forward and one dQ/dK/dV all-to-all per backward.
        n = 2 * len(CASES) * len(KERNELS) + 1
        assert res["calls"] == {"qkv": n, "d_qkv": n, "mask": MASK_GATHERS * len(KERNELS)}
        # No size exchange, whether the registry identifies the layout or only bounds it; a masked call it cannot
        # identify: one per call in the first forward, then none; a wrong registry is caught by verify mode on every
        # rank alike. Output and dQ/dK/dV exact throughout.
        reg = res["registry"]
        assert reg["identified"] == {"exchanges": [0, 0, 0], "max_error": 0.0, "raised": []}, reg
        assert reg["ambiguous"] == {"exchanges": [0, 0, 0], "max_error": 0.0, "raised": []}, reg
        assert reg["ambiguous_masked"] == {"exchanges": [3, 0, 0], "max_error": 0.0, "raised": []}, reg
        assert reg["misleading"]["exchanges"] == [1, 1, 1] and reg["misleading"]["max_error"] == 0.0, reg
        failed = "CP layout registry check failed at 'sizes' (call 0 of op-misleading)"
        assert reg["misleading"]["raised"] == [failed] * 3, reg
        if world in (3, 4):  # 13 keys split [5,4,4] / [4,3,3,3]: diffusers' stock mask assembly is wrong there
            assert res["stock_mask_error"] > 0.1, res["stock_mask_error"]
