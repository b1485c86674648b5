"""One micro-batch of the training objective, written once: everything that runs a training step calls it.

    inputs = prepare(spec, batch, objective, generator, model_config=model.config)   # sigmas, noise, conditioning,
    out = forward(model, inputs, amp)                                                # noisy streams, forward kwargs
    loss = loss_of(spec, inputs, out, objective, model_config=model.config)          # predictions, targets, loss

(`micro_batch_loss` is the three in a row.) The trainer (train/finetune.py), the estimator's calibration
(train/estimate.py), the plan tools and the CP oracle (train/tools/) and the tests call these; none repeats a rule.

The forward kwargs are the family pipeline's own (`FamilySpec.forward_kwargs`; tests/test_families.py checks them
against each pipeline's real denoising step), and they are the same with and without context parallelism: CP splits
and reorders what the forward builds (train/cp/), it never asks for other inputs. So a serial run of `prepare`'s
kwargs is the pipeline-form reference every CP run must equal.

Randomness: one `torch.Generator` per micro-batch, drawn in a fixed order (sigmas, then noise per stream), so every
rank of a CP group, seeded alike, draws the same values.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from train import objective as fm
from train.data.dataset import LOSS_MASK
from train.models.spec import FamilySpec


@dataclass(frozen=True)
class Objective:
    """The recipe's objective settings (`train.*`) one step needs, plus the expert's sigma range."""

    timestep_sampling: fm.SamplingScheme = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    loss_weighting: fm.WeightingScheme = "none"
    frame_sigmas: str | None = None  # None: the family's default
    sigma_range: tuple[float, float] | None = None  # one expert of a mixture (Wan 2.2 A14B): its sigmas only

    @classmethod
    def of(cls, recipe: Any, spec: FamilySpec) -> Objective:
        """The objective of a recipe (its `train` section; the expert's range from its `model` section)."""
        from train.models import expert_sigma_range

        t = recipe.train
        return cls(t.timestep_sampling, t.logit_mean, t.logit_std, t.mode_scale, t.loss_weighting, t.frame_sigmas,
                   expert_sigma_range(spec, recipe.model))  # fmt: skip


@dataclass
class StepInputs:
    """One micro-batch, ready for the model: what was drawn and what the transformer gets."""

    spec: FamilySpec
    batch: Mapping[str, torch.Tensor]
    x0: dict[str, torch.Tensor]  # the clean streams, "latents" first
    noise: dict[str, torch.Tensor]
    sigmas: dict[str, torch.Tensor]  # (B,), or (B, 1, F, 1, 1) per frame, per stream
    condition: torch.Tensor | None  # 1 = a clean conditioning element of the latents (sigma 0, no loss), or None
    noisy: dict[str, torch.Tensor]
    kwargs: dict[str, Any]  # the transformer's forward kwargs (add return_dict=False)

    @property
    def shapes(self) -> dict[str, torch.Size]:
        return {s: x.shape for s, x in self.x0.items()}


def prepare(
    spec: FamilySpec,
    batch: Mapping[str, torch.Tensor],
    objective: Objective,
    generator: torch.Generator,
    *,
    model_config: Mapping[str, Any],
) -> StepInputs:
    """Sigmas, noise, clean conditioning, the noisy streams and the forward kwargs of one micro-batch. Sigmas are
    float32 (float64 for float64 latents: exactness tests), on the latents' device."""
    x0 = {s: batch[s] for s in spec.streams}
    latents = x0["latents"]
    sigmas = fm.sample_stream_sigmas(
        latents.shape[0], spec, scheme=objective.timestep_sampling, logit_mean=objective.logit_mean,
        logit_std=objective.logit_std, mode_scale=objective.mode_scale,
        image_seq_len=spec.image_seq_len(latents.shape[1:]), sigma_range=objective.sigma_range,
        frames=latents.shape[2], frame_sigmas=objective.frame_sigmas, generator=generator,
    )  # fmt: skip
    dtype = torch.promote_types(latents.dtype, torch.float32)
    sigmas = {s: v.to(device=latents.device, dtype=dtype) for s, v in sigmas.items()}
    noise = {s: fm.sample_noise(x.shape, generator=generator, dtype=x.dtype, device=x.device) for s, x in x0.items()}
    cond = spec.conditioning(batch, latents)  # None for most families
    element = {**sigmas, "latents": fm.condition_sigmas(sigmas["latents"], cond)}  # (B,) or per element
    noisy = {s: fm.add_noise(x0[s], noise[s], element[s]) for s in x0}
    kwargs = spec.forward_kwargs(batch, noisy, element, model_config=model_config)
    return StepInputs(spec, batch, x0, noise, sigmas, cond, noisy, kwargs)


def forward(model: torch.nn.Module, inputs: StepInputs, amp: torch.dtype | None = None) -> Any:
    """The transformer on the step's kwargs (under autocast to `amp`, if given)."""
    device = next(iter(inputs.x0.values())).device
    with torch.autocast(device.type, dtype=amp) if amp is not None else nullcontext():
        return model(**inputs.kwargs, return_dict=False)


def loss_of(
    spec: FamilySpec, inputs: StepInputs, out: Any, objective: Objective, *, model_config: Mapping[str, Any]
) -> torch.Tensor:
    """The flow-matching loss of the model's output, summed over streams: predictions in the cached layout against
    `noise - x0`, weighted per sample, conditioning elements left out, the primary stream's squared errors times the
    batch's `loss_mask` when the cache has one (`fm.flow_matching_loss`) (float32; float64 for float64 predictions).

    The predictions are whole here under context parallelism too (the CP plan gathers the transformer's output), so
    the mask needs no CP code."""
    preds = spec.predictions(out, inputs.shapes, model_config=model_config)
    targets = {s: fm.flow_matching_target(inputs.x0[s], inputs.noise[s]) for s in inputs.x0}
    weights = {s: fm.loss_weight(inputs.sigmas[s], objective.loss_weighting) for s in inputs.x0}
    keep = {} if inputs.condition is None else {"latents": 1.0 - inputs.condition}
    masks = {"latents": inputs.batch[LOSS_MASK]} if LOSS_MASK in inputs.batch else {}  # a training-only batch key
    return sum(fm.stream_losses(preds, targets, weights, keep, masks).values())


def micro_batch_loss(
    model: torch.nn.Module,
    spec: FamilySpec,
    batch: Mapping[str, torch.Tensor],
    objective: Objective,
    generator: torch.Generator,
    amp: torch.dtype | None = None,
) -> torch.Tensor:
    """`prepare` → `forward` → `loss_of`: one micro-batch's loss, ready for backward."""
    inputs = prepare(spec, batch, objective, generator, model_config=model.config)
    return loss_of(spec, inputs, forward(model, inputs, amp), objective, model_config=model.config)
