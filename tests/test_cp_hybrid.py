"""Ring-Anything and hybrid ring × Ulysses-Anything CP, wired end to end: model level and trainer level.

Model level: every family's tiny model (7 heads, token counts that 2, 3 and 4 do not divide) on a ("ring", "ulysses")
mesh, ring 2 × Ulysses 2 on 4 gloo ranks and ring 2 × Ulysses 1 on 2, through `enable_context_parallel` (diffusers'
dispatch reaches our ring / hybrid attention, the split hooks split unevenly over the whole CP group), against a
serial run of the same model: loss and EVERY gradient after SUM over the whole CP group (`GradReduction.for_model`),
fp32, ≤ 1e-5 relative. A reduction over the Ulysses sub-group only must be wrong (and the self-check must say so).

Trainer level: the tiny Flux recipe with `parallel.cp=4 parallel.cp_ring=2` on 4 CPU processes through
`accelerate launch` (mesh dp 1 × ring 2 × Ulysses 2) against the 1-process run: losses within 1e-5 relative.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.tiny_models import (
    FAMILY_NAMES,
    GUARD_MODEL_NAMES,
    build_inputs,
    build_model,
    family_case,
    family_loss,
    model_class,
    output_tensors,
)

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5  # fp32, relative: loss, and max |g_cp - g_serial| / max |g_serial| per parameter
CONFIGS = {4: (2, 2), 2: (2, 1)}  # world → (ring, ulysses)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _run_families(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel
    from train.cp.reduce import GradReduction

    ring, ulysses = CONFIGS[world]
    mesh = init_device_mesh("cpu", (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
    results: dict = {"layout": None, "families": {}}
    for name in FAMILY_NAMES:
        case = family_case(name, seed=1)
        serial = build_model(name, seed=0)
        ref_loss = family_loss(case, output_tensors(name, serial(**case.kwargs, return_dict=False)), serial.config)
        ref_loss.backward()
        ref = {n: p.grad for n, p in serial.named_parameters() if p.requires_grad}

        model = build_model(name, seed=0)
        state = enable_context_parallel(model, mesh=mesh)
        cp = state.context_parallel_config
        if results["layout"] is None:
            results["layout"] = {
                "flat": cp._flattened_mesh.get_local_rank(),
                "ring_ranks": sorted(dist.get_process_group_ranks(cp._ring_mesh.get_group())),
                "ulysses_ranks": sorted(dist.get_process_group_ranks(cp._ulysses_mesh.get_group())),
            }
        state.stats.reset()
        out = output_tensors(name, model(**family_case(name, seed=1).kwargs, return_dict=False))
        loss = family_loss(case, out, model.config)
        loss.backward()
        sites = {site: s.calls for site, s in state.stats.sites.items()}
        partial = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        GradReduction.for_model(state).reduce_gradients(model.parameters())  # SUM over ring × Ulysses
        summed = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        uly_only = {n: g.clone() for n, g in partial.items()}  # what a reduction over the Ulysses dim alone gives
        for g in uly_only.values():
            dist.all_reduce(g, group=cp._ulysses_mesh.get_group())
        assert set(summed) == set(ref)
        results["families"][name] = {
            "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "grad": {n: _rel(summed[n], ref[n]) for n in ref},
            "ulysses_only": max(_rel(uly_only[n], ref[n]) for n in ref),
            "sites": sites,
        }
    # Refusals hold on a ring mesh too: the models whose CP training is not exact (Helios, LTX-2) are refused at enable
    # time when asked, else at the first training forward, before any collective (the ranks stay in step).
    results["refused"] = {}
    for name in GUARD_MODEL_NAMES:
        said = []
        for for_training in (True, None):
            guarded = build_model(name)
            try:
                enable_context_parallel(guarded, mesh=mesh, for_training=for_training)
                guarded(**build_inputs(name), return_dict=False)
            except ValueError as e:
                said.append(str(e).split(":")[0])
        step = torch.ones(1)
        dist.all_reduce(step)
        results["refused"][name] = (said, step.item() == world)
    # The startup self-check (as the trainer runs it: against the model's whole CP group) passes for the reduction
    # `for_model` builds and refuses one over the Ulysses dim alone.
    results["self_check"] = GradReduction.for_model(state).self_check(state.cp_group)
    try:
        GradReduction("allreduce", cp._ulysses_mesh.get_group()).self_check(state.cp_group)
        results["sub_group_check"] = "passed"
    except RuntimeError as e:
        results["sub_group_check"] = str(e)
    return results


@pytest.fixture(scope="module")
def spawned() -> dict:
    return {}


def _spawn(spawned: dict, world: int) -> list[dict]:
    if world not in spawned:
        spawned[world] = run_distributed(_run_families, world)
    return spawned[world]


@pytest.mark.parametrize("world", [4, 2], ids=["ring2xU2", "ring2xU1"])
def test_families_match_serial(spawned, world: int) -> None:
    ring, ulysses = CONFIGS[world]
    ranks = _spawn(spawned, world)
    print(f"\nring {ring} x Ulysses {ulysses} ({world} ranks), fp32, SUM over the whole CP group")
    print(f"{'family':<14} {'loss rel':>9} {'max grad rel':>13} {'Ulysses-only':>13} params  collectives/step (rank 0)")
    for name, r in ranks[0]["families"].items():
        worst = max(r["grad"], key=r["grad"].get)
        print(f"{name:<14} {r['loss']:9.2e} {r['grad'][worst]:13.2e} {r['ulysses_only']:13.2e} {len(r['grad']):>6}  "
              f"{sum(r['sites'].values())}")  # fmt: skip
    for rank, res in enumerate(ranks):
        # Mesh layout: rank = ring index × U + Ulysses index; Ulysses groups consecutive, ring groups strided.
        i, u = divmod(rank, ulysses)
        assert res["layout"] == {
            "flat": rank,
            "ring_ranks": [j * ulysses + u for j in range(ring)],
            "ulysses_ranks": [i * ulysses + x for x in range(ulysses)],
        }
        assert res["self_check"] == pytest.approx(world * (world + 1) / 2)
        said = res["sub_group_check"]
        assert said.startswith(f"gradient reduction self-check failed (allreduce, cp={world}, dp=1)"), said
        assert said.endswith(f"(the reduction sums over {ulysses} of the {world} CP ranks)"), said
        for name, (said, in_step) in res["refused"].items():
            cls = model_class(name).__name__
            assert len(said) == 2 and in_step, (name, said)
            assert all(x.startswith(f"{cls} cannot be trained under context parallelism") for x in said), said
        assert set(res["families"]) == set(FAMILY_NAMES)
        for name, r in res["families"].items():
            worst = max(r["grad"], key=r["grad"].get)
            assert r["loss"] <= TOL, f"rank {rank} {name}: loss error {r['loss']:.3g}"
            assert r["grad"][worst] <= TOL, f"rank {rank} {name}: gradient of {worst} off by {r['grad'][worst]:.3g}"
            # The ring really ran: its shifts are in the model's stats (and, for the hybrid, the all-to-alls too).
            assert r["sites"].get("ring_kv", 0) > 0, (name, r["sites"])
            assert (r["sites"].get("qkv", 0) > 0) == (ulysses > 1), (name, r["sites"])
            if ulysses > 1:  # summing over the Ulysses ranks alone misses the other ring rank's part
                assert r["ulysses_only"] > 1e-3, f"{name}: a Ulysses-only reduction unexpectedly matched"


def test_trainer_ring2_ulysses2_matches_one_process(tmp_path: Path) -> None:
    """The tiny Flux recipe, 3 steps: 4 CPU processes with cp=4, cp_ring=2 (FSDP2 over the 4 CP ranks) vs 1 process.
    Loss and gradient norm per step within 1e-5 relative."""
    from tests.test_finetune import assert_same_steps, launch, metrics

    common = ("logging.wandb_mode=disabled", "train.max_steps=3", "checkpoint.export=none")
    launch(tmp_path / "serial", 1, "recipes/tiny/flux.yaml", *common, "parallel.cp=1")
    launch(tmp_path / "hybrid", 4, "recipes/tiny/flux.yaml", *common, "parallel.cp=4", "parallel.cp_ring=2")
    layout = json.loads((tmp_path / "hybrid" / "layout.json").read_text())
    assert "(ring 2 × ulysses 2)" in layout["mesh"] and "SUM over cp=4" in layout["gradient_reduction"], layout
    hybrid, serial = metrics(tmp_path / "hybrid"), metrics(tmp_path / "serial")
    for h, s in zip(hybrid, serial):
        rel = abs(h["loss"] - s["loss"]) / s["loss"]
        print(f"step {h['step']}: loss {h['loss']:.8f} vs {s['loss']:.8f} (rel {rel:.1e}), "
              f"grad_norm {h['grad_norm']:.8f} vs {s['grad_norm']:.8f}")  # fmt: skip
    assert_same_steps(hybrid, serial, "ring 2 × Ulysses 2 vs 1 process")


def test_cp_ring_must_divide_cp() -> None:
    """A cp that cp_ring does not divide is one UserError at recipe resolution, before any process group exists."""
    from train.config import load_recipe
    from train.errors import UserError

    recipe = load_recipe(REPO / "recipes/tiny/flux.yaml", ["parallel.cp=3", "parallel.cp_ring=2"])
    with pytest.raises(UserError, match=r"parallel: cp_ring \(2\) does not divide cp \(3\)"):
        recipe.parallel.resolve(3)
    ok = load_recipe(REPO / "recipes/tiny/flux.yaml", ["parallel.cp=4", "parallel.cp_ring=2"])
    assert ok.parallel.resolve(4) == (1, 1, 4)
