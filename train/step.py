"""One micro-batch of the training objective, written once: everything that runs a training step calls it.

    inputs = prepare(spec, batch, objective, generator, model_config=model.config)   # sigmas, noise, conditioning,
    out = forward(model, inputs, amp)                                                # noisy streams, forward kwargs
    loss = loss_of(spec, inputs, out, objective, model_config=model.config)          # predictions, targets, loss

(`micro_batch_loss` is the three in a row, then `preservation_loss` with train.preservation.) The trainer
(train/finetune.py), the estimator's calibration (train/estimate.py), the plan tools and the CP oracle (train/tools/)
and the tests call these; none repeats a rule.

The forward kwargs are the family pipeline's own (`FamilySpec.forward_kwargs`; tests/test_families.py checks them
against each pipeline's real denoising step), and they are the same with and without context parallelism: CP splits
and reorders what the forward builds (train/cp/), it never asks for other inputs. So a serial run of `prepare`'s
kwargs is the pipeline-form reference every CP run must equal.

Randomness: one `torch.Generator` per micro-batch, drawn in a fixed order (sigmas, then noise per stream), so every
rank of a CP group, seeded alike, draws the same values.

Preservation, in the same step: a mixture's per-dataset loss weight (data.datasets[].loss_weight, DreamBooth's prior
preservation: the batch's `loss_weight`, one per sample) multiplies each sample's flow-matching loss; differential
output preservation (train.preservation, `Objective.preservation` its weight) adds `preservation_loss`: the adapted
model's prediction on the preservation prompt (the batch's `preservation.*` text, cached by train.prepare) against the
frozen base's (the trained adapter off, no gradients), both on the step's noisy streams and sigmas. Those two are
forwards like the first, so under CP each is the sharded forward with its output gathered, and the loss stays whole
on every rank: nothing new to reduce.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from train import objective as fm
from train.data.dataset import LOSS_MASK, PRESERVATION, SAMPLE_WEIGHT
from train.errors import UserError
from train.models.spec import FamilySpec

TRAINED_ADAPTER = "default"  # the adapter the run trains (train/modeling.py); a base adapter stays on (base_adapter.py)


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
    preservation: float = 0.0  # train.preservation.weight (differential output preservation); 0 = off

    @classmethod
    def of(cls, recipe: Any, spec: FamilySpec) -> Objective:
        """The objective of a recipe (its `train` section; the expert's range from its `model` section)."""
        from train.models import expert_sigma_range

        t = recipe.train
        return cls(t.timestep_sampling, t.logit_mean, t.logit_std, t.mode_scale, t.loss_weighting, t.frame_sigmas,
                   expert_sigma_range(spec, recipe.model),
                   t.preservation.weight if t.preservation is not None else 0.0)  # fmt: skip


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
    if SAMPLE_WEIGHT in inputs.batch:  # a mixture's per-dataset loss weights: each sample's loss times its own
        w = inputs.batch[SAMPLE_WEIGHT]
        weights = {s: v * w.to(v).reshape(-1, *[1] * (v.ndim - 1)) for s, v in weights.items()}
    keep = {} if inputs.condition is None else {"latents": 1.0 - inputs.condition}
    masks = {"latents": inputs.batch[LOSS_MASK]} if LOSS_MASK in inputs.batch else {}  # a training-only batch key
    return sum(fm.stream_losses(preds, targets, weights, keep, masks).values())


def preservation_inputs(inputs: StepInputs, *, model_config: Mapping[str, Any]) -> StepInputs:
    """The step's inputs with the preservation prompt's text in place of the caption's: the same clean, noise, sigmas
    and noisy streams, the kwargs rebuilt by the family from the swapped batch."""
    spec, batch = inputs.spec, inputs.batch
    text = {k[len(PRESERVATION) :]: v for k, v in batch.items() if k.startswith(PRESERVATION)}
    if not text:
        raise UserError("train.preservation needs each sample's preservation prompt in the cache: run python -m "
                        "train.prepare with the recipe's train.preservation into a new data.cache_dir")  # fmt: skip
    swapped = {**batch, **text}
    element = {**inputs.sigmas, "latents": fm.condition_sigmas(inputs.sigmas["latents"], inputs.condition)}
    kwargs = spec.forward_kwargs(swapped, inputs.noisy, element, model_config=model_config)
    return StepInputs(spec, swapped, inputs.x0, inputs.noise, inputs.sigmas, inputs.condition, inputs.noisy, kwargs)


@contextmanager
def base_only(model: torch.nn.Module) -> Iterator[None]:
    """The frozen base for the block: the trained adapter (`default`) leaves every tuner layer's active adapters (a
    base adapter, finetune.base_adapter, stays: it is part of the base). Set on the layers directly: peft's
    set_adapter would also change which parameters require grad. With its B = 0 start the adapted output equals this
    bit for bit (x + 0 = x)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise UserError("train.preservation compares the adapted model with its base, and this model has no adapter: "
                        "set finetune.method: lora, or train.preservation: null")  # fmt: skip
    before = [m._active_adapter for m in layers]
    try:
        for m in layers:
            m._active_adapter = [a for a in m.active_adapters if a != TRAINED_ADAPTER]
        yield
    finally:
        for m, active in zip(layers, before):
            m._active_adapter = active


def preservation_loss(model: torch.nn.Module, inputs: StepInputs, amp: torch.dtype | None = None) -> torch.Tensor:
    """Differential output preservation: the mean squared error between the adapted model's prediction on the
    preservation prompt and the frozen base's (no gradients), summed over streams; per sample the mean over its
    predicted elements (clean conditioning left out), then the mean over the batch, unweighted (ai-toolkit's
    `mse_loss(dop_pred, prior_pred)`: no timestep weighting, loss mask or dataset weight)."""
    config, spec = model.config, inputs.spec
    pres = preservation_inputs(inputs, model_config=config)
    with torch.no_grad(), base_only(model):
        base = spec.predictions(forward(model, pres, amp), pres.shapes, model_config=config)
    adapted = spec.predictions(forward(model, pres, amp), pres.shapes, model_config=config)
    keep = {} if inputs.condition is None else {"latents": 1.0 - inputs.condition}
    return sum(fm.stream_losses(adapted, {s: b.detach() for s, b in base.items()}, None, keep).values())


def micro_batch_loss(
    model: torch.nn.Module,
    spec: FamilySpec,
    batch: Mapping[str, torch.Tensor],
    objective: Objective,
    generator: torch.Generator,
    amp: torch.dtype | None = None,
    parts: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`prepare` → `forward` → `loss_of` (+ `objective.preservation` × `preservation_loss`): one micro-batch's
    loss, ready for backward. `parts`: given a dict, the terms are put in it, detached (`preservation_loss`,
    unweighted), for the metrics."""
    inputs = prepare(spec, batch, objective, generator, model_config=model.config)
    loss = loss_of(spec, inputs, forward(model, inputs, amp), objective, model_config=model.config)
    if objective.preservation > 0:
        term = preservation_loss(model, inputs, amp)
        loss = loss + objective.preservation * term
        if parts is not None:
            parts["preservation_loss"] = term.detach()
    return loss


def check_preservation(dataset: Any, recipe: Any, spec: FamilySpec | None = None) -> None:
    """train.preservation: every cache holds each sample's preservation prompt, made with the recipe's trigger and
    class word (train.prepare records them in the manifest's settings); a UserError naming the cache otherwise.
    Synthetic data has none. A family that packs one unpadded text layout per batch (`spec.shared_text_length`)
    cannot batch preservation prompts of different lengths: batches of one sample only. From the manifests: the same
    on every rank, seconds before the model is built."""
    from train.data.dataset import CachedLatentDataset, MixedDataset

    pres = recipe.train.preservation
    if pres is None:
        return
    t = recipe.train
    if spec is not None and spec.shared_text_length and (t.batch_size > 1 or t.batch_tokens is not None):
        raise UserError(f"train.preservation: {spec.name} packs one text layout per batch (no text mask), and the "
                        "preservation prompts of a batch may differ in length: set train.batch_size: 1 (and no "
                        "train.batch_tokens) and raise train.grad_accum for a larger effective batch")  # fmt: skip
    want = {"trigger": pres.trigger, "class_word": pres.class_word}
    parts = dataset.parts if isinstance(dataset, MixedDataset) else [dataset]
    fix = "run python -m train.prepare with this recipe's train.preservation into a new data.cache_dir"
    for part in parts:
        if not isinstance(part, CachedLatentDataset):
            raise UserError(f"train.preservation needs the preservation prompts' text embeddings, and synthetic data "
                            f"has none: train on a cache ({fix}), or set train.preservation: null")  # fmt: skip
        made = part.manifest.get("settings", {}).get("preservation")
        if made is None:
            raise UserError(f"cache {part.cache_dir} holds no preservation prompts (it was prepared without "
                            f"train.preservation): {fix}")  # fmt: skip
        if made != want:
            raise UserError(f"cache {part.cache_dir} holds preservation prompts made with {made}, and the recipe's "
                            f"train.preservation says {want}: {fix}, or set those values back")  # fmt: skip
