"""Model-family specs as data.

A :class:`FamilySpec` describes everything the trainer needs to know about one diffusers model family, so that the
trainer never branches on the family name:

* which diffusers classes make up the family (transformer, pipeline, VAE) and which modules LoRA adapts,
* the flow-matching timestep shift of the family's scheduler (:class:`ShiftSpec`),
* how a cached batch plus noisy latents plus timesteps become the transformer's forward kwargs (``build_inputs``), and
  how the transformer output maps back to the latent layout the loss is computed in (``unpack_output``; default: the
  first output tensor is the prediction, already in the cached layout),
* what the pipeline passes as ``timestep`` for a given noise level ``sigma`` (``timestep_from_sigma``),
* how many transformer tokens a sample is (for the throughput metric: by default the latent grid cut into the
  transformer's :class:`Patch`; ``count_tokens`` where a family counts otherwise).

The forward kwargs are the pipeline's, with and without context parallelism: CP needs no other inputs. A spec states
what differs from the defaults; a variant is its base spec through ``dataclasses.replace`` (or
:meth:`FamilySpec.with_appended_latents`). No pipeline module is imported to build a spec: the family functions import
the pipeline helpers they call when first called (:class:`PipelineFunction` for the shift's ``mu``), so reading the
specs stays cheap.

Everything else about a family (its data encoder, tiny pipeline, what the spec does not cover) lives next to its spec
in ``train/models/<family>/``.

Streams
-------
Most families denoise one tensor, the ``"latents"`` stream. MiniMax-H3 denoises video and audio in one forward, so
noisy latents, timesteps and predictions are passed around as mappings from *stream name* to tensor: the primary
stream is always ``"latents"`` (the cached ``batch["latents"]``); :attr:`FamilySpec.extra_streams` names the others
(each is a cached batch key, e.g. ``"audio_latents"``) and their own shift. The family functions therefore have the
signatures::

    build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict
    unpack_output(out, latents_shapes: Shapes, *, model_config: Config) -> dict[str, Tensor]
    count_tokens(latents_shapes: Mapping[str, tuple[int, ...]], model_config: Config) -> int

where ``timesteps`` are already in the model's convention (``timestep_from_sigma(sigmas)``) and ``out`` is whatever
``transformer(**kwargs, return_dict=False)`` returned. :meth:`FamilySpec.forward_kwargs` and
:meth:`FamilySpec.predictions` wrap them (accepting a bare tensor for the primary stream) and apply the velocity sign.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import torch

from train.lora_format import LoraFormat

PRIMARY_STREAM = "latents"

Batch = Mapping[str, Any]  # a collated cache batch: cache key -> (B, ...) tensor
Streams = Mapping[str, torch.Tensor]  # stream name -> tensor (noisy latents, timesteps)
Shapes = Mapping[str, torch.Size]  # stream name -> the (B, C, ...) latents shape
Config = Mapping[str, Any]  # the transformer's config
BuildInputs = Callable[..., dict[str, Any]]
UnpackOutput = Callable[..., dict[str, torch.Tensor]]
CountTokens = Callable[[Mapping[str, tuple[int, ...]], Config], int]


def frozen(mapping: Mapping[str, Any] | None = None, **kwargs: Any) -> Mapping[str, Any]:
    """A read-only mapping (for dataclass fields that must stay immutable)."""
    return MappingProxyType({**(mapping or {}), **kwargs})


# FlowMatchEulerDiscreteScheduler's defaults of the scheduler_config.json keys the shift reads: a released config states
# what differs.
FLOW_MATCH_EULER = frozen(
    {
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "use_dynamic_shifting": False,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
    }
)


@dataclass(frozen=True)
class PipelineFunction:
    """``module.name`` (a diffusers pipeline helper, e.g. ``calculate_shift``), imported on its first call: a spec can
    hold the pipeline's own function without importing the pipeline module (and the transformers models it pulls in)
    whenever the specs are read."""

    module: str
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)


def output_tensors(out: Any) -> tuple[torch.Tensor, ...]:
    """The tensors of a transformer output (a tensor, a tuple from ``return_dict=False`` or a ``BaseOutput``)."""
    from diffusers.utils import BaseOutput

    if isinstance(out, BaseOutput):
        out = out.to_tuple()
    if isinstance(out, torch.Tensor):
        return (out,)
    # a list of per-sample tensors (Z-Image's output) counts as its tensors
    return tuple(t for o in out for t in (o if isinstance(o, (list, tuple)) else [o]))


def first_output(out: Any, latents_shapes: Shapes, *, model_config: Config) -> dict[str, torch.Tensor]:
    """The default ``unpack_output``: the first output tensor is the primary stream's prediction, in the cached layout
    already (the transformer unpatchifies it itself: Wan, HunyuanVideo)."""
    return {PRIMARY_STREAM: output_tensors(out)[0]}


def config_attention_shape(config: Config) -> tuple[int, int]:
    """(attention heads, head dim) from diffusers' usual config keys ``num_attention_heads``, ``attention_head_dim``."""
    return int(config["num_attention_heads"]), int(config["attention_head_dim"])


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


@dataclass(frozen=True)
class Patch:
    """The transformer's patch over one sample's latent grid (the axes after C), read from its config.

    ``sizes``: the config key that holds the whole per-axis patch (Wan's ``patch_size`` (1, 2, 2)), or one entry per
    grid axis, each a config key or a fixed size (HunyuanVideo's ``("patch_size_t", "patch_size", "patch_size")``;
    FLUX.1's ``(2, 2)``, the pipeline's packing). ``defaults``: the values of keys a config may lack.
    """

    sizes: str | tuple[int | str, ...]
    defaults: Mapping[str, Any] = field(default_factory=frozen)

    @classmethod
    def time_space(cls, patch_size_t: int, patch_size: int) -> Patch:
        """``patch_size_t`` frames x ``patch_size`` x ``patch_size`` latent pixels: the config keys of the transformers
        that patch time and space apart (HunyuanVideo, LTX-Video), with the defaults of their class."""
        return cls(
            ("patch_size_t", "patch_size", "patch_size"), frozen(patch_size_t=patch_size_t, patch_size=patch_size)
        )

    def of(self, model_config: Config | None) -> tuple[int, ...]:
        """The per-axis patch size for ``model_config`` (None: the defaults)."""
        config = {**self.defaults, **(model_config or {})}
        if isinstance(self.sizes, str):
            return tuple(int(p) for p in config[self.sizes])
        return tuple(int(config[s]) if isinstance(s, str) else s for s in self.sizes)


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
    def static(
        cls, scheduler_config: Mapping[str, Any], scheduler_class: str = "FlowMatchEulerDiscreteScheduler"
    ) -> ShiftSpec:
        """The fixed shift a scheduler config holds: UniPCMultistepScheduler's ``flow_shift``, the other schedulers'
        ``shift`` (FlowMatchEulerDiscreteScheduler, MiniMaxH3Scheduler)."""
        key = "flow_shift" if scheduler_class == "UniPCMultistepScheduler" else "shift"
        return cls(
            kind="static",
            scheduler_class=scheduler_class,
            scheduler_config=scheduler_config,
            shift=scheduler_config[key],
        )

    @classmethod
    def dynamic(cls, mu_fn: Callable[[int], float], **config: Any) -> ShiftSpec:
        """Resolution-dependent shift of a FlowMatchEulerDiscreteScheduler with dynamic shifting whose
        scheduler_config.json holds the class defaults (:data:`FLOW_MATCH_EULER`) but ``config``; ``mu_fn``: the
        pipeline's mu of ``image_seq_len``."""
        config = frozen(FLOW_MATCH_EULER, use_dynamic_shifting=True, **config)
        return cls(
            kind="dynamic",
            scheduler_class="FlowMatchEulerDiscreteScheduler",
            scheduler_config=config,
            shift=config["shift"],
            mu_fn=mu_fn,
        )

    @classmethod
    def linear_mu(cls, pipeline_module: str, **config: Any) -> ShiftSpec:
        """:meth:`dynamic` with mu from ``calculate_shift`` of the pipeline module (linear in the sequence length)
        bound to the config's base/max sequence lengths and shifts: Flux, Qwen-Image, LTX-Video."""
        c = {**FLOW_MATCH_EULER, **config}
        mu_fn = functools.partial(
            PipelineFunction(pipeline_module, "calculate_shift"),
            base_seq_len=c["base_image_seq_len"],
            max_seq_len=c["max_image_seq_len"],
            base_shift=c["base_shift"],
            max_shift=c["max_shift"],
        )
        return cls.dynamic(mu_fn, **config)

    def mu(self, image_seq_len: int) -> float:
        if self.mu_fn is None:
            raise ValueError("static shift has no mu")
        return float(self.mu_fn(int(image_seq_len)))


class Classes(NamedTuple):
    """The diffusers classes of a family (names in ``diffusers``): the transformer it trains, the pipeline its
    checkpoints (and tiny folder) load with, the pipeline's VAE."""

    transformer: str
    pipeline: str
    vae: str


# The attention projections diffusers' and finetrainers' LoRA recipes adapt: query, key, value and output.
ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")


@dataclass(frozen=True, eq=False, kw_only=True)
class FamilySpec:
    """One model family, as data: the fields without a default, then what differs from the defaults. See the module
    docstring for the function signatures."""

    name: str
    # (transformer, pipeline, VAE) class names; read as transformer_class, pipeline_class, vae_class.
    classes: Classes
    latent_kind: Literal["image", "video"]
    # Shift of the primary ("latents") stream.
    shift: ShiftSpec
    build_inputs: BuildInputs
    # Cache keys build_inputs reads (besides the noisy streams); optional keys are not listed.
    batch_keys: tuple[str, ...]
    # Module-name suffixes to adapt with LoRA (peft ``target_modules``).
    lora_targets: tuple[str, ...] = ATTENTION_PROJECTIONS
    # sigmas (B,) -> the ``timestep`` the pipeline passes to the transformer. Default: the scheduler's timestep
    # ``sigma * 1000``, which most pipelines pass as is.
    timestep_from_sigma: Callable[[torch.Tensor], torch.Tensor] = sigma_times_1000
    # The transformer output -> the prediction per stream in the cached latent layout. Default: the first output
    # tensor is the primary stream's, as the transformer returns it.
    unpack_output: UnpackOutput = first_output
    # The transformer's patch over the primary latent grid; a sample's tokens are the patches of its sequence latents
    # (see tokens_per_sample). Default: the config's per-axis ``patch_size``.
    patch: Patch = Patch("patch_size")
    # Per-sample latent shapes of the noised streams + the transformer config -> transformer tokens, for a family
    # whose sequence is more than its latents' patches (MiniMax-H3's audio rows); None: the patches.
    count_tokens: CountTokens | None = None
    # Cache keys of clean latents the pipeline appends to the noisy tokens (the reference image of FLUX.1 Kontext and
    # Qwen-Image-Edit, see with_appended_latents); their patches are sequence tokens too.
    sequence_latents: tuple[str, ...] = ()
    # Per-sample latent shape (C, ...) of the primary stream -> the ``image_seq_len`` the pipeline's dynamic shift uses
    # (None: the shift is static and does not depend on the resolution).
    shift_seq_len: Callable[[Sequence[int]], int] | None = None
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
    # The transformer config -> (attention heads, head dim) of its token stream (the estimator's width, the heads CP
    # splits). Default: diffusers' usual keys; Z-Image names them n_heads and dim.
    attention_shape: Callable[[Config], tuple[int, int]] = config_attention_shape
    # A change the family trains its transformer with, applied to every transformer built or loaded for training (the
    # trainer's loading, the serial oracle's and the tiny builders: train_ready), before its attention backend and CP
    # are set: Kandinsky 5's float32-RoPE attention processor. None: the transformer as diffusers builds it.
    prepare_transformer: Callable[[torch.nn.Module], None] | None = None
    # Arguments the family's pipeline call needs in validation samples besides the recipe's (train/validation.py):
    # Qwen-Image 2.1's prefix KV cache runs its later steps on the target tokens only, a sequence the CP plan does not
    # describe, so its samples run without it ({"use_kv_cache": False}; the cache is exact, so the samples are the
    # same). Empty: the pipeline's defaults.
    validation_kwargs: Mapping[str, Any] = field(default_factory=frozen)
    # The LoRA key format of the model authors' checkpoint (what ComfyUI and their code read), for
    # checkpoint.export_format original / both (train/lora_format.py); None: diffusers' keys only.
    lora_format: LoraFormat | None = None

    def __post_init__(self) -> None:
        if self.latent_kind not in ("image", "video"):
            raise ValueError(f"latent_kind must be 'image' or 'video', got {self.latent_kind!r}")
        if PRIMARY_STREAM in self.extra_streams:
            raise ValueError(f"{PRIMARY_STREAM!r} is the primary stream, not an extra one")
        shifts = (self.shift, *self.extra_streams.values())
        if self.shift_seq_len is None and any(s.kind == "dynamic" for s in shifts):
            raise ValueError(f"{self.name}: a dynamic shift needs shift_seq_len")

    # Classes -----------------------------------------------------------------------------------------------------

    @property
    def transformer_class(self) -> str:
        return self.classes.transformer

    @property
    def pipeline_class(self) -> str:
        return self.classes.pipeline

    @property
    def vae_class(self) -> str:
        return self.classes.vae

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

    def tokens_per_sample(self, latents_shapes: Mapping[str, Sequence[int]], model_config: Config) -> int:
        """Transformer tokens of one sample: the noised streams after patching, from their per-sample shapes (C, ...).

        Video/image latents count their tokens after the transformer's :attr:`patch` (Flux's 2x2 packing, Wan's 1x2x2
        patches, ...), the appended :attr:`sequence_latents` too (counted like the primary latents when their shape is
        not given: the trainer's throughput passes the noised streams only), MiniMax-H3 adds its audio rows. Text
        tokens are not counted: they are conditioning, their length is set by the tokenizer and padding rather than by
        the data, and some families never split them under CP. This is the throughput metric's unit
        (``transformer_tokens_per_s``).
        """
        shapes = {k: tuple(v) for k, v in latents_shapes.items()}
        if self.count_tokens is not None:
            return int(self.count_tokens(shapes, model_config))
        patch, primary = self.patch.of(model_config), shapes[PRIMARY_STREAM]
        return sum(patched_tokens(shapes.get(k, primary), patch) for k in (PRIMARY_STREAM, *self.sequence_latents))

    def with_appended_latents(self, key: str, **changes: Any) -> FamilySpec:
        """A variant whose pipeline appends the clean latents ``batch[key]`` (a reference image) to the noisy tokens,
        with its ``build_inputs`` (and name, pipeline) in ``changes``: the cache holds them, their patches are sequence
        tokens, and the prediction is the first output tokens only (the pipelines' ``noise_pred[:, :latents.size(1)]``:
        the loss never sees the reference)."""
        return dataclasses.replace(
            self,
            batch_keys=(*self.batch_keys, key),
            sequence_latents=(*self.sequence_latents, key),
            unpack_output=functools.partial(_unpack_first_tokens, self.unpack_output, self.patch),
            **changes,
        )

    def train_ready(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with the family's :attr:`prepare_transformer` applied (in place); returns it."""
        if self.prepare_transformer is not None:
            self.prepare_transformer(model)
        return model

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
    ) -> dict[str, Any]:
        """Transformer kwargs for one training step, as the family's pipeline builds them (add ``return_dict=False``
        when calling); the same under context parallelism."""
        noisy = _as_streams(noisy_latents)
        missing = [s for s in self.streams if s not in noisy]
        if missing:
            raise KeyError(f"{self.name}: noisy latents missing for streams {missing}")
        return self.build_inputs(batch, noisy, self.model_timesteps(sigmas), model_config=model_config)

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


def _unpack_first_tokens(
    unpack: UnpackOutput, patch: Patch, out: Any, latents_shapes: Shapes, *, model_config: Config
) -> dict[str, torch.Tensor]:
    """``unpack`` of the primary latents' tokens, the first of the output sequence (see with_appended_latents)."""
    tokens = patched_tokens(latents_shapes[PRIMARY_STREAM][1:], patch.of(model_config))
    return unpack((output_tensors(out)[0][:, :tokens],), latents_shapes, model_config=model_config)


def uniform_value(values: torch.Tensor, what: str) -> float:
    """The one value of a tensor whose entries must all be equal (e.g. a per-batch scalar)."""
    flat = values.reshape(-1)
    if flat.numel() == 0:
        raise ValueError(f"{what}: empty")
    if not bool((flat == flat[0]).all()):
        raise ValueError(f"{what} must be the same for every sample of the batch, got {flat.tolist()}")
    return float(flat[0].item())


def batch_guidance(batch: Batch, latents: torch.Tensor, default: float) -> torch.Tensor:
    """The (B,) float32 guidance of a guidance-distilled checkpoint: the cache's per-sample ``guidance``, else the
    pipeline's default scale."""
    value = batch.get("guidance")
    if value is None:
        value = torch.full([1], default, device=latents.device, dtype=torch.float32)
    return value.to(device=latents.device, dtype=torch.float32).reshape(-1).expand(latents.shape[0])


def first_frame_condition(batch: Batch, latents: torch.Tensor) -> torch.Tensor:
    """A ``condition_mask`` (B, 1, F, 1, 1): 1 on latent frame 0, the image an image-to-video pipeline keeps clean."""
    mask = latents.new_zeros(latents.shape[0], 1, latents.shape[2], 1, 1)
    mask[:, :, 0] = 1
    return mask
