"""How each family's diffusers pipeline turns pixels and captions into the tensors the cache stores.

One `FamilyEncoder` per family. It loads the VAE and text encoder(s) from a pipeline folder (or hub id) with the
family's pipeline class, exactly as the pipeline loads them (subfolders, tokenizers, configs; the transformer is not
loaded), and encodes with the pipeline's own helpers and normalisation, so cached tensors are what the pipeline would
compute at inference:

    family   latents (per sample)                      text
    wan      (z - mean) / std, (C, F, H, W)            _get_t5_prompt_embeds (UMT5, zero-padded to L) + tokenizer mask
    chrono.  as wan, + condition_latents, image_embeds as wan, L fixed to 512 (the Wan I2V processors need it)
    ltx      _normalize_latents(z, mean, std, scaling)  _get_t5_prompt_embeds -> embeds + mask; + frame_rate
    flux     (z - shift_factor) * scaling_factor, (C, H, W)   encode_prompt: T5 embeds + CLIP pooled; T5 mask
    flux2    2x2 patchify, then (z - bn_mean) / bn_std  encode_prompt (Mistral layers 10/20/30) + chat-template mask
    qwenimg  (z - mean) / std, (C, 1, H, W)             encode_prompt (template prefix dropped, unpadded) + mask
    minimax  (z - mean) / std of ImageNet-normalised    MiniMaxH3TextEncoderStep (Qwen3-VL hidden_states[50], unpadded);
             pixels, (24, 5n+2, H, W); + audio_latents  + the soundtrack's audio-VAE posterior mean (2, 32, N)

`z` is the VAE posterior sampled with a per-item generator (`mode="sample"`, as the pipelines' own `retrieve_latents`
does by default) or its mean (`mode="mode"`). The per-family size rules (`Geometry`) come from the same VAE (and
transformer patch) configs, read without loading weights. The cache layout each family's trainer reads is documented
in `train.models.<family>` (the `FamilySpec`s); this module writes exactly those keys.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Literal

import torch

from train.data.media import Geometry

__all__ = ["ENCODERS", "FamilyEncoder", "get_encoder", "load_qwen3vl_processor_without_torchvision"]

SampleMode = Literal["sample", "mode"]


def _retrieve(encoder_output: Any, generator: torch.Generator | None, mode: SampleMode) -> torch.Tensor:
    from diffusers.pipelines.wan.pipeline_wan_video2video import retrieve_latents

    return retrieve_latents(encoder_output, generator=generator, sample_mode="sample" if mode == "sample" else "argmax")


def _transformer_patch(config: Mapping[str, Any] | None, key: str, default: Any) -> Any:
    return default if config is None else config.get(key, default)


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

    def __init__(self) -> None:
        self.pipe: Any = None
        self.device = torch.device("cpu")

    # ----------------------------------------------------------------------------------------------------- facts

    @functools.cached_property
    def spec(self):
        from train.models import get_family

        return get_family(self.name)

    def text_tokens(self, max_text_tokens: int | None) -> int:
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

    @abstractmethod
    def _geometry(self, vae_config: Mapping[str, Any], tr_config: Mapping[str, Any] | None) -> tuple[int, int, int]:
        """(spatial_multiple, frame_period, frame_offset) from the configs."""

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
        self.pipe = pipeline_cls.from_pretrained(pretrained_path, revision=revision, dtype=dtype, **skip)
        self.device = torch.device(device)
        self.pipe.to(self.device)

    # ------------------------------------------------------------------------------------------------ encoding

    @abstractmethod
    def encode_text(self, caption: str, max_tokens: int) -> dict[str, torch.Tensor]:
        """prompt_embeds (L, D), prompt_mask (L,) bool, and pooled_embeds (D2,) where the family has one."""

    @abstractmethod
    def encode_media(
        self, pixels: torch.Tensor, generator: torch.Generator | None, mode: SampleMode, fps: float | None
    ) -> dict[str, torch.Tensor]:
        """latents (and the family's other media tensors) from pixels (3, F, H, W) in [-1, 1]."""

    def load_extra(self, src: Any, info: Any, bucket: Any, fps: float | None) -> Any:
        """Media the family needs besides the frames (MiniMax-H3: the soundtrack), decoded in prepare's loader
        threads after `load_clip`; may raise BadMediaError. None for the families that need nothing more."""
        return None

    def encode_extra(
        self, extra: Any, generator: torch.Generator | None, mode: SampleMode, fps: float | None
    ) -> dict[str, torch.Tensor]:
        """Cache tensors of what `load_extra` returned (after `encode_media`, with the same generator)."""
        return {}

    def _vae_encode(self, x: torch.Tensor, generator: torch.Generator | None, mode: SampleMode) -> torch.Tensor:
        vae = self.pipe.vae
        return _retrieve(vae.encode(x.to(self.device, vae.dtype)), generator, mode)

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


# ------------------------------------------------------------------------------------------------------------- Wan


class WanEncoder(FamilyEncoder):
    name = "wan"
    default_text_tokens = 512  # WanPipeline.__call__(max_sequence_length=512)
    default_geometry = Geometry("wan", "video", 16, 4, 1)

    def _geometry(self, vae_config, tr_config):
        patch = _transformer_patch(tr_config, "patch_size", (1, 2, 2))
        spatial = vae_config.get("scale_factor_spatial", 8)
        temporal = vae_config.get("scale_factor_temporal", 4) * patch[0]
        return spatial * max(patch[1], patch[2]), temporal, 1

    def encode_text(self, caption, max_tokens):
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        embeds = self.pipe._get_t5_prompt_embeds(prompt=[caption], max_sequence_length=max_tokens, device=self.device)
        mask = self._t5_mask(self.pipe.tokenizer, prompt_clean(caption), max_tokens)
        return {"prompt_embeds": embeds[0], "prompt_mask": mask}

    def _normalise(self, z: torch.Tensor) -> torch.Tensor:
        # WanVideoToVideoPipeline.prepare_latents / decode: (z - mean) * (1 / std), per channel
        cfg = self.pipe.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        return (z - mean) * inv_std

    def encode_media(self, pixels, generator, mode, fps):
        z = self._vae_encode(pixels.unsqueeze(0), generator, mode)
        return {"latents": self._normalise(z)[0]}


class ChronoEditEncoder(WanEncoder):
    """Wan I2V-style editing: frame 0 of the clip is the input image, the rest is what the model learns to produce."""

    name = "chronoedit"
    fixed_text_tokens = 512
    default_geometry = Geometry("chronoedit", "video", 16, 4, 1)

    def load(self, pretrained_path, **kwargs):
        # diffusers 0.42.1's ChronoEdit prompt_clean calls ftfy.fix_text even when ftfy is not installed (NameError);
        # WanPipeline skips the call then. Without ftfy, give the module the same skip (identity fix_text).
        from diffusers.pipelines.chronoedit import pipeline_chronoedit
        from diffusers.utils import is_ftfy_available

        if not is_ftfy_available() and not hasattr(pipeline_chronoedit, "ftfy"):
            pipeline_chronoedit.ftfy = type("_NoFtfy", (), {"fix_text": staticmethod(lambda text: text)})
        super().load(pretrained_path, **kwargs)

    def encode_media(self, pixels, generator, mode, fps):
        from PIL import Image

        out = super().encode_media(pixels, generator, mode, fps)
        pipe, (_, frames, height, width) = self.pipe, pixels.shape
        first = pixels[:, 0].unsqueeze(0).to(self.device)  # (1, 3, H, W) in [-1, 1], as video_processor.preprocess
        placeholder = torch.zeros(1, *out["latents"].shape, device=self.device)  # prepare_latents returns it as is
        _, condition = pipe.prepare_latents(
            first, 1, pipe.vae.config.z_dim, height, width, frames, torch.float32, self.device, None, placeholder
        )
        mask_channels = pipe.vae_scale_factor_temporal
        image = Image.fromarray(((first[0].permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).byte().cpu().numpy())
        out["condition_latents"] = condition[0, mask_channels:]
        out["image_embeds"] = pipe.encode_image(image, self.device)[0]
        return out


# ------------------------------------------------------------------------------------------------------------- LTX


class LTXEncoder(FamilyEncoder):
    name = "ltx"
    default_text_tokens = 128  # LTXPipeline.__call__(max_sequence_length=128)
    default_geometry = Geometry("ltx", "video", 32, 8, 1)

    def _geometry(self, vae_config, tr_config):
        scaling = vae_config.get("spatio_temporal_scaling", (True, True, True, False))
        spatial = vae_config.get("spatial_compression_ratio") or vae_config.get("patch_size", 4) * 2 ** sum(scaling)
        temporal = vae_config.get("temporal_compression_ratio") or vae_config.get("patch_size_t", 1) * 2 ** sum(scaling)
        spatial *= _transformer_patch(tr_config, "patch_size", 1)
        temporal *= _transformer_patch(tr_config, "patch_size_t", 1)
        return spatial, temporal, 1

    def encode_text(self, caption, max_tokens):
        embeds, mask = self.pipe._get_t5_prompt_embeds(
            prompt=[caption], max_sequence_length=max_tokens, device=self.device
        )
        return {"prompt_embeds": embeds[0], "prompt_mask": mask[0].bool()}

    def encode_media(self, pixels, generator, mode, fps):
        vae = self.pipe.vae
        z = self._vae_encode(pixels.unsqueeze(0), generator, mode)
        z = self.pipe._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        rate = fps if fps and pixels.shape[1] > 1 else self.spec.constants["frame_rate"]
        return {"latents": z[0], "frame_rate": torch.tensor(float(rate))}


# ------------------------------------------------------------------------------------------------------------ Flux


class FluxEncoder(FamilyEncoder):
    name = "flux"
    default_text_tokens = 512  # FluxPipeline.__call__(max_sequence_length=512); schnell checkpoints use 256
    default_geometry = Geometry("flux", "image", 16)

    def _geometry(self, vae_config, tr_config):
        # FluxPipeline.check_inputs: multiples of vae_scale_factor * 2 (latents are packed in 2x2 patches)
        return 2 ** (len(vae_config.get("block_out_channels", (0,) * 4)) - 1) * 2, 1, 0

    def encode_text(self, caption, max_tokens):
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=[caption], prompt_2=None, device=self.device, max_sequence_length=max_tokens
        )
        mask = self._t5_mask(self.pipe.tokenizer_2, caption, max_tokens)
        return {"prompt_embeds": embeds[0], "prompt_mask": mask, "pooled_embeds": pooled[0]}

    def encode_media(self, pixels, generator, mode, fps):
        cfg = self.pipe.vae.config
        z = self._vae_encode(pixels[:, 0].unsqueeze(0), generator, mode)
        return {"latents": ((z - cfg.shift_factor) * cfg.scaling_factor)[0]}


# ------------------------------------------------------------------------------------------------------- Qwen-Image


class QwenImageEncoder(FamilyEncoder):
    name = "qwenimage"
    default_text_tokens = 512  # QwenImagePipeline.__call__(max_sequence_length=512)
    default_geometry = Geometry("qwenimage", "image", 16)

    def _geometry(self, vae_config, tr_config):
        # QwenImagePipeline: vae_scale_factor = 2 ** len(temperal_downsample); check_inputs wants multiples of x2
        return 2 ** len(vae_config.get("temperal_downsample", (False, True, True))) * 2, 1, 0

    def encode_text(self, caption, max_tokens):
        embeds, mask = self.pipe.encode_prompt(prompt=[caption], device=self.device, max_sequence_length=max_tokens)
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
        return {"prompt_embeds": embeds[0], "prompt_mask": mask[0].cpu()}

    def encode_media(self, pixels, generator, mode, fps):
        # QwenImageImg2ImgPipeline._encode_vae_image: (z - mean) * (1 / std) on the (B, C, 1, H, W) layout
        cfg = self.pipe.vae.config
        z = self._vae_encode(pixels[:, :1].unsqueeze(0), generator, mode)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        return {"latents": ((z - mean) * inv_std)[0]}


# --------------------------------------------------------------------------------------------------------- Flux.2


class Flux2Encoder(FamilyEncoder):
    name = "flux2"
    default_text_tokens = 512  # Flux2Pipeline.__call__(max_sequence_length=512)
    default_geometry = Geometry("flux2", "image", 16)

    def _geometry(self, vae_config, tr_config):
        # Flux2Pipeline.check_inputs: multiples of vae_scale_factor * 2 (latents are 2x2-patchified)
        return 2 ** (len(vae_config.get("block_out_channels", (0,) * 4)) - 1) * 2, 1, 0

    def encode_text(self, caption, max_tokens):
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        pipe = self.pipe
        embeds, _ = pipe.encode_prompt(prompt=[caption], device=self.device, max_sequence_length=max_tokens)
        ids = pipe.tokenizer.apply_chat_template(  # the tokenization _get_mistral_3_small_prompt_embeds runs
            format_input(prompts=[caption], system_message=pipe.system_message),
            add_generation_prompt=False,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=max_tokens,
        )
        return {"prompt_embeds": embeds[0], "prompt_mask": ids["attention_mask"][0].bool()}

    def encode_media(self, pixels, generator, mode, fps):
        # Flux2Pipeline._encode_vae_image with the configured sampling: patchify 2x2, then the VAE's batch-norm stats
        pipe, vae = self.pipe, self.pipe.vae
        z = pipe._patchify_latents(self._vae_encode(pixels[:, 0].unsqueeze(0), generator, mode))
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        return {"latents": ((z - mean) / std)[0]}


# ------------------------------------------------------------------------------------------------------- MiniMax-H3


@functools.cache
def _text_only_qwen3vl_processor_class() -> type:
    from transformers import Qwen3VLProcessor

    class Qwen3VLTextOnlyProcessor(Qwen3VLProcessor):
        """Qwen3VLProcessor without its video processor (transformers builds that one only with torchvision)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return Qwen3VLTextOnlyProcessor


def load_qwen3vl_processor_without_torchvision(path: str, subfolder: str = "processor", revision: str | None = None):
    """The checkpoint's Qwen3VLProcessor (its tokenizer and image processor, read from its own files) less the video
    processor, for machines without torchvision, where transformers cannot build Qwen3VLVideoProcessor. MiniMax-H3's
    text-only (t2va) encoding uses the processor for `create_mm_token_type_ids` alone, which reads token ids only."""
    from transformers import AutoImageProcessor, AutoTokenizer

    kw = {"subfolder": subfolder, "revision": revision}
    cls = _text_only_qwen3vl_processor_class()
    return cls(
        image_processor=AutoImageProcessor.from_pretrained(path, **kw),
        tokenizer=AutoTokenizer.from_pretrained(path, **kw),
        video_processor=None,
    )


class MiniMaxH3Encoder(FamilyEncoder):
    """MiniMax-H3, text-to-video+audio (t2va), through its modular pipeline's own components and helpers.

    - `latents` (24, 5n + 2, H/16, W/16): clips of 17n + 5 frames in the pixel convention of the pipeline's
      `encode_vae_condition` (uint8 / 255, ImageNet mean/std), posterior sampled with the item's generator (or its
      mean), normalised `(z - latents_mean) / latents_std` (the inverse of `MiniMaxH3VideoDecodeStep`). Unlike a
      conditioning keyframe, the target is not rounded to float16 and not sampled under the fixed keyframe seed.
    - `audio_latents` (2, 32, N): the soundtrack (`train.data.media.load_audio`: the audio VAE's rate, stereo, from the
      clip's first frame) over N = `audio_latent_num_frames(F, fps)` latents, i.e. exactly N hops, encoded as two mono
      batch items and normalised per channel, as `MiniMaxH3Ref2VAReferenceEncoderStep` encodes a soundtrack (posterior
      mean, never sampled) in the `(audio_channels, latent_channels, N)` layout `MiniMaxH3AudioDecodeStep` decodes. A
      clip without an audio stream is a bad item (`no_audio`).
    - `prompt_embeds` (L, D): `MiniMaxH3TextEncoderStep` itself (the prompt verbatim, no special tokens, Qwen3-VL
      hidden_states[`text_encoder_layer`]), unpadded; `data.max_text_tokens` keeps the first L rows (the encoder is
      causal: the same rows a truncated prompt gives), null keeps them all. The empty caption has no token: (0, D).
      `prompt_mask` is all true.

    The released model runs at 24 fps (`MiniMaxH3ModularPipeline.fps`): set data.fps to 24. Loading needs torchvision
    for transformers' Qwen3VLProcessor; without it the processor is rebuilt from the checkpoint's files less its video
    processor (`load_qwen3vl_processor_without_torchvision`), which the text-only presentation never uses.
    """

    name = "minimax_h3"
    default_geometry = Geometry("minimax_h3", "video", 32, 17, 5)

    def text_tokens(self, max_text_tokens: int | None) -> int | None:
        return max_text_tokens  # None: the whole prompt, as the pipeline encodes it (it neither pads nor truncates)

    def _geometry(self, vae_config, tr_config):
        # MiniMaxH3ModularPipeline.canvas_multiple, and align_num_frames' clip_length * n + tokens_chunk_size
        patch = _transformer_patch(tr_config, "patch_size", (1, 2, 2))
        spatial = math.prod(vae_config.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1)))
        clip_length = vae_config.get("clip_length", 17)
        temporal = math.prod(vae_config.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1)))
        return spatial * max(patch[1], patch[2]), clip_length, math.ceil(clip_length / temporal)

    def load(self, pretrained_path, *, revision=None, device="cpu", text_dtype=torch.float32):
        from diffusers import MiniMaxH3ModularPipeline
        from diffusers.utils import logging as dlogging
        from transformers.utils import is_torchvision_available
        from transformers.utils import logging as tlogging

        dlogging.disable_progress_bar()
        tlogging.disable_progress_bar()
        pipe = MiniMaxH3ModularPipeline.from_pretrained(pretrained_path, revision=revision, workflow="t2va")
        models = ["text_encoder", "vae", "audio_vae"]
        dtype = {"default": text_dtype, "vae": torch.float32, "audio_vae": torch.float32}
        pipe.load_components(names=models, dtype=dtype)
        pipe.load_components(names=["tokenizer", "processor"] if is_torchvision_available() else ["tokenizer"])
        if getattr(pipe, "processor", None) is None and not is_torchvision_available():
            spec = pipe._component_specs["processor"]
            pipe.update_components(
                processor=load_qwen3vl_processor_without_torchvision(
                    spec.pretrained_model_name_or_path or pretrained_path, spec.subfolder or "processor", spec.revision
                )
            )
        missing = [n for n in (*models, "tokenizer", "processor") if getattr(pipe, n, None) is None]
        if missing:  # load_components only logs what it could not load
            raise OSError(f"{pretrained_path}: could not load MiniMax-H3 component(s) {missing} (see the log above)")
        self.pipe, self.device = pipe, torch.device(device)
        pipe.to(self.device)

    # ------------------------------------------------------------------------------------------------- encoding

    def encode_text(self, caption, max_tokens):
        from diffusers.modular_pipelines import PipelineState
        from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

        pipe = self.pipe
        if not pipe.tokenizer(caption, add_special_tokens=False)["input_ids"]:  # "" has no token to encode
            width = pipe.text_encoder.config.text_config.hidden_size
            embeds = torch.zeros(0, width, dtype=pipe.text_encoder.dtype)
        else:
            state = PipelineState()
            state.set("prompt", caption)
            MiniMaxH3TextEncoderStep()(pipe, state)
            embeds = state.get("prompt_embeds")[0]
        if max_tokens is not None:
            embeds = embeds[:max_tokens]
        return {"prompt_embeds": embeds, "prompt_mask": torch.ones(embeds.shape[0], dtype=torch.bool)}

    def encode_media(self, pixels, generator, mode, fps):
        pipe, vae = self.pipe, self.pipe.vae
        # encode_vae_condition's pixel convention, from the uint8 clip the [-1, 1] input was made of
        u8 = pixels.add(1.0).mul(127.5).round().clamp(0, 255).unsqueeze(0).to(self.device)
        pixel_mean = torch.tensor(pipe.pixel_mean, device=self.device).view(1, -1, 1, 1, 1)
        pixel_std = torch.tensor(pipe.pixel_std, device=self.device).view(1, -1, 1, 1, 1)
        z = self._vae_encode((u8.div(255.0) - pixel_mean) / pixel_std, generator, mode)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        return {"latents": ((z - mean) / std)[0]}

    def num_audio_latents(self, num_frames: int, fps: float) -> int:
        """Audio latents of a clip of num_frames at fps: the pipeline's `audio_latent_num_frames` at the VAE's rate."""
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

        audio_vae = self.pipe.audio_vae
        return audio_latent_num_frames(num_frames, fps, audio_vae.config.sampling_rate / audio_vae.hop_length)

    def load_extra(self, src, info, bucket, fps):
        from train.data.media import load_audio

        fps = fps or info.fps or self.pipe.fps
        rate, hop = self.pipe.audio_sampling_rate, self.pipe.audio_vae.hop_length
        num_latents = self.num_audio_latents(bucket.frames, fps)
        # slack for a track that ends up to a frame (+ a hop) before the window does; more is `too_short`
        return load_audio(src, num_latents * hop, rate, max_pad=math.ceil(rate / fps) + hop)

    def encode_extra(self, extra, generator, mode, fps):
        vae = self.pipe.audio_vae
        posterior = vae.encode(extra.to(self.device, torch.float32)[:, None], return_dict=False)[0]
        z = posterior.mode().float()  # (2, 32, N): the stereo channels are two batch items of the mono audio VAE
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1).to(z.device)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1).to(z.device)
        return {"audio_latents": (z - mean) / std}


ENCODERS: dict[str, type[FamilyEncoder]] = {
    cls.name: cls
    for cls in (WanEncoder, ChronoEditEncoder, LTXEncoder, FluxEncoder, Flux2Encoder, QwenImageEncoder)
    + (MiniMaxH3Encoder,)
}

NOT_SUPPORTED: dict[str, str] = {}


def get_encoder(family: str) -> FamilyEncoder:
    """A fresh encoder for `family` (nothing loaded until `.load`)."""
    if family in NOT_SUPPORTED:
        raise ValueError(NOT_SUPPORTED[family])
    try:
        return ENCODERS[family]()
    except KeyError:
        raise KeyError(f"no data encoder for family {family!r}; known: {sorted(ENCODERS)}") from None
