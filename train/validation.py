"""Validation samples during training: the family's own diffusers pipeline around the training transformer.

Recipe section `validation` (train/config.py). Every `every_n_steps` optimizer steps (and after the last one, and with
`at_start` before the first), each prompt is rendered by `spec.pipeline_class`, loaded once from
`model.pretrained_path` minus its transformer exactly as `train.prepare` loads it (the family's `Encoder.load`), with
the TRAINING transformer put in as it is:

- CP hooks and FSDP2 shards stay in place. Every rank calls the pipeline with the same inputs and the same seeded
  generator, so the text encoders and the sampler agree everywhere and each transformer forward runs like a training
  forward: FSDP all-gathers block by block (no rank ever holds the whole model), the CP plan splits the sequence over
  the CP group. The weights are those of this step: LoRA adapters active, or the full weights.
- The transformer is assigned after the pipeline was built and moved, so no `pipe.to(...)` ever moves or casts it;
  `pipe.transformer.dtype`/`.device` read its (DTensor) parameters, whose dtype and device are the local shard's.
- Nothing of the training state changes: the transformer's train/eval flags are restored module by module, the
  forward runs under no_grad, the global torch RNG state is restored after the call (the pipelines draw only from the
  generator they are given), and the pipeline's scheduler is its own. The training generators are stateless per step
  (train/finetune.py `step_generator`), so a run with validation logs the metrics lines of one without.
- The VAE and text encoders live in host memory between validations (`offload`), on the device during one.

Rank 0 writes `output_dir/samples/step_N/<i>.mp4` (video; PyAV, libx264 yuv420p) or `<i>.png` (image), optionally the
float output `<i>.pt` (`save_tensors`), and logs them to wandb (`validation/<i>`, the prompt as caption).

Per family, as data: `spec.pipeline_class`, `spec.latent_kind` (mp4 or png), the encoder's `validation_image`
(the pipeline's `image` argument required, optional or not taken) and `condition_media` (each prompt's `media`: videos
handed to the pipeline arguments of those names, Wan Animate's pose and face videos), `spec.validation_kwargs`
(arguments its pipeline call needs besides the recipe's). Which keyword arguments a pipeline takes (`num_frames`,
`negative_prompt`, `callback_on_step_end`) is read from its `__call__` signature.
"""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from train.base_adapter import without_base_adapter
from train.config import Recipe, ValidationConfig
from train.errors import UserError
from train.models.spec import FamilySpec

__all__ = ["Validation", "check_validation", "sample_paths"]


def _pipeline_class(spec: FamilySpec):
    import diffusers

    return getattr(diffusers, spec.pipeline_class)


def _call_parameters(spec: FamilySpec) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(_pipeline_class(spec).__call__).parameters)


def check_validation(recipe: Recipe, spec: FamilySpec) -> None:
    """The `validation` section against the family and the files it names, before anything is built; raises
    UserError (one line: cause and fix)."""
    v = recipe.validation
    if v is None:
        return
    from diffusers import DiffusionPipeline

    from train.models import get_encoder

    if recipe.model.pretrained_path is None:
        raise UserError("validation: samples need the pipeline's VAE and text encoders, and model.pretrained_path is "
                        "null; set it to the pipeline folder (or hub id), or set validation=null")  # fmt: skip
    if not issubclass(_pipeline_class(spec), DiffusionPipeline):
        raise UserError(f"validation: {spec.name}'s pipeline {spec.pipeline_class} is a modular pipeline, which "
                        "validation samples do not drive yet; set validation=null")  # fmt: skip
    if spec.experts and not recipe.model.both_experts:
        raise UserError(f"validation: {spec.name} trains one expert of a mixture {list(spec.experts)}, and its "
                        "pipeline needs both to sample; train both (model.both_experts: true), render samples after "
                        "training from the exported weights, or set validation=null")  # fmt: skip
    takes = _call_parameters(spec)
    if v.negative_prompt is not None and "negative_prompt" not in takes:
        raise UserError(f"validation.negative_prompt: {spec.pipeline_class} takes no negative prompt; set it to null")
    if v.guidance_scale is not None and "guidance_scale" not in takes:
        raise UserError(f"validation.guidance_scale: {spec.pipeline_class} takes no guidance_scale (its own "
                        "guidance argument differs); set it to null")  # fmt: skip
    wants = get_encoder(spec.name).validation_image
    for i, p in enumerate(v.prompts):
        key = f"validation.prompts[{i}].image"
        if p.image is None and wants == "required":
            raise UserError(f"{key}: {spec.name} samples are conditioned on an image ({spec.pipeline_class}'s "
                            "`image`); give each prompt an image path")  # fmt: skip
        if p.image is not None and wants is None:
            raise UserError(f"{key}: {spec.name} ({spec.pipeline_class}) takes no conditioning image; remove it")
        if p.image is not None and not Path(p.image).expanduser().is_file():
            raise UserError(f"{key}: no file {Path(p.image).expanduser().resolve()}; point it at an image file")
        if p.image is not None:
            _check_image(key, Path(p.image).expanduser())
        _check_media(f"validation.prompts[{i}].media", p.media, get_encoder(spec.name).condition_media, spec)
    _check_size(recipe, spec)


def _check_image(key: str, path: Path) -> None:
    """The conditioning image opens as an image (PIL reads its header and checks its data), not at the first sample."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as e:  # PIL's UnidentifiedImageError, a truncated file's OSError, a SyntaxError from a bad header
        reason = (str(e).splitlines() or [""])[0][:160]
        raise UserError(f"{key}: {path.resolve()} is not an image PIL can read ({type(e).__name__}: {reason}); point "
                        "it at a PNG, JPEG or WebP file") from None  # fmt: skip


def _check_media(key: str, media: dict[str, str], named: tuple[str, ...], spec: FamilySpec) -> None:
    """A prompt's conditioning videos: exactly the family's named media, each a video file."""
    from train.data.media import BadMediaError, probe

    if missing := [n for n in named if n not in media]:
        wanted = ", ".join(f"{n}: <video path>" for n in missing)
        raise UserError(f"{key}: {spec.name} samples are conditioned on {list(named)} ({spec.pipeline_class}'s "
                        f"arguments); give each prompt media: {{{wanted}}}")  # fmt: skip
    if unknown := sorted(set(media) - set(named)):
        raise UserError(f"{key}: {spec.name} takes no {unknown}; its conditioning media: {list(named) or 'none'}")
    for name, path in media.items():
        file = Path(path).expanduser()
        if not file.is_file():
            raise UserError(f"{key}.{name}: no file {file.resolve()}; point it at a video file")
        try:
            kind = probe(str(file)).kind
        except BadMediaError as e:
            raise UserError(f"{key}.{name}: {file.resolve()} is not a video PyAV can read ({e.detail})") from None
        if kind != "video":
            raise UserError(f"{key}.{name}: {file.resolve()} is an image; give a video of the sample's frames")


def _video_frames(path: str) -> list:
    """A conditioning video's every frame at its own size, as PIL images (the pipelines' `list[PIL.Image]`)."""
    from PIL import Image

    from train.data.media import Bucket, load_clip, probe

    info = probe(path)
    clip = load_clip(path, Bucket(info.num_frames, info.height, info.width), info=info)
    return [Image.fromarray(frame.permute(1, 2, 0).numpy()) for frame in clip]


def _check_size(recipe: Recipe, spec: FamilySpec) -> None:
    """The samples' size follows the family's rules (the pipeline would otherwise round it, with at most a logged
    warning, and render another size than the recipe says)."""
    from train.data.media import Bucket
    from train.models import get_encoder

    v, d, m = recipe.validation, recipe.data, recipe.model
    frames = (v.num_frames or d.num_frames) if spec.latent_kind == "video" else 1
    size = Bucket(frames, v.height or d.height, v.width or d.width)
    geometry = get_encoder(spec.name).geometry(m.pretrained_path, m.revision)
    names = {"num_frames": "validation.num_frames", "height": "validation.height", "width": "validation.width"}
    problems = [names[p.split()[0]] + p[len(p.split()[0]) :] for p in geometry.problems(size)]
    if problems:
        raise UserError(f"{'; '.join(problems)} (rules from {geometry.source}); the pipeline would round it silently")
    least = get_encoder(spec.name).validation_min_frames
    if spec.latent_kind == "video" and frames < least:
        raise UserError(f"validation.num_frames {frames}: {spec.pipeline_class} renders NaN frames below {least} "
                        f"frames; set validation.num_frames to at least {least}")  # fmt: skip


def sample_paths(output_dir: str | Path, step: int, count: int, latent_kind: str) -> list[Path]:
    """Where the samples of `step` are written: output_dir/samples/step_N/<i>.mp4 (video) or <i>.png (image)."""
    ext = "mp4" if latent_kind == "video" else "png"
    return [Path(output_dir) / "samples" / f"step_{step}" / f"{i}.{ext}" for i in range(count)]


def to_uint8(x: np.ndarray) -> np.ndarray:
    """The pipelines' "np" output (floats in [0, 1]) as 8-bit pixels, as diffusers' `numpy_to_pil` rounds them."""
    return (np.clip(x, 0.0, 1.0) * 255).round().astype(np.uint8)


@contextmanager
def inference(model: torch.nn.Module):
    """eval() and no_grad for the call; afterwards every module's own train/eval flag as it was."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training


class Validation:
    """Renders the recipe's validation samples at the steps it names; every rank calls `at_step` after each step."""

    def __init__(self, recipe: Recipe, spec: FamilySpec, model: torch.nn.Module, device: torch.device,
                 amp: torch.dtype | None, metrics, watchdog=None, start: int = 0,
                 ema=None) -> None:  # fmt: skip
        self.cfg: ValidationConfig | None = recipe.validation
        self.recipe, self.spec, self.model, self.device, self.amp = recipe, spec, model, device, amp
        self.metrics, self.watchdog, self.start = metrics, watchdog, start
        # the weights samples are rendered with: the model's own, or (ema.validation) the EMA's (train/ema.py)
        self.weights = ema.swapped if ema is not None and recipe.ema.validation else nullcontext
        self.pipe = None
        if self.cfg is not None:
            check_validation(recipe, spec)
            self._load()

    # ----------------------------------------------------------------------------------------------------- when

    def due(self, step: int) -> bool:
        """Render at `step` (optimizer steps done)? Multiples of every_n_steps and the last step; step 0 with
        at_start; never again at the step a resumed run starts from (rendered before the checkpoint was written)."""
        v = self.cfg
        if v is None or (step == self.start and step > 0):
            return False
        if step == 0:
            return v.at_start
        return step % v.every_n_steps == 0 or step == self.recipe.train.max_steps

    # ---------------------------------------------------------------------------------------------------- setup

    def _load(self) -> None:
        from diffusers.utils import logging as dlogging

        from train.models import get_encoder

        m, data = self.recipe.model, self.recipe.data.resolved(self.recipe.model)
        encoder = get_encoder(self.spec.name)  # the pipeline minus its transformer(s), as train.prepare loads it
        home = torch.device("cpu") if self.cfg.offload else self.device
        text_dtype = getattr(torch, data.text_encoder_dtype)
        encoder.load(m.pretrained_path, revision=m.revision, device=home, text_dtype=text_dtype)
        self.pipe = encoder.pipe
        self.pipe.set_progress_bar_config(disable=True)
        dlogging.set_verbosity_error()  # e.g. "generator on cpu, device cuda": expected, every validation
        self._components = {n: c for n, c in self.pipe.components.items()
                            if isinstance(c, torch.nn.Module) and not n.startswith("transformer")}  # fmt: skip
        from train.experts import experts_of

        for name, transformer in experts_of(self.model).items():  # both experts: transformer and transformer_2
            setattr(self.pipe, name, transformer)  # after the move: the pipeline never moves or casts it
        if m.both_experts and m.boundary_ratio is not None:  # the recipe's boundary, as training routes by it
            self.pipe.register_to_config(boundary_ratio=m.boundary_ratio)
        self.takes = _call_parameters(self.spec)

    @contextmanager
    def _components_on_device(self):
        if not self.cfg.offload or self.device.type == "cpu":
            yield
            return
        for c in self._components.values():
            c.to(self.device)
        try:
            yield
        finally:
            for c in self._components.values():
                c.to("cpu")
            torch.cuda.empty_cache()

    def _kwargs(self, i: int, step: int) -> dict[str, Any]:
        v, data, takes = self.cfg, self.recipe.data, self.takes
        p = v.prompts[i]
        kw: dict[str, Any] = {"prompt": p.prompt, "num_inference_steps": v.num_inference_steps, "output_type": "np",
                              "height": v.height or data.height, "width": v.width or data.width,
                              "generator": torch.Generator("cpu").manual_seed(v.seed + i),
                              **self.spec.validation_kwargs}  # fmt: skip
        if "num_frames" in takes:
            kw["num_frames"] = v.num_frames or data.num_frames
        if v.guidance_scale is not None:
            kw["guidance_scale"] = v.guidance_scale
        if v.negative_prompt is not None:
            kw["negative_prompt"] = v.negative_prompt
        if p.image is not None:
            from PIL import Image

            kw["image"] = Image.open(Path(p.image).expanduser()).convert("RGB")
        for name, path in p.media.items():
            kw[name] = _video_frames(str(Path(path).expanduser()))
        if self.watchdog is not None and "callback_on_step_end" in takes:  # a long sample is progress, not a hang

            def beat(pipe, i, t, tensors):
                self.watchdog.phase("validation", step)
                return {}

            kw["callback_on_step_end"] = beat
        return kw

    # ------------------------------------------------------------------------------------------------------ run

    def at_step(self, step: int) -> list[Path]:
        """Render the samples of `step` when it is due (a collective: every rank calls it, with the same step);
        returns the files written (rank 0) or []."""
        if not self.due(step):
            return []
        if self.watchdog is not None:
            self.watchdog.phase("validation", step)
        v, rank0, t0 = self.cfg, dist.get_rank() == 0, time.perf_counter()
        paths = sample_paths(self.recipe.output_dir, step, len(v.prompts), self.spec.latent_kind)
        if rank0:
            paths[0].parent.mkdir(parents=True, exist_ok=True)
        devices = [self.device] if self.device.type == "cuda" else []
        autocast = torch.autocast(self.device.type, dtype=self.amp) if self.amp is not None else nullcontext()
        written = []
        # finetune.base_adapter: samples of the trained LoRA on the distilled base alone, as users run it
        with (self._components_on_device(), self.weights(), inference(self.model), without_base_adapter(self.model),
              torch.random.fork_rng(devices=devices), autocast):  # fmt: skip
            for i, path in enumerate(paths):
                out = self.pipe(**self._kwargs(i, step))[0][0]  # (F, H, W, 3) video or (H, W, 3) image, in [0, 1]
                out = np.asarray(out.float().cpu() if isinstance(out, torch.Tensor) else out, dtype=np.float32)
                if rank0:
                    written.append(self._write(path, out))
        if rank0:
            self.metrics.log_media(step, [(p, v.prompts[i].prompt) for i, p in enumerate(written)])
            print(f"validation: {len(written)} sample(s) of step {step} in {paths[0].parent} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
        return written

    def _write(self, path: Path, out: np.ndarray) -> Path:
        from train.data.synthetic_media import write_image, write_video

        if self.cfg.save_tensors:
            torch.save(torch.from_numpy(out), path.with_suffix(".pt"))
        if path.suffix == ".mp4":
            fps = self.cfg.fps or self.recipe.data.fps or 16.0
            return write_video(path, to_uint8(out), fps=fps, codec="libx264")  # yuv420p: plays in browsers/wandb
        return write_image(path, to_uint8(out))
