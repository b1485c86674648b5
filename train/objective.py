"""The rectified-flow (flow-matching) objective shared by every family.

The pieces of one step, which train/step.py runs in this order for every micro-batch (``x0`` a stream's cached
latents, ``cond`` the family's clean-conditioning mask or None, ``masks`` the cache's loss masks, if it has them)::

    sigmas = sample_stream_sigmas(B, spec, ..., generator=g)    # per stream: (B,), or (B, 1, F, 1, 1) per frame
    noise  = sample_noise(x0.shape, generator=g)                 # per stream
    sigma  = condition_sigmas(sigmas["latents"], cond)           # 0 on clean conditioning elements
    noisy  = add_noise(x0, noise, sigma)                         # (1 - sigma) * x0 + sigma * noise
    target = flow_matching_target(x0, noise)                     # noise - x0
    loss   = sum(stream_losses(preds, targets, weights, keep, masks).values())  # weights: loss_weight(sigmas, scheme)

The density of the base draw ``u`` comes from ``diffusers.training_utils.compute_density_for_timestep_sampling`` and the
loss weighting from ``compute_loss_weighting_for_sd3`` (the SD3 / Flux / Qwen-Image training recipes); the shift is
the family scheduler's (:class:`train.models.ShiftSpec`). Unlike the diffusers training examples, which index the
scheduler's 1000 unshifted training timesteps, sigmas are continuous and shifted as the family's pipeline shifts its
inference schedule (static shift, or resolution-dependent ``mu`` from ``image_seq_len``).

All randomness comes from an explicit ``torch.Generator``: context-parallel peers seeded alike draw identical sigmas
and noise.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from .models.spec import PRIMARY_STREAM, FamilySpec, ShiftSpec

SamplingScheme = Literal["logit_normal", "uniform", "mode"]
WeightingScheme = Literal["none", "sigma_sqrt", "cosmap"]

# Sigmas are clamped to [SIGMA_EPS, 1 - SIGMA_EPS]: sigma = 0 would make the sample clean (and `sigma_sqrt` weighting
# infinite), sigma = 1 pure noise.
SIGMA_EPS = 1e-5


def sample_base(
    batch_size: int,
    *,
    scheme: SamplingScheme = "logit_normal",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    generator: torch.Generator,
) -> torch.Tensor:
    """Unshifted base sigmas ``u`` (B,) float32 on the generator's device, via diffusers' density sampler."""
    if generator is None:
        raise ValueError("pass an explicit torch.Generator (CP peers must draw identical timesteps)")
    return compute_density_for_timestep_sampling(
        weighting_scheme=scheme,
        batch_size=batch_size,
        logit_mean=logit_mean,
        logit_std=logit_std,
        mode_scale=mode_scale,
        device=generator.device,
        generator=generator,
    ).float()


@functools.lru_cache(maxsize=4)
def _time_shift_scheduler(time_shift_type: str) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type=time_shift_type)


def shift_sigmas(u: torch.Tensor, shift: ShiftSpec, image_seq_len: int | None = None) -> torch.Tensor:
    """Apply a family's shift to base sigmas ``u`` in [0, 1] (computed in float64, returned in ``u``'s dtype).

    Static: ``shift * u / (1 + (shift - 1) * u)``, the formula of FlowMatchEulerDiscreteScheduler / UniPC flow sigmas
    / MiniMaxH3Scheduler. Dynamic: ``FlowMatchEulerDiscreteScheduler.time_shift(mu, 1.0, u)`` with
    ``mu = shift.mu(image_seq_len)``, as the pipeline computes it for the sample's resolution.
    """
    x = u.double()
    if shift.kind == "static":
        out = shift.shift * x / (1 + (shift.shift - 1) * x)
    else:
        if image_seq_len is None:
            raise ValueError("this family shifts timesteps by resolution: pass image_seq_len (spec.image_seq_len(...))")
        out = _time_shift_scheduler(shift.time_shift_type).time_shift(shift.mu(image_seq_len), 1.0, x)
    return out.to(u.dtype)


def sample_stream_sigmas(
    batch_size: int,
    spec: FamilySpec,
    *,
    scheme: SamplingScheme = "logit_normal",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    image_seq_len: int | None = None,
    sigma_range: tuple[float, float] | None = None,
    frames: int | None = None,
    frame_sigmas: str | None = None,
    generator: torch.Generator,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Sigmas (B,) per stream of ``spec`` (``"latents"`` first), all from ONE base draw through each stream's shift.

    Per-frame sigmas (``frame_sigmas``, default ``spec.frame_sigmas``; ``frames``: the primary latents' frame count):
    the primary stream gets (B, 1, F, 1, 1) from B * F base draws (sorted along F for ``"non_decreasing"``), the
    other streams keep (B,) from the first frame's draw. CP peers seeded alike draw identical values.

    Families with ``shared_timestep`` draw one base value for the whole batch. The generator is advanced identically
    whatever the family's streams are. ``sigma_range`` (lo, hi): the primary stream's sigmas must fall in it (one expert
    of a mixture, e.g. Wan 2.2 A14B): the base draw is mapped linearly onto the preimage of the range under the shift,
    so the density keeps its shape inside the range and nothing is drawn outside it.
    """
    per_frame = (frame_sigmas or spec.frame_sigmas) != "shared" and frames is not None  # no frame count: (B,)
    if per_frame and spec.frame_sigmas == "shared":
        from train.errors import UserError

        raise UserError(f"train.frame_sigmas: {frame_sigmas} needs a transformer that takes one timestep per latent "
                        f"frame, and {spec.name}'s takes one per sample; set train.frame_sigmas: null")  # fmt: skip
    draws = 1 if spec.shared_timestep else batch_size
    u = sample_base(
        draws * (frames if per_frame else 1), scheme=scheme, logit_mean=logit_mean, logit_std=logit_std,
        mode_scale=mode_scale, generator=generator,
    ).reshape(draws, -1).expand(batch_size, -1)  # fmt: skip
    if per_frame and (frame_sigmas or spec.frame_sigmas) == "non_decreasing":
        u = u.sort(dim=1).values  # the shift is monotonic: sorted base draws give non-decreasing sigmas
    u = u.reshape(batch_size, 1, -1, 1, 1) if per_frame else u[:, 0]
    if sigma_range is not None:
        lo, hi = (unshift_sigma(s, spec.stream_shift(), image_seq_len) for s in sigma_range)
        u = lo + (hi - lo) * u
    out = {}
    for stream in spec.streams:
        base = u if stream == PRIMARY_STREAM or not per_frame else u[:, 0, 0, 0, 0]
        sigmas = shift_sigmas(base, spec.stream_shift(stream), image_seq_len).clamp(SIGMA_EPS, 1.0 - SIGMA_EPS)
        out[stream] = sigmas.contiguous().to(device if device is not None else sigmas.device)
    return out


def unshift_sigma(sigma: float, shift: ShiftSpec, image_seq_len: int | None = None) -> float:
    """The base value ``u`` that :func:`shift_sigmas` maps to ``sigma`` (the shift is monotonic in ``u``)."""
    if not 0.0 <= sigma <= 1.0:
        raise ValueError(f"sigma {sigma} is outside [0, 1]")
    if shift.kind == "static":
        return sigma / (shift.shift - (shift.shift - 1.0) * sigma)
    lo, hi = 0.0, 1.0  # dynamic shifts: bisection on the monotonic map
    for _ in range(60):
        mid = (lo + hi) / 2
        if float(shift_sigmas(torch.tensor([mid], dtype=torch.float64), shift, image_seq_len)) < sigma:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def sample_noise(
    shape: Sequence[int],
    *,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard normal noise drawn (in float32) on the generator's device, then moved to ``device`` / ``dtype``."""
    noise = torch.randn(tuple(shape), generator=generator, device=generator.device, dtype=torch.float32)
    return noise.to(device=device if device is not None else noise.device, dtype=dtype)


def _expand(sigmas: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    sigmas = sigmas.to(device=like.device, dtype=like.dtype)
    if sigmas.ndim == like.ndim:  # already per element (conditioned latents): broadcast as is
        return sigmas
    return sigmas.reshape(sigmas.shape[0], *([1] * (like.ndim - 1)))


def condition_sigmas(sigmas: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Per-element sigmas ``sigma * (1 - mask)`` shaped like ``mask`` (clean conditioning has sigma 0); ``sigmas``
    (B,) unchanged when there is no mask."""
    if mask is None:
        return sigmas
    return _expand(sigmas, mask) * (1.0 - mask)


def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """``(1 - sigma) * x0 + sigma * noise`` with ``sigma`` (B,) broadcast over each sample, or per element (a tensor
    of x0's rank that broadcasts to it, from :func:`condition_sigmas`)."""
    s = _expand(sigmas, x0)
    return (1.0 - s) * x0 + s * noise


def flow_matching_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity target ``noise - x0`` (predictions are mapped to this convention by ``FamilySpec.predictions``)."""
    return noise - x0


def loss_weight(sigmas: torch.Tensor, scheme: WeightingScheme = "none") -> torch.Tensor:
    """Per-sample loss weights (B,) via ``compute_loss_weighting_for_sd3`` (float32, float64 for float64 sigmas)."""
    return compute_loss_weighting_for_sd3(weighting_scheme=scheme, sigmas=sigmas).to(
        torch.promote_types(sigmas.dtype, torch.float32)
    )


def flow_matching_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scalar loss, float32 (float64 for float64 predictions, so exactness tests see every digit): per sample, the
    mean over elements of ``(pred - target)**2``, times that sample's weight; then the mean over the batch (the
    diffusers flow-matching training examples' reduction). ``keep``: a 0/1 mask broadcastable to ``pred``; the
    per-sample mean is then over the kept elements only (conditioning left out).

    ``mask``: the data's loss mask (``loss_mask``, (B, 1, ...) in [0, 1], broadcast over channels). It multiplies each
    element's squared error and leaves the normalisation alone: the mean is still over every (kept) element, masked-out
    ones counting as zeros, as kohya's sd-scripts and diffusion-pipe reduce their masked losses. So an all-ones mask
    gives exactly the unmasked loss, and a sample's loss scales with its masked area (a small subject weighs less than
    a whole frame, not more)."""
    if pred.shape != target.shape:
        raise ValueError(f"prediction {tuple(pred.shape)} and target {tuple(target.shape)} differ in shape")
    acc = torch.promote_types(pred.dtype, torch.float32)
    err = (pred.to(acc) - target.to(acc)).pow(2)
    if mask is not None:  # x * 1.0 is exact: an all-ones mask changes no bit
        err = err * mask.to(device=err.device, dtype=err.dtype)
    if weights is not None and weights.ndim > 1:  # per element (per-frame sigmas): weight each element, then mean
        err, weights = err * weights.to(device=err.device, dtype=err.dtype), None
    if keep is None:
        per_sample = err.reshape(pred.shape[0], -1).mean(dim=1)
    else:
        keep = keep.to(device=err.device, dtype=err.dtype).expand_as(err).reshape(pred.shape[0], -1)
        per_sample = (err.reshape(pred.shape[0], -1) * keep).sum(dim=1) / keep.sum(dim=1).clamp_min(1.0)
    if weights is not None:
        per_sample = per_sample * weights.to(device=per_sample.device, dtype=acc).reshape(-1)
    return per_sample.mean()


def stream_losses(
    preds: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor] | None = None,
    keep: Mapping[str, torch.Tensor] | None = None,
    masks: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`flow_matching_loss` per stream (sum them, or weight them, for the step's loss); ``keep`` and ``masks``
    (loss masks) per stream (streams without one keep every element, unmasked)."""
    keep, masks = keep or {}, masks or {}
    return {
        k: flow_matching_loss(preds[k], targets[k], None if weights is None else weights[k], keep.get(k), masks.get(k))
        for k in targets
    }
