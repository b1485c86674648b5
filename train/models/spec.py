"""Model-family specs as data.

A :class:`FamilySpec` describes everything the trainer needs to know about one diffusers model family, so that the
trainer never branches on the family name:

* which diffusers classes make up the family (transformer, pipeline, VAE) and which modules LoRA adapts,
* the flow-matching timestep shift of the family's scheduler (:class:`ShiftSpec`),
* how a cached batch plus noisy latents plus timesteps become the transformer's forward kwargs (``build_inputs``), and
  how the transformer output maps back to the latent layout the loss is computed in (``unpack_output``),
* what the pipeline passes as ``timestep`` for a given noise level ``sigma`` (``timestep_from_sigma``),
* how many transformer tokens a sample is (``count_tokens``, for the throughput metric),
* context-parallel quirks (``text_mask_fed_in_cp``).

Everything else about a family (its data encoder, tiny config and tiny pipeline, what the spec does not cover) lives
next to its spec in ``train/models/<family>/``.

Streams
-------
Most families denoise one tensor, the ``"latents"`` stream. MiniMax-H3 denoises video and audio in one forward, so
noisy latents, timesteps and predictions are passed around as mappings from *stream name* to tensor: the primary
stream is always ``"latents"`` (the cached ``batch["latents"]``); :attr:`FamilySpec.extra_streams` names the others
(each is a cached batch key, e.g. ``"audio_latents"``) and their own shift. The family functions therefore have the
signatures::

    build_inputs(batch, noisy_latents: Mapping[str, Tensor], timesteps: Mapping[str, Tensor], *, model_config) -> dict
    unpack_output(out, latents_shapes: Mapping[str, torch.Size], *, model_config) -> dict[str, Tensor]
    count_tokens(latents_shapes: Mapping[str, tuple[int, ...]], model_config) -> int

where ``timesteps`` are already in the model's convention (``timestep_from_sigma(sigmas)``) and ``out`` is whatever
``transformer(**kwargs, return_dict=False)`` returned. :meth:`FamilySpec.forward_kwargs` and
:meth:`FamilySpec.predictions` wrap them (accepting a bare tensor for the primary stream) and apply the CP text-mask
rule and the velocity sign.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch
from diffusers.utils import BaseOutput

PRIMARY_STREAM = "latents"

BuildInputs = Callable[..., dict[str, Any]]
UnpackOutput = Callable[..., dict[str, torch.Tensor]]
CountTokens = Callable[[Mapping[str, tuple[int, ...]], Mapping[str, Any]], int]


def frozen(mapping: Mapping[str, Any] | None = None, **kwargs: Any) -> Mapping[str, Any]:
    """A read-only mapping (for dataclass fields that must stay immutable)."""
    return MappingProxyType({**(mapping or {}), **kwargs})


@dataclass(frozen=True, eq=False)
class ShiftSpec:
    """The flow-matching timestep shift a family's scheduler applies to a base sigma ``u`` in [0, 1].

    ``kind="static"``: ``sigma = shift * u / (1 + (shift - 1) * u)`` (FlowMatchEulerDiscreteScheduler ``shift``,
    UniPCMultistepScheduler ``flow_shift``, MiniMaxH3Scheduler ``shift``).

    ``kind="dynamic"``: resolution dependent, ``sigma = FlowMatchEulerDiscreteScheduler.time_shift(mu, 1.0, u)`` with
    ``mu = mu_fn(image_seq_len)``, where ``mu_fn`` is the pipeline's own ``calculate_shift`` (or, for Flux.2,
    ``compute_empirical_mu``) bound to the checkpoint's scheduler config.

    ``scheduler_class`` / ``scheduler_config`` record the reference checkpoint's ``scheduler/scheduler_config.json``
    (the relevant keys), for documentation and for the tests that compare against the scheduler itself. Inference-only
    settings of that config (``shift_terminal`` stretching, which depends on the last step of an inference schedule)
    are not applied to training sigmas.
    """

    kind: Literal["static", "dynamic"]
    scheduler_class: str
    scheduler_config: Mapping[str, Any]
    shift: float = 1.0
    mu_fn: Callable[[int], float] | None = None
    time_shift_type: Literal["exponential", "linear"] = "exponential"

    def __post_init__(self) -> None:
        if self.kind not in ("static", "dynamic"):
            raise ValueError(f"ShiftSpec.kind must be 'static' or 'dynamic', got {self.kind!r}")
        if self.kind == "dynamic" and self.mu_fn is None:
            raise ValueError("a dynamic ShiftSpec needs mu_fn")
        if self.kind == "static" and self.shift <= 0:
            raise ValueError(f"shift must be positive, got {self.shift}")

    @classmethod
    def linear_mu(cls, scheduler_config: Mapping[str, Any], calculate_shift: Callable[..., float]) -> ShiftSpec:
        """Dynamic shift whose mu is the pipeline's `calculate_shift` (linear in the sequence length) bound to the
        config's base/max sequence lengths and shifts: Flux, Qwen-Image, LTX-Video."""
        c = scheduler_config
        return cls(
            kind="dynamic",
            scheduler_class="FlowMatchEulerDiscreteScheduler",
            scheduler_config=c,
            shift=c["shift"],
            mu_fn=functools.partial(
                calculate_shift,
                base_seq_len=c["base_image_seq_len"],
                max_seq_len=c["max_image_seq_len"],
                base_shift=c["base_shift"],
                max_shift=c["max_shift"],
            ),
        )

    def mu(self, image_seq_len: int) -> float:
        if self.mu_fn is None:
            raise ValueError("static shift has no mu")
        return float(self.mu_fn(int(image_seq_len)))


@dataclass(frozen=True, eq=False)
class FamilySpec:
    """One model family, as data. See the module docstring for the function signatures."""

    name: str
    transformer_class: str
    pipeline_class: str
    vae_class: str
    latent_kind: Literal["image", "video"]
    # Module-name suffixes to adapt with LoRA (peft ``target_modules``).
    lora_targets: tuple[str, ...]
    # Shift of the primary ("latents") stream.
    shift: ShiftSpec
    build_inputs: BuildInputs
    unpack_output: UnpackOutput
    # sigmas (B,) -> the ``timestep`` the pipeline passes to the transformer.
    timestep_from_sigma: Callable[[torch.Tensor], torch.Tensor]
    # Per-sample latent shapes of the noised streams + the transformer config -> transformer tokens (see
    # tokens_per_sample).
    count_tokens: CountTokens
    # Cache keys build_inputs reads (besides the noisy streams); optional keys are not listed.
    batch_keys: tuple[str, ...]
    # Per-sample latent shape (C, ...) of the primary stream -> the ``image_seq_len`` the pipeline's dynamic shift uses
    # (None: the shift is static and does not depend on the resolution).
    shift_seq_len: Callable[[Sequence[int]], int] | None = None
    # False only where the family has a text mask that can't be fed under context parallelism (the processor turns it
    # into a per-head mask Ulysses can't shard): the trainer passes ``None`` instead (see forward_kwargs).
    text_mask_fed_in_cp: bool = True
    # True where the forward needs a mask tensor (HunyuanVideo sums it): where the mask is not fed under CP, the trainer
    # passes an all-ones mask over the cut text instead of ``None``.
    text_mask_required: bool = False
    # Forward kwarg that carries the text mask, and the one that carries the text tokens (None: no text mask).
    text_mask_kwarg: str | None = None
    text_kwarg: str = "encoder_hidden_states"
    # Other noised streams (cached batch key -> its shift), e.g. MiniMax-H3's audio.
    extra_streams: Mapping[str, ShiftSpec] = field(default_factory=frozen)
    # True: the transformer takes one timestep layout for the whole batch, so all samples share one sigma.
    shared_timestep: bool = False
    # True: the transformer packs one unpadded text layout for the whole batch (no text mask), so every sample of a
    # batch needs the same text length (MiniMax-H3); checked against the cache at startup.
    shared_text_length: bool = False
    # +1: the transformer predicts ``noise - x0`` (diffusers flow matching); -1: it predicts ``x0 - noise``.
    velocity_sign: float = 1.0
    # (batch, latents (B, C, ...)) -> a 0/1 mask broadcastable to the primary latents, 1 where an element is clean
    # conditioning (Wan 2.2 TI2V's and LTX image-to-video's first latent frame), or None. Masked elements are not
    # noised, their timestep is 0 and the loss skips them; ``timesteps["latents"]`` given to build_inputs is then per
    # element, ``timestep_from_sigma(sigma * (1 - mask))`` shaped like the mask, and build_inputs turns it into the
    # per-token timestep the transformer takes. None (the field): every element is noised, timesteps are (B,).
    condition_mask: Callable[[Mapping[str, Any], torch.Tensor], torch.Tensor | None] | None = None
    # Mixture-of-experts checkpoints (Wan 2.2 A14B): the transformer subfolders from the high-noise expert to the
    # low-noise one. A recipe trains one (model.subfolder); its sigmas are drawn only from that expert's range, split
    # at the pipeline's boundary_ratio (see train.models.expert_sigma_range). Empty: one transformer.
    experts: tuple[str, ...] = ()
    # How the primary stream's sigmas vary along the latent frames (dim 2 of video latents (B, C, F, H, W)), the
    # default of recipe key train.frame_sigmas: "shared" = one per sample, (B,); "independent" = one per frame, drawn
    # independently, (B, 1, F, 1, 1); "non_decreasing" = the same draws sorted along F, later frames at least as noisy
    # (diffusion forcing: SkyReels-V2 DF). Per-frame sigmas reach build_inputs as per-element timesteps (B, 1, F, 1, 1)
    # and weight the loss per element. Only families whose transformer takes a per-frame timestep set another value.
    frame_sigmas: Literal["shared", "independent", "non_decreasing"] = "shared"

    def __post_init__(self) -> None:
        if self.latent_kind not in ("image", "video"):
            raise ValueError(f"latent_kind must be 'image' or 'video', got {self.latent_kind!r}")
        if PRIMARY_STREAM in self.extra_streams:
            raise ValueError(f"{PRIMARY_STREAM!r} is the primary stream, not an extra one")
        shifts = (self.shift, *self.extra_streams.values())
        if self.shift_seq_len is None and any(s.kind == "dynamic" for s in shifts):
            raise ValueError(f"{self.name}: a dynamic shift needs shift_seq_len")

    # Streams -----------------------------------------------------------------------------------------------------

    @property
    def streams(self) -> tuple[str, ...]:
        """Names of the noised streams: ``"latents"`` first, then :attr:`extra_streams`."""
        return (PRIMARY_STREAM, *self.extra_streams)

    def stream_shift(self, stream: str = PRIMARY_STREAM) -> ShiftSpec:
        if stream == PRIMARY_STREAM:
            return self.shift
        if stream not in self.extra_streams:
            raise KeyError(f"{self.name}: unknown stream {stream!r}; streams are {self.streams}")
        return self.extra_streams[stream]

    def image_seq_len(self, latents_shape: Sequence[int]) -> int | None:
        """``image_seq_len`` for the dynamic shift, from the per-sample shape (C, ...) of the primary latents; None for
        a static shift (it does not depend on the resolution)."""
        return None if self.shift_seq_len is None else int(self.shift_seq_len(tuple(latents_shape)))

    def tokens_per_sample(self, latents_shapes: Mapping[str, Sequence[int]], model_config: Mapping[str, Any]) -> int:
        """Transformer tokens of one sample: the noised streams after patching, from their per-sample shapes (C, ...).

        Video/image latents count their tokens after the transformer's patch size (Flux's 2x2 packing, Wan's 1x2x2
        patches, ...), MiniMax-H3 adds its audio rows. Text tokens are not counted: they are conditioning, their
        length is set by the tokenizer and padding rather than by the data, and some families never split them under
        CP. This is the throughput metric's unit (``transformer_tokens_per_s``).
        """
        return int(self.count_tokens({k: tuple(v) for k, v in latents_shapes.items()}, model_config))

    # Forward / output --------------------------------------------------------------------------------------------

    def model_timesteps(self, sigmas: torch.Tensor | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: self.timestep_from_sigma(v) for k, v in _as_streams(sigmas).items()}

    def conditioning(self, batch: Mapping[str, Any], latents: torch.Tensor) -> torch.Tensor | None:
        """The clean-conditioning mask of the primary latents (see :attr:`condition_mask`), as the latents' dtype."""
        if self.condition_mask is None:
            return None
        mask = self.condition_mask(batch, latents)
        if mask is None:
            return None
        if mask.ndim != latents.ndim or torch.broadcast_shapes(mask.shape, latents.shape) != latents.shape:
            raise ValueError(f"{self.name}: condition mask {tuple(mask.shape)} does not broadcast to {latents.shape}")
        return mask.to(device=latents.device, dtype=latents.dtype)

    def forward_kwargs(
        self,
        batch: Mapping[str, Any],
        noisy_latents: torch.Tensor | Mapping[str, torch.Tensor],
        sigmas: torch.Tensor | Mapping[str, torch.Tensor],
        *,
        model_config: Mapping[str, Any],
        cp: bool = False,
    ) -> dict[str, Any]:
        """Transformer kwargs for one training step (add ``return_dict=False`` when calling).

        With ``cp=True`` and ``text_mask_fed_in_cp=False`` the text mask is replaced by ``None`` (all ones where
        ``text_mask_required``); since that would let the model attend to padding tokens, the text is first cut to the
        longest unpadded prompt of the batch (exact for a batch of one; shorter prompts in a larger batch still see some
        padding).
        """
        noisy = _as_streams(noisy_latents)
        missing = [s for s in self.streams if s not in noisy]
        if missing:
            raise KeyError(f"{self.name}: noisy latents missing for streams {missing}")
        kwargs = self.build_inputs(batch, noisy, self.model_timesteps(sigmas), model_config=model_config)
        if cp and not self.text_mask_fed_in_cp and self.text_mask_kwarg is not None:
            mask = kwargs.get(self.text_mask_kwarg)
            if mask is not None:
                kwargs[self.text_kwarg] = trim_text_padding(kwargs[self.text_kwarg], mask)
            text = kwargs[self.text_kwarg]
            ones = None if mask is None else mask.new_ones(text.shape[:2])
            kwargs[self.text_mask_kwarg] = ones if self.text_mask_required else None
        return kwargs

    def predictions(
        self,
        out: Any,
        latents_shapes: torch.Size | Sequence[int] | Mapping[str, Sequence[int]],
        *,
        model_config: Mapping[str, Any],
    ) -> dict[str, torch.Tensor]:
        """The model's velocity prediction per stream, in the cached latent layout and the ``noise - x0`` convention."""
        if not isinstance(latents_shapes, Mapping):
            latents_shapes = {PRIMARY_STREAM: latents_shapes}
        shapes = {k: torch.Size(v) for k, v in latents_shapes.items()}
        preds = self.unpack_output(out, shapes, model_config=model_config)
        if self.velocity_sign != 1.0:
            preds = {k: v * self.velocity_sign for k, v in preds.items()}
        return preds


# Helpers shared by the family modules ---------------------------------------------------------------------------------


def _as_streams(value: torch.Tensor | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {PRIMARY_STREAM: value}
    return dict(value)


def output_tensors(out: Any) -> tuple[torch.Tensor, ...]:
    """The tensors of a transformer output (a tensor, a tuple from ``return_dict=False`` or a ``BaseOutput``)."""
    if isinstance(out, BaseOutput):
        out = out.to_tuple()
    if isinstance(out, torch.Tensor):
        return (out,)
    return tuple(out)


def trim_text_padding(text: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cut (B, L, D) text to the last position any sample of the batch keeps in its (B, L) key-padding mask."""
    keep = mask.bool().any(dim=0)
    length = int(keep.nonzero().max().item()) + 1 if bool(keep.any()) else text.shape[1]
    return text[:, :length]


def uniform_value(values: torch.Tensor, what: str) -> float:
    """The one value of a tensor whose entries must all be equal (e.g. a per-batch scalar)."""
    flat = values.reshape(-1)
    if flat.numel() == 0:
        raise ValueError(f"{what}: empty")
    if not bool((flat == flat[0]).all()):
        raise ValueError(f"{what} must be the same for every sample of the batch, got {flat.tolist()}")
    return float(flat[0].item())


def sigma_identity(sigmas: torch.Tensor) -> torch.Tensor:
    """``timestep = t / 1000 = sigma`` (Flux, Flux.2, Qwen-Image pass ``timestep / 1000``)."""
    return sigmas


def sigma_times_1000(sigmas: torch.Tensor) -> torch.Tensor:
    """``timestep = sigma * num_train_timesteps`` in [0, 1000] (Wan, ChronoEdit, LTX-Video)."""
    return sigmas * 1000.0


def one_minus_sigma(sigmas: torch.Tensor) -> torch.Tensor:
    """``timestep = 1 - sigma`` in [0, 1], 1 = clean (MiniMax-H3)."""
    return 1.0 - sigmas


def patched_tokens(latents_shape: Sequence[int], patch_size: Sequence[int] | int) -> int:
    """Tokens of one sample's (C, *grid) latents cut into ``patch_size`` patches (one size per grid axis, or one for
    every axis)."""
    grid = tuple(latents_shape[1:])
    patch = (patch_size,) * len(grid) if isinstance(patch_size, int) else tuple(patch_size)
    if len(patch) != len(grid):
        raise ValueError(f"patch size {patch} does not fit the latent grid {grid}")
    tokens = 1
    for size, p in zip(grid, patch, strict=True):
        tokens *= int(size) // int(p)
    return tokens
