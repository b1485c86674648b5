"""The serial oracle every CP comparison is made against, and the comparison itself.

The serial side is the plain diffusers transformer, no CP anywhere, run on one training step's inputs exactly as the
family's pipeline builds them (train/step.py `prepare`: the whole text with its real padding mask, every sample of
the batch; tests/test_families.py checks those kwargs against each pipeline's own denoising step). The CP side runs the
same step on a model with `enable_context_parallel` and its gradients SUM-reduced over the CP group. Nothing of the CP
code builds the reference: a CP bug (a mask placed wrongly, a per-token tensor built from local shapes, a missing
reduction) shows as a difference.

    serial = run_step(build(), inputs)                              # the reference
    cp = run_step(cp_model, inputs, reduce=reduction.reduce_gradients)
    errors = compare(cp, serial)                                    # output (abs), loss and each gradient (rel)

Relative errors are max|cp - serial| / max|serial| per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from train.models.spec import output_tensors
from train.step import Objective, StepInputs, forward, loss_of

__all__ = ["Errors", "StepResult", "compare", "rel", "run_step"]


@dataclass
class StepResult:
    """One forward + backward of a step: the model's output tensors, the loss and every trainable gradient."""

    outputs: tuple[torch.Tensor, ...]
    loss: float
    grads: dict[str, torch.Tensor]


@dataclass
class Errors:
    """How far a CP run is from the serial one."""

    out: float  # max absolute difference of the outputs (O(1) values)
    loss: float  # relative
    grads: dict[str, float]  # relative, per parameter

    @property
    def grad(self) -> float:
        return max(self.grads.values(), default=0.0)

    @property
    def worst(self) -> str:
        return max(self.grads, key=self.grads.get) if self.grads else ""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (inf when the shapes differ)."""
    if a.shape != b.shape:
        return float("inf")
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def run_step(
    model: torch.nn.Module,
    inputs: StepInputs,
    objective: Objective | None = None,
    reduce: Callable[[Iterable[torch.nn.Parameter]], None] | None = None,
) -> StepResult:
    """Forward, the step's loss and backward on `model` (gradients zeroed first); `reduce` (CP: SUM over the group)
    runs on the parameters before they are read."""
    objective = objective or Objective()
    model.zero_grad(set_to_none=True)
    out = forward(model, inputs)
    loss = loss_of(inputs.spec, inputs, out, objective, model_config=model.config)
    loss.backward()
    if reduce is not None:
        reduce(model.parameters())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return StepResult(tuple(t.detach() for t in output_tensors(out)), loss.item(), grads)


def compare(cp: StepResult, serial: StepResult) -> Errors:
    missing = set(serial.grads) ^ set(cp.grads)
    if missing:
        raise AssertionError(f"the runs train different parameters: {sorted(missing)[:5]}")
    out = max((float((a.double() - b.double()).abs().max()) if a.shape == b.shape else float("inf"))
              for a, b in zip(cp.outputs, serial.outputs))  # fmt: skip
    loss = abs(cp.loss - serial.loss) / max(abs(serial.loss), 1e-30)
    return Errors(out, loss, {n: rel(cp.grads[n], g) for n, g in serial.grads.items()})
