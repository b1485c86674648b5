"""Model-level parity: every family's tiny model under CP 2, 3 and 4 vs a serial run — output, loss, EVERY gradient.

Tiny models have 7 heads and token counts that 2, 3 and 4 do not divide. Inputs and loss go through each family's own
spec, as the trainer's step does (tests/tiny_models.family_case): a synthetic batch of the family's tiny recipe shapes
→ noise + sigmas → `spec.forward_kwargs(..., cp=True)` → model → `spec.predictions` → flow-matching loss. The loss is
computed on the gathered output, so each CP rank holds a partial gradient; after SUM over the CP group every parameter
gradient must equal the serial one. The same test shows that MEAN (what a plain DDP/FSDP setup does) does not: it is
1/cp of the right value.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.tiny_models import (
    FAMILY_NAMES,
    build_inputs,
    build_model,
    family_case,
    family_loss,
    make_loss,
    output_tensors,
)
from train.models import get_family

# Relative error per parameter: max|g_cp - g_serial| / max|g_serial|. fp32 CP reorders some sums (different
# sequence chunks per rank), fp64 shows the math is exact up to rounding.
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
OUT_TOL = {torch.float32: 1e-5, torch.float64: 1e-10}  # absolute, outputs are O(1)
# Wan's norms and modulation call `.float()`, so an fp64 Wan-based model (the Wan variants, ChronoEdit, SkyReels-V2:
# the same block, FP32LayerNorm and `.float()` casts, and `.float()` before norm_out) computes partly in fp32.
_WAN_CLASSES = {"WanTransformer3DModel", "ChronoEditTransformer3DModel", "SkyReelsV2Transformer3DModel"}
FP32_INSIDE = {n for n in FAMILY_NAMES if get_family(n).transformer_class in _WAN_CLASSES}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _run_models(rank: int, world: int, checkpointing: bool, dtypes: tuple[torch.dtype, ...]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel
    from train.cp.reduce import GradReduction

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    reduction = GradReduction("allreduce", cp_group=mesh["ulysses"].get_group())
    results = {}
    for dtype in dtypes:
        for name in FAMILY_NAMES:
            case = family_case(name, seed=1, dtype=dtype)
            # Serial reference (every rank computes it; the models are tiny).
            serial = build_model(name, seed=0, dtype=dtype)
            if checkpointing:
                serial.enable_gradient_checkpointing()
            ref_out = output_tensors(name, serial(**case.kwargs, return_dict=False))
            ref_loss = family_loss(case, ref_out, serial.config)
            ref_loss.backward()
            ref_grads = {n: p.grad for n, p in serial.named_parameters() if p.requires_grad}

            model = build_model(name, seed=0, dtype=dtype)
            registry = enable_context_parallel(model, mesh=mesh).layout  # this model's layout registry
            if checkpointing:
                model.enable_gradient_checkpointing()
            before = registry.exchanges  # the first forward of this shape: every layer's layout from the registry
            out = output_tensors(name, model(**family_case(name, seed=1, dtype=dtype).kwargs, return_dict=False))
            loss = family_loss(case, out, model.config)
            loss.backward()
            first_exchanges = registry.exchanges - before
            partial = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
            reduction.reduce_gradients(model.parameters())  # SUM over CP
            summed = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            mean = {n: g.clone() for n, g in partial.items()}
            for g in mean.values():
                dist.all_reduce(g, op=dist.ReduceOp.AVG, group=mesh["ulysses"].get_group())

            assert set(summed) == set(ref_grads)
            # The same step again in verify mode: every layer exchanges sizes and checks, on every rank alike, that
            # the registry decided right (it raises otherwise), with the same result.
            model.zero_grad(set_to_none=True)
            registry.verify = True
            try:
                before = registry.exchanges
                out2 = output_tensors(name, model(**family_case(name, seed=1, dtype=dtype).kwargs, return_dict=False))
                family_loss(case, out2, model.config).backward()
            finally:
                registry.verify = False
            reduction.reduce_gradients(model.parameters())
            second = {n: _rel(p.grad, ref_grads[n]) for n, p in model.named_parameters() if p.requires_grad}
            results[(name, str(dtype))] = {
                "first_pass_exchanges": first_exchanges,
                "verified_calls": registry.exchanges - before,
                "second_pass_sum": max(second.values()),
                "out": max((o - r).abs().max().item() for o, r in zip(out, ref_out)),
                "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                "sum": {n: _rel(summed[n], ref_grads[n]) for n in ref_grads},
                "mean": {n: _rel(mean[n], ref_grads[n]) for n in ref_grads},
                "partial_differs": sum(_rel(partial[n], ref_grads[n]) > 1e-3 for n in ref_grads),
            }
    return results


def _check(world: int, checkpointing: bool, results: list[dict]) -> None:
    res = results[0]
    for other in results[1:]:  # every rank ends with the same gathered output and the same reduced gradients
        for key, r in other.items():
            assert r["sum"] == pytest.approx(res[key]["sum"], abs=TOL[torch.float32])
    print(f"\nCP {world}, gradient checkpointing {'on' if checkpointing else 'off'}")
    print(f"{'model':<12} {'dtype':<14} {'out abs':>9} {'loss rel':>9} {'SUM max rel':>12} {'MEAN min rel':>12} params")
    for (name, dtype), r in res.items():
        dt = torch.float32 if "float32" in dtype or name in FP32_INSIDE else torch.float64
        tol, out_tol = TOL[dt], OUT_TOL[dt]
        worst = max(r["sum"], key=r["sum"].get)
        print(f"{name:<12} {dtype:<14} {r['out']:9.2e} {r['loss']:9.2e} {r['sum'][worst]:12.2e} "
              f"{min(r['mean'].values()):12.2e} {len(r['sum'])}")  # fmt: skip
        assert r["out"] <= out_tol, f"{name} {dtype}: output error {r['out']}"
        assert r["loss"] <= tol, f"{name} {dtype}: loss error {r['loss']}"
        assert r["sum"][worst] <= tol, f"{name} {dtype}: SUM-reduced gradient of {worst} off by {r['sum'][worst]:.3g}"
        # No size exchange in any layer, first forward included (with checkpointing: recomputed forwards too).
        assert r["first_pass_exchanges"] == 0, (name, r["first_pass_exchanges"])
        assert r["verified_calls"] > 0 and r["second_pass_sum"] <= tol, (name, r["verified_calls"])
        # MEAN over CP is 1/cp of the right gradient: wrong for every parameter (relative error 1 - 1/cp).
        assert min(r["mean"].values()) >= 0.5 * (1 - 1 / world), f"{name}: MEAN unexpectedly matched"
        # Before the reduction rank 0 really holds partial gradients (most parameters see tokens of every rank; with
        # MiniMax's [text | audio | video] packing, rank 0 alone holds the text rows at CP 4).
        assert r["partial_differs"] > 0.5 * len(r["sum"]), f"{name}: only {r['partial_differs']} partial gradients"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_ckpt", "ckpt"])
def test_models_match_serial(world: int, checkpointing: bool) -> None:
    # fp32 everywhere; fp64 once per degree (without checkpointing) for the exactness check.
    dtypes = (torch.float32,) if checkpointing else (torch.float32, torch.float64)
    _check(world, checkpointing, run_distributed(_run_models, world, checkpointing, dtypes))


def _smaller_flux(inputs: dict) -> dict:
    """The same model inputs with fewer image (22) and text (4) tokens: another bucket, another split layout."""
    out = dict(inputs)
    out["hidden_states"], out["img_ids"] = inputs["hidden_states"][:, :22], inputs["img_ids"][:22]
    out["encoder_hidden_states"], out["txt_ids"] = inputs["encoder_hidden_states"][:, :4], inputs["txt_ids"][:4]
    return out


def _two_shapes_then_backward(rank: int, world: int) -> dict:
    """Two forwards of different shapes, then one backward, under activation checkpointing: the recompute of the first
    forward runs after the second one replaced the recorded splits. With `enable_gradient_checkpointing()` after CP
    (checkpoint_with_layout) the recompute replays its own forward's registry: no size exchange. With another
    checkpoint function it exchanges sizes in every recomputed layer: slower, never wrong or hung."""
    import torch.utils.checkpoint
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel
    from train.cp.reduce import GradReduction

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    reduction = GradReduction("allreduce", cp_group=mesh["ulysses"].get_group())
    a, b = build_inputs("flux", seed=1), _smaller_flux(build_inputs("flux", seed=3))

    def step(model) -> None:
        outs = [output_tensors("flux", model(**x, return_dict=False)) for x in (a, b)]
        (make_loss("flux", outs[0], seed=2) + make_loss("flux", outs[1], seed=4)).backward()

    serial = build_model("flux", seed=0)
    serial.enable_gradient_checkpointing()
    step(serial)
    ref = {n: p.grad for n, p in serial.named_parameters()}
    plain = lambda m, *args: torch.utils.checkpoint.checkpoint(m.__call__, *args, use_reentrant=False)  # noqa: E731
    res = {}
    for mode, func in (("replayed", None), ("other checkpoint function", plain)):
        model = build_model("flux", seed=0)
        registry = enable_context_parallel(model, mesh=mesh).layout  # this model's layout registry
        model.enable_gradient_checkpointing(func)
        before = registry.exchanges
        step(model)
        reduction.reduce_gradients(model.parameters())
        res[mode] = {
            "exchanges": registry.exchanges - before,
            "grad": max(_rel(p.grad, ref[n]) for n, p in model.named_parameters()),
        }
    return res


def test_checkpoint_recompute_after_another_shape() -> None:
    for res in run_distributed(_two_shapes_then_backward, 2):
        assert res["replayed"]["exchanges"] == 0 and res["replayed"]["grad"] <= TOL[torch.float32], res
        # 2 blocks x 2 forwards recomputed, one exchange each (the forwards themselves need none).
        other = res["other checkpoint function"]
        assert other["exchanges"] == 4 and other["grad"] <= TOL[torch.float32], res
