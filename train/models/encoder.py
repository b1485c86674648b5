"""The data encoder base: how a family's diffusers pipeline turns pixels and captions into the tensors the cache stores.

Each family subclasses `FamilyEncoder` in `train/models/<family>/encoder.py`. An encoder loads the VAE and text
encoder(s) from a pipeline folder (or hub id) with the family's pipeline class, exactly as the pipeline loads them
(subfolders, tokenizers, configs; the transformer is not loaded), and encodes with the pipeline's own helpers and
normalisation, so cached tensors are what the pipeline would compute at inference. The cache layout each family's
trainer reads is documented in its package docstring; its encoder writes exactly those keys.

`z` is the VAE posterior sampled with a per-item generator (`mode="sample"`, as the pipelines' own `retrieve_latents`
does by default) or its mean (`mode="mode"`). The per-family size rules (`Geometry`) come from the same VAE (and
transformer patch) configs, read without loading weights.
"""

from __future__ import annotations

import functools
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from train.data.media import Geometry
from train.errors import UserError

__all__ = [
    "FamilyEncoder",
    "SampleMode",
    "causal_frame_cells",
    "load_condition_video",
    "load_processor_without_video",
    "load_reference_image",
    "mean_std_normalise",
    "transformer_patch",
]

SampleMode = Literal["sample", "mode"]


def retrieve(encoder_output: Any, generator: torch.Generator | None, mode: SampleMode) -> torch.Tensor:
    """The pipelines' `retrieve_latents`: a posterior sample drawn with `generator`, or its mean."""
    from diffusers.pipelines.wan.pipeline_wan_video2video import retrieve_latents

    return retrieve_latents(encoder_output, generator=generator, sample_mode="sample" if mode == "sample" else "argmax")


def load_reference_image(reference: Any, item: str):
    """An editing item's reference image as an RGB PIL image, from a path or a datasets {"path", "bytes"} cell; a
    missing or unreadable one makes the item bad (`no_reference` / `bad_reference`)."""
    from train.data.media import BadMediaError, _open_image

    if reference is None:
        raise BadMediaError("no_reference", f"{item}: no reference image (data.reference_column)")
    try:
        return _open_image(reference)
    except BadMediaError as e:
        raise BadMediaError("bad_reference", e.detail) from None


def load_condition_video(
    name: str, src: Any, media: Any, bucket: Any, fps: float | None, *, own_size: bool = False
) -> torch.Tensor:
    """An item's conditioning video `name` (see `FamilyEncoder.condition_media`) as uint8 (F, 3, H, W): the frames of
    `bucket` sampled at `fps` from the start, as the media's, resized and centre-cropped to the bucket's size as the
    media is (`own_size`: at the video's own size). An image, a video of another frame count than its media (where
    both headers state it), or one that cannot be read makes the item bad (`bad_condition`)."""
    from train.data.media import BadMediaError, Bucket, load_clip, probe

    try:
        info = probe(src)
        counts = info.num_frames, media.num_frames
        if info.kind != "video" or (all(counts) and counts[0] != counts[1]):
            what = "an image" if info.kind != "video" else f"a video of {info.num_frames} frames"
            raise BadMediaError("bad_condition", f"{name} {info.name} is {what}, its media has {media.num_frames} "
                                "frames: give it one frame per media frame")  # fmt: skip
        size = Bucket(bucket.frames, info.height, info.width) if own_size else bucket
        return load_clip(src, size, fps, allow_upscale=True, info=info)
    except BadMediaError as e:
        detail = e.detail if e.reason == "bad_condition" else f"{name}: {e.detail}"
        raise BadMediaError("bad_condition", detail) from None


@functools.cache
def _without_video(processor_class: str) -> type:
    import transformers

    class WithoutVideo(getattr(transformers, processor_class)):
        """The processor without its video processor (transformers builds that one only with torchvision)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    WithoutVideo.__name__ = WithoutVideo.__qualname__ = f"{processor_class}WithoutVideo"
    return WithoutVideo


def load_processor_without_video(
    processor_class: str, path: str, subfolder: str = "processor", revision: str | None = None
) -> Any:
    """A checkpoint's transformers ``processor_class`` (Qwen2VLProcessor, Qwen3VLProcessor: its tokenizer and image
    processor, read from its own files) less the video processor, for machines without torchvision, where
    transformers cannot build the video processor; for pipelines that never show the processor a video."""
    from transformers import AutoImageProcessor, AutoTokenizer

    kw = {"subfolder": subfolder, "revision": revision}
    return _without_video(processor_class)(
        image_processor=AutoImageProcessor.from_pretrained(path, **kw),
        tokenizer=AutoTokenizer.from_pretrained(path, **kw),
        video_processor=None,
    )


def _refused_pickle(pretrained_path: str, error: Exception) -> UserError:
    """A pickled weights file of the pipeline (.bin/.pt/.pth) names something other than tensors: it was refused
    (nothing ran); say which files are pickles and what to do."""
    root = Path(pretrained_path).expanduser()
    pickles = sorted(str(p.relative_to(root)) for ext in ("bin", "pt", "pth", "ckpt") for p in root.rglob(f"*.{ext}"))
    found = re.search(r"GLOBAL (\S+)", str(error))
    names = f" (it names {found.group(1)})" if found else ""
    return UserError(f"model.pretrained_path: a pickled weights file of {root} was refused{names}: torch.load with "
                     f"weights_only=True loads tensors only, and nothing in it ran. Pickled files there: "
                     f"{pickles[:4] or 'none found locally'}; use the checkpoint's .safetensors weights (or convert "
                     "a file you trust with safetensors)")  # fmt: skip


def transformer_patch(config: Mapping[str, Any] | None, key: str, default: Any) -> Any:
    """A transformer config value (e.g. its patch size), or the family default when the config is unknown."""
    return default if config is None else config.get(key, default)


def causal_frame_cells(frames: int, stride: int, chunk: int | None = None) -> list[range]:
    """The pixel frames each latent frame of a causal video VAE encodes, in order: the clip is cut into chunks of
    `chunk` frames (None: one chunk, the whole clip), and each chunk, front-padded to a multiple of `stride` as the
    VAE's causal convolutions pad it, gives one latent frame per `stride` padded frames. A chunk of ``stride * k + 1``
    frames thus keeps its first frame alone, then `stride` frames per latent frame (Wan, HunyuanVideo, LTX-Video: 9
    frames at stride 4 -> [0], [1-4], [5-8]); MiniMax-H3's 17-frame chunks at stride 4 do the same per chunk. Frames
    past the clip (a padded last chunk) belong to no cell; the cells they alone would fill come last and are empty."""
    chunk = chunk or frames
    pad = (-chunk) % stride  # the causal front padding: the first latent frame sees `stride - pad` real frames
    cells = []
    for start in range(0, frames, chunk):
        end = min(start + chunk, frames)
        for k in range((chunk + pad) // stride):
            first, last = start + k * stride - pad, start + (k + 1) * stride - pad
            cells.append(range(max(first, start), min(last, end)))
    return cells


def mean_std_normalise(z: torch.Tensor, latents_mean, latents_std) -> torch.Tensor:
    """``(z - mean) * (1 / std)`` per channel of (B, C, ...) latents, as the Wan-VAE pipelines normalise them."""
    shape = (1, len(latents_mean)) + (1,) * (z.ndim - 2)
    mean = torch.tensor(latents_mean).view(shape).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(latents_std).view(shape).to(z.device, z.dtype)
    return (z - mean) * inv_std


class FamilyEncoder(ABC):
    """Base: loading, geometry lookup and the shared VAE/text plumbing; subclasses hold the family's recipe.

    Subclasses set the class attributes and implement `_geometry`, `encode_text` and `encode_media`.
    """

    name: str = ""
    default_text_tokens: int = 512
    """Text length when data.max_text_tokens is null (the pipeline's __call__ default max_sequence_length)."""
    fixed_text_tokens: int | None = None
    """A text length the family requires whatever the recipe says (ChronoEdit: 512), or None."""
    default_geometry: Geometry
    latent_strides: tuple[int, int, int] = (16, 1, 8)
    """(latent channels, VAE temporal stride, VAE spatial stride) of the cached `latents` at the published VAE."""
    needs_reference: bool = False
    """Editing families: every item needs a reference (input) image, read from `data.reference_column` and handed to
    `load_extra` (an item without one is bad: `no_reference`)."""
    max_references: int = 1
    """How many reference images an item may have: more than 1 lets `data.reference_column` be a list of up to this
    many columns (Qwen-Image-Edit-Plus: 3), and `load_extra` then gets the item's references as a list in column
    order, None where it lacks one."""
    condition_media: tuple[str, ...] = ()
    """Named conditioning media every item needs besides its reference (Wan Animate: a pose video and a face video),
    each read from the item's column `data.condition_columns[name]` (default: the name itself) and handed to
    `load_extra` as a keyword argument of that name; an item without one is bad (`no_condition`), one whose media
    cannot be read `bad_condition` (`load_condition_video`)."""
    validation_image: Literal["required", "optional"] | None = None
    """Validation samples (train/validation.py): the pipeline's `image` argument, the conditioning image (the first
    frame of image-to-video, the input of editing), is required for every validation prompt, optional, or not taken."""
    validation_min_frames: int = 1
    """Validation samples (train/validation.py): the fewest frames the pipeline renders right (Kandinsky 5 I2V's
    decode-time first-frame fix reads 5 latent frames after the first 4: 17 frames; fewer give NaN)."""

    def __init__(self) -> None:
        self.pipe: Any = None
        self.device = torch.device("cpu")

    # ----------------------------------------------------------------------------------------------------- facts

    @functools.cached_property
    def spec(self):
        from train.models import get_family

        return get_family(self.name)

    def text_tokens(self, max_text_tokens: int | None) -> int | None:
        if self.fixed_text_tokens is not None:
            if max_text_tokens not in (None, self.fixed_text_tokens):
                raise ValueError(
                    f"data.max_text_tokens: {self.name} needs exactly {self.fixed_text_tokens} text tokens (its "
                    f"attention processors split image and text context at that length), got {max_text_tokens}; "
                    "set it to null"
                )
            return self.fixed_text_tokens
        return self.default_text_tokens if max_text_tokens is None else max_text_tokens

    def geometry(self, pretrained_path: str | None, revision: str | None = None, subfolder: str = "transformer"):
        """Size rules from the pipeline's VAE/transformer configs (no weights read); family defaults without a path."""
        if pretrained_path is None:
            return self.default_geometry
        import diffusers

        vae_cls = getattr(diffusers, self.spec.vae_class)
        try:
            vae_config = vae_cls.load_config(pretrained_path, subfolder="vae", revision=revision)
        except OSError as e:  # offline / not downloaded yet: the family's published strides (loading fails later)
            d = self.default_geometry
            why = f"family defaults; {pretrained_path}/vae config unreadable: {str(e).splitlines()[0][:160]}"
            return Geometry(d.family, d.latent_kind, d.spatial_multiple, d.frame_period, d.frame_offset, source=why)
        try:
            tr_cls = getattr(diffusers, self.spec.transformer_class)
            tr_config = tr_cls.load_config(pretrained_path, subfolder=subfolder, revision=revision)
        except (OSError, ValueError):
            tr_config = None  # a folder without the transformer: the family's patch size
        g = self._geometry(vae_config, tr_config)
        return Geometry(self.name, self.spec.latent_kind, g[0], g[1], g[2], source=str(pretrained_path))

    def latent_shapes(self, frames: int, height: int, width: int, fps: float | None) -> dict[str, tuple[int, ...]]:
        """Per-sample shapes of the cached streams for a clip of this size (what `encode_media` writes), from the
        published strides, nothing loaded: what `train.estimate` counts tokens from. Video: (C, F', H', W') with
        F' = (frames - 1) // temporal + 1; image: (C, H', W')."""
        channels, temporal, spatial = self.latent_strides
        if self.spec.latent_kind == "image":
            return {"latents": (channels, height // spatial, width // spatial)}
        return {"latents": (channels, (frames - 1) // temporal + 1, height // spatial, width // spatial)}

    def loss_mask(self, mask: torch.Tensor, latents_shape: Sequence[int]) -> torch.Tensor:
        """An item's loss mask at latent resolution: float32 (1, *latents_shape[1:]) in [0, 1], from `mask` (F, H, W)
        in [0, 1], the mask at its clip's pixel geometry (cropped and resized as the media, train.prepare).

        Mean pooling: each latent cell gets the mean of the mask over the pixels and frames the VAE encodes into it
        (area interpolation, as kohya's sd-scripts resizes its loss masks), so a cell half inside the mask weighs half,
        and grey masks stay weights. Max pooling would give every cell that touches the mask full weight, training on
        the masked-out pixels around its edge at full strength. The spatial strides are H / H' and W / W' of the
        latents this VAE wrote (any patchifying of the cached latents included: Flux.2's 2x2); the frames of each
        latent frame come from `latent_frame_cells`."""
        grid = tuple(latents_shape[1:])
        (frames, height, width), (lat_h, lat_w) = mask.shape, grid[-2:]
        lat_f = grid[0] if len(grid) == 3 else 1  # image families: (C, H', W')
        assert height % lat_h == 0 and width % lat_w == 0, (mask.shape, grid)  # buckets are VAE-stride multiples
        spatial = F.avg_pool2d(mask.float()[:, None], (height // lat_h, width // lat_w))[:, 0]  # (F, H', W')
        cells = [range(frames)] if lat_f == 1 else self.latent_frame_cells(frames, lat_f)
        return torch.stack([spatial[cell.start : cell.stop].mean(0) for cell in cells]).reshape(1, *grid)

    def latent_frame_cells(self, frames: int, latent_frames: int) -> list[range]:
        """The pixel frames each of the `latent_frames` latent frames encodes, for a clip of `frames` (> 1 latent
        frame). Default: a causal video VAE over the whole clip (`causal_frame_cells`; frames = stride * k + 1, the
        stride from the two counts). A family whose VAE groups frames otherwise overrides this (MiniMax-H3)."""
        stride, rest = divmod(frames - 1, latent_frames - 1)
        assert rest == 0, (frames, latent_frames)  # Geometry.check admitted only stride * k + 1 frames
        return causal_frame_cells(frames, stride)

    @abstractmethod
    def _geometry(self, vae_config: Mapping[str, Any], tr_config: Mapping[str, Any] | None) -> tuple[int, int, int]:
        """(spatial_multiple, frame_period, frame_offset) from the configs."""

    def _patched_geometry(
        self, spatial: int, temporal: int, tr_config: Mapping[str, Any] | None
    ) -> tuple[int, int, int]:
        """``_geometry`` of a video VAE compressing ``spatial`` x ``temporal`` (frames ``temporal * k + 1``) under the
        transformer's (t, h, w) patch (``spec.patch``; its defaults when the config is unknown)."""
        patch_t, patch_h, _ = self.spec.patch.of(tr_config)
        return spatial * patch_h, temporal * patch_t, 1

    # ---------------------------------------------------------------------------------------------------- loading

    def load(
        self,
        pretrained_path: str,
        *,
        revision: str | None = None,
        device: torch.device | str = "cpu",
        text_dtype: torch.dtype = torch.float32,
    ) -> None:
        """Load the pipeline minus its transformer(s): VAE (and image encoder) in fp32, text encoders in text_dtype."""
        import diffusers
        from diffusers.utils import logging as dlogging
        from transformers.utils import logging as tlogging

        dlogging.disable_progress_bar()
        tlogging.disable_progress_bar()
        pipeline_cls = getattr(diffusers, self.spec.pipeline_class)
        index = pipeline_cls.load_config(pretrained_path, revision=revision)
        skip = {k: None for k in index if k.startswith("transformer") and not k.startswith("_")}
        dtype = {"default": text_dtype, "vae": torch.float32, "image_encoder": torch.float32}
        import pickle

        try:
            own = self.pipeline_components(pretrained_path, revision)
            self.pipe = pipeline_cls.from_pretrained(pretrained_path, revision=revision, dtype=dtype, **skip, **own)
        except pickle.UnpicklingError as e:  # torch.load(weights_only=True) refused a pickled weights file
            raise _refused_pickle(pretrained_path, e) from None
        self.device = torch.device(device)
        self.pipe.to(self.device)

    def pipeline_components(self, pretrained_path: str, revision: str | None) -> dict[str, Any]:
        """Pipeline components the family builds itself from the checkpoint's files, passed to `from_pretrained`
        (Qwen-Image-Edit: its Qwen2VLProcessor without the video processor, which needs torchvision)."""
        return {}

    # ------------------------------------------------------------------------------------------------ encoding

    @abstractmethod
    def encode_text(self, caption: str, max_tokens: int | None) -> dict[str, torch.Tensor]:
        """prompt_embeds (L, D), prompt_mask (L,) bool, and pooled_embeds (D2,) where the family has one."""

    @abstractmethod
    def encode_media(
        self, pixels: torch.Tensor, generator: torch.Generator | None, mode: SampleMode, fps: float | None
    ) -> dict[str, torch.Tensor]:
        """latents (and the family's other media tensors) from pixels (3, F, H, W) in [-1, 1]."""

    def load_extra(self, src: Any, info: Any, bucket: Any, fps: float | None, reference: Any = None) -> Any:
        """Media the family needs besides the frames (MiniMax-H3: the soundtrack; editing families: the item's
        `reference` image, a path or a datasets cell, None when the item has none; each of `condition_media` as a
        keyword argument of its name, a path or a datasets cell), decoded in prepare's loader threads after
        `load_clip`; may raise BadMediaError. None for the families that need nothing more."""
        return None

    def encode_extra(
        self, extra: Any, generator: torch.Generator | None, mode: SampleMode, fps: float | None
    ) -> dict[str, torch.Tensor]:
        """Cache tensors of what `load_extra` returned (after `encode_media`, with the same generator)."""
        return {}

    def encode_item(
        self, pixels: torch.Tensor, extra: Any, generator: torch.Generator | None, mode: SampleMode, fps: float | None
    ) -> dict[str, torch.Tensor]:
        """An item's media tensors: `encode_media` of its pixels, then `encode_extra` of what `load_extra` returned
        (with the same generator), unless the family's latents need both (Wan Animate: the reference image's latent
        frame in front of the clip's)."""
        return self.encode_media(pixels, generator, mode, fps) | self.encode_extra(extra, generator, mode, fps)

    def batch_layout(self, tensors: Mapping[str, torch.Tensor]) -> str | None:
        """What, besides its bucket, fixes an item's sequence layout, from its cache tensors: items of one bucket but
        another layout (Qwen-Image-Edit-Plus: another count or size of control images) never share a batch (the
        trainer's batches are cut per bucket and layout). None (the default): the bucket fixes it."""
        return None

    def encode_item_text(self, caption: str, max_tokens: int | None, extra: Any) -> dict[str, torch.Tensor]:
        """An item's caption embeddings, given what `load_extra` returned: `encode_text` unless the pipeline encodes
        the prompt with the item's media (Qwen-Image-Edit: with the reference image)."""
        return self.encode_text(caption, max_tokens)

    def _vae_encode(self, x: torch.Tensor, generator: torch.Generator | None, mode: SampleMode) -> torch.Tensor:
        vae = self.pipe.vae
        return retrieve(vae.encode(x.to(self.device, vae.dtype)), generator, mode)

    def _t5_mask(self, tokenizer: Any, text: str, max_tokens: int) -> torch.Tensor:
        ids = tokenizer(
            [text],
            padding="max_length",
            max_length=max_tokens,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        return ids.attention_mask[0].bool()
