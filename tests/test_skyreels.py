"""SkyReels-V2 (no diffusers CP plan: cp_plans/skyreels_v2.yaml): per-frame (diffusion-forcing) sigmas, the per-frame
loss weights, the forward kwargs of both pipelines, and the T2V (B,) timestep (`train.frame_sigmas: shared`) under
CP 3 vs serial. Model-level parity of the diffusion-forcing case (the family's tiny recipe: per-frame timesteps that
differ per frame) at every CP layout is in tests/test_cp_models.py; the tiny pipeline's cache trained under CP 3
with the serial oracle's first step, and its LoRA export loaded by the diffusion-forcing pipeline, in
tests/test_families_e2e.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.harness import rank_job
from train import objective
from train.errors import UserError
from train.models import get_family, tiny_config
from train.step import Objective, StepInputs, prepare
from train.tools.probe import family_batch
from train.tools.tiny_models import build_model, family_case, tiny_recipe

NAME = "skyreels_v2"


def test_per_frame_sigmas_are_non_decreasing_and_identical_on_peers() -> None:
    spec = get_family(NAME)
    draw = [objective.sample_stream_sigmas(3, spec, frames=5, generator=torch.Generator().manual_seed(7))["latents"]
            for _ in range(2)]  # fmt: skip
    assert draw[0].shape == (3, 1, 5, 1, 1) and torch.equal(draw[0], draw[1])  # CP peers seeded alike agree
    frames = draw[0].reshape(3, 5)
    assert bool((frames[:, 1:] >= frames[:, :-1]).all()) and bool((frames[:, 1:] > frames[:, :-1]).any())
    # independent: the same base draws through the shift, unsorted
    ind = objective.sample_stream_sigmas(3, spec, frames=5, frame_sigmas="independent",
                                         generator=torch.Generator().manual_seed(7))["latents"]  # fmt: skip
    assert torch.equal(ind.reshape(3, 5).sort(dim=1).values, frames)
    shared = objective.sample_stream_sigmas(3, spec, frames=5, frame_sigmas="shared",
                                            generator=torch.Generator().manual_seed(7))["latents"]  # fmt: skip
    assert shared.shape == (3,)
    with pytest.raises(UserError, match="train.frame_sigmas"):
        objective.sample_stream_sigmas(1, get_family("wan"), frames=5, frame_sigmas="independent",
                                       generator=torch.Generator())  # fmt: skip


def test_per_frame_loss_weights_each_frame() -> None:
    pred, target = torch.randn(2, 3, 4, 2, 2), torch.randn(2, 3, 4, 2, 2)
    sigmas = torch.rand(2, 1, 4, 1, 1) * 0.8 + 0.1
    weights = objective.loss_weight(sigmas, "sigma_sqrt")
    expected = ((pred - target).pow(2) * sigmas.pow(-2)).mean()
    assert objective.flow_matching_loss(pred, target, weights).item() == pytest.approx(expected.item(), rel=1e-6)


def test_forward_kwargs_are_the_pipelines() -> None:
    """The diffusion-forcing kwargs are what SkyReelsV2DiffusionForcingPipeline passes (timestep (B, F) per frame,
    enable_diffusion_forcing, fps indices); the T2V ones what SkyReelsV2Pipeline passes (timestep (B,))."""
    case = family_case(NAME, seed=3)
    sigmas = case.sigmas["latents"].flatten(1)  # (B, 1, F, 1, 1) -> (B, F)
    assert sigmas.shape[1] > 1 and torch.equal(case.kwargs["timestep"], sigmas * 1000)
    assert case.kwargs["enable_diffusion_forcing"] is True and case.kwargs["fps"] == [1]
    t2v = _t2v_case()
    assert t2v.kwargs["timestep"].shape == (2,) and "enable_diffusion_forcing" not in t2v.kwargs


def _t2v_case(seed: int = 1) -> StepInputs:
    """A training step of the tiny recipe's shapes, two samples, one sigma per sample (train.frame_sigmas: shared),
    through the trainer's own `prepare`."""
    spec = get_family(NAME)
    shared = dataclasses.replace(Objective.of(tiny_recipe(NAME), spec), frame_sigmas="shared")
    batch = family_batch(NAME, seed, batch_size=2)
    return prepare(spec, batch, shared, torch.Generator().manual_seed(10_000 + seed), model_config=tiny_config(NAME))


@rank_job(3)
def _t2v_parity(rank: int, world: int) -> dict[str, float]:
    """The T2V step on CP 3 (gradients SUM-reduced) vs the serial oracle (train/tools/oracle.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import GradReduction, enable_context_parallel
    from train.tools.oracle import compare, run_step

    case = _t2v_case()
    serial = run_step(build_model(NAME, seed=0), case)
    model = build_model(NAME, seed=0)
    state = enable_context_parallel(model, mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses")))
    errors = compare(run_step(model, case, reduce=GradReduction("allreduce", cp_group=state.cp_group).reduce_gradients),
                     serial)  # fmt: skip
    return {"out": errors.out, "loss": errors.loss, "grad": errors.grad, "grads": len(errors.grads)}


def test_t2v_timestep_matches_serial_under_cp3(group) -> None:
    for rank, errors in enumerate(group(_t2v_parity, 3)):
        assert errors["grads"] == sum(p.requires_grad for p in build_model(NAME).parameters()), (rank, errors)
        assert errors["out"] <= 1e-5 and errors["loss"] <= 2e-5 and errors["grad"] <= 2e-5, (rank, errors)
