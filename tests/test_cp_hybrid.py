"""Ring and ring × Ulysses meshes: the rank layout, the reduction over the whole CP group, refusals, the trainer.

Model-level parity of every family on ring 2 × 1, ring 2 × Ulysses 2 and ring 4 × 1 (with and without activation
checkpointing) is tests/test_cp_models.py's; op-level ring numerics are tests/test_cp_ring.py's. Here:

- the mesh: rank = ring index × U + Ulysses index (Ulysses groups consecutive, ring groups strided);
- the startup self-check passes for the reduction `GradReduction.for_model` builds (SUM over ring × Ulysses) and
  refuses one over the Ulysses dim alone, naming the missing ranks;
- models whose CP training is not exact (Helios) are refused on a ring mesh too, at enable time when asked, else at
  the first training forward, before any collective (the ranks stay in step);
- a cp that cp_ring does not divide is refused at recipe resolution.

Trainer level (mesh dp 1 × ring 2 × Ulysses 2 through the real entry point, its layout.json, loss, grad norm and
every exported weight per step against the serial launch) is tests/test_families_e2e.py's HunyuanVideo exact test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import REPO, rank_job
from train.tools.tiny_models import GUARD_MODEL_NAMES, build_inputs, build_model, model_class

CONFIGS = {4: (2, 2), 2: (2, 1)}  # world → (ring, ulysses)


@rank_job(4, 2)
def _mesh_and_reduction(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel
    from train.cp.reduce import GradReduction

    ring, ulysses = CONFIGS[world]
    mesh = init_device_mesh("cpu", (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
    state = enable_context_parallel(build_model("wan"), mesh=mesh)
    cp = state.context_parallel_config
    results: dict = {
        "layout": {
            "flat": cp._flattened_mesh.get_local_rank(),
            "ring_ranks": sorted(dist.get_process_group_ranks(cp._ring_mesh.get_group())),
            "ulysses_ranks": sorted(dist.get_process_group_ranks(cp._ulysses_mesh.get_group())),
        },
        "refused": {},
    }
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
    results["self_check"] = GradReduction.for_model(state).self_check(state.cp_group)
    try:
        GradReduction("allreduce", cp._ulysses_mesh.get_group()).self_check(state.cp_group)
        results["sub_group_check"] = "passed"
    except RuntimeError as e:
        results["sub_group_check"] = str(e)
    return results


@pytest.mark.parametrize("world", [4, 2], ids=["ring2xU2", "ring2xU1"])
def test_mesh_reduction_and_refusals(group, world: int) -> None:
    ring, ulysses = CONFIGS[world]
    for rank, res in enumerate(group(_mesh_and_reduction, world)):
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


def test_cp_ring_must_divide_cp() -> None:
    """A cp that cp_ring does not divide is one UserError at recipe resolution, before any process group exists."""
    from train.config import load_recipe
    from train.errors import UserError

    recipe = load_recipe(REPO / "recipes/tiny/flux.yaml", ["parallel.cp=3", "parallel.cp_ring=2"])
    with pytest.raises(UserError, match=r"parallel: cp_ring \(2\) does not divide cp \(3\)"):
        recipe.parallel.resolve(3)
    ok = load_recipe(REPO / "recipes/tiny/flux.yaml", ["parallel.cp=4", "parallel.cp_ring=2"])
    assert ok.parallel.resolve(4) == (1, 1, 4)
