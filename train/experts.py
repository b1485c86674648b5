"""Both experts of a mixture in one run (`model.both_experts`; Wan 2.2 A14B T2V and I2V: `transformer` denoises the
high-noise sigmas, `transformer_2` the low-noise ones, split at the pipeline's `boundary_ratio`).

Each expert is built exactly as a one-expert run builds its transformer (`model.subfolder` set to it: the sharded
start, LoRA or full, CP hooks, the activation levers and FSDP2, each expert its own FSDP2 root), so both are sharded
over every rank and neither is ever whole on one. :class:`Experts` holds them as one module for the optimizer, the
checkpoint (DCP keys `experts.<subfolder>.*`), the EMA and the gradient clipping.

Routing: experts alternate by optimizer step, `transformer` on even steps (step 1, 3, ...), `transformer_2` on odd
ones, and each step draws its sigmas from its expert's range, exactly as a one-expert run of that expert does
(train/step.py `Objective.sigma_range`). Why per step and not per sample by sigma: under FSDP2 every rank gathers the
blocks of the expert it runs; ranks of different data-parallel groups whose samples fell on different experts would
issue different all-gathers and hang, and a step running both experts on part-batches pays both experts' gathers and
activations. Per step, every rank of the job runs the same expert; the other expert's gradients stay None, so AdamW
leaves it (and its moments) untouched that step; each expert sees half the steps, as ai-toolkit's switching does with
`switch_boundary_every: 1`.
"""

from __future__ import annotations

from typing import Any

import torch

from train.config import Recipe
from train.models.spec import FamilySpec
from train.step import Objective


def expert_recipes(recipe: Recipe, spec: FamilySpec) -> dict[str, Recipe]:
    """One recipe per expert, high-noise expert first: the one-expert run of it (`model.subfolder` set to it)."""
    return {name: recipe.model_copy(update={"model": recipe.model.model_copy(update={"subfolder": name,
                                                                                     "both_experts": False})})
            for name in spec.experts}  # fmt: skip


def expert_suffix(name: str) -> str:
    """The export folders' suffix of an expert: `transformer` -> "" (`lora/`), `transformer_2` -> "_2" (`lora_2/`)."""
    return name.removeprefix("transformer")


class Experts(torch.nn.Module):
    """The experts of a mixture as one trainable module; `route(step)` picks the expert the step's forwards run and
    returns its objective (its sigma range)."""

    def __init__(self, experts: dict[str, torch.nn.Module], objectives: dict[str, Objective]) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleDict(experts)
        self.objectives = objectives
        self.active = next(iter(experts))

    @property
    def config(self) -> Any:  # the experts share one architecture (Wan 2.2 A14B: two equal configs)
        return self.experts[self.active].config

    def expert_at(self, step: int) -> str:
        """The expert optimizer step `step` (0-based) trains: alternating, the high-noise expert first."""
        names = list(self.experts)
        return names[step % len(names)]

    def route(self, step: int) -> Objective:
        self.active = self.expert_at(step)
        return self.objectives[self.active]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.experts[self.active](*args, **kwargs)

    def set_requires_gradient_sync(self, sync: bool) -> None:  # FSDP2's, on each expert
        for expert in self.experts.values():
            expert.set_requires_gradient_sync(sync)


def build_experts(recipe: Recipe, spec: FamilySpec, mesh, device: torch.device):
    """Both experts, each built as its one-expert run builds it (train/modeling.py `build_model`): (Experts, the
    first expert's Parallelized: the same reduction and CP plan for both)."""
    from train.modeling import build_model

    built = {name: build_model(r, spec, mesh, device) for name, r in expert_recipes(recipe, spec).items()}
    objectives = {name: Objective.of(r, spec) for name, r in expert_recipes(recipe, spec).items()}
    model = Experts({n: m for n, (m, _) in built.items()}, objectives)
    return model, next(iter(built.values()))[1]


def experts_of(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The transformers a model is: {subfolder: expert} of an Experts, else {"transformer": model}."""
    return dict(model.experts.items()) if isinstance(model, Experts) else {"transformer": model}
