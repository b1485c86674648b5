"""Model families (train/models/<family>/) and the flow-matching objective (train/objective.py). Serial, CPU, fast.

Every test that is not about one family's quirk runs for every discovered family (`family_names()`):
(0) discovery: the packages under train/models/ are the families, each with its contract, CP plan and tiny recipe,
(1) the forward kwargs equal what the family's diffusers pipeline itself passes its transformer: the tiny pipeline's
    own `__call__` (MiniMax-H3: its modular denoise blocks) runs one step on cached embeddings written by the
    family's data encoder, with the transformer's forward wrapped to capture its kwargs, and `spec.forward_kwargs`
    of the same latents and the sigma the scheduler used must equal them; where the pipeline returns the denoised
    latents in the cache layout, `spec.predictions` must give that step too (velocity sign, unpacking),
(2) the transformer runs on them, the prediction comes back in the latent layout, and unpack(pack(x)) == x,
(3) timestep sampling is deterministic, in (0, 1) and shifted as the family's scheduler shifts,
(4) every LoRA target matches a module of the transformer,
(5) no code under train/ outside train/models/ names a family.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import diffusers
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, MiniMaxH3Scheduler, UniPCMultistepScheduler
from diffusers.utils.torch_utils import randn_tensor

import train.models
from train import objective
from train.cp.plans import plan_for
from train.data.dataset import collate, pad_text
from train.models import (
    FAMILIES,
    FamilyEncoder,
    FamilySpec,
    build_tiny_pipeline,
    family_module,
    family_names,
    get_encoder,
    get_family,
    tiny_config,
)
from train.models.spec import output_tensors
from train.tools import tiny_models as tm

NAMES = family_names()
REPO = Path(__file__).resolve().parents[1]
BATCH = 2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tiny_model(name: str) -> torch.nn.Module:
    return tm.build_model(name).eval()


def prepared(name: str, seed: int = 0):
    """spec, tiny model, and a synthetic step of BATCH samples of the family's tiny recipe shapes."""
    case = tm.family_case(name, seed, batch_size=BATCH)
    return case.spec, tiny_model(name), case.batch, case.noisy, case.sigmas, case.kwargs


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(actual, expected)


# (0) Discovery --------------------------------------------------------------------------------------------------------


def test_families_are_the_packages_of_train_models() -> None:
    folder = Path(train.models.__file__).parent
    packages = sorted(p.name for p in folder.iterdir() if (p / "__init__.py").is_file() and p.name[0] != "_")
    assert NAMES == tuple(packages) and len(NAMES) >= 7
    assert not {"spec", "encoder", "tiny"} & set(NAMES)  # shared modules, not families
    assert tuple(FAMILIES) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_family_contract(name: str) -> None:
    spec, module = get_family(name), family_module(name)
    assert isinstance(spec, FamilySpec) and spec is module.SPEC and spec.name == name
    assert spec.streams[0] == "latents"
    for cls in (spec.transformer_class, spec.pipeline_class, spec.vae_class):
        assert hasattr(diffusers, cls), cls
    # what a family needs besides its folder: a CP plan for its transformer class (variants of one class share it),
    # and a tiny recipe
    assert plan_for(spec.transformer_class).path.parent == REPO / "cp_plans"
    assert tm.tiny_recipe(name).model.family == name
    encoder = get_encoder(name)
    assert isinstance(encoder, FamilyEncoder) and encoder.name == name and encoder.pipe is None
    assert encoder is not get_encoder(name) and encoder.spec is spec
    config = tiny_config(name)
    assert config and config == tiny_config(name) and config is not tiny_config(name)  # a fresh copy per call
    assert module.__doc__ and "Cache:" in module.__doc__ and "Forward kwargs" in module.__doc__
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "x"


def test_unknown_family() -> None:
    for fn in (get_family, get_encoder, tiny_config):
        with pytest.raises(KeyError, match="unknown model family"):
            fn("sd3")


def test_tiny_pipeline_is_built_once(tmp_path: Path) -> None:
    path = build_tiny_pipeline("wan", tmp_path / "wan")
    stamp = (path / "model_index.json").stat().st_mtime_ns
    assert build_tiny_pipeline("wan", path) == path and (path / "model_index.json").stat().st_mtime_ns == stamp


# (1) Inputs equal the pipeline's own ----------------------------------------------------------------------------------
# Each driver runs the family's tiny pipeline for one denoising step (a schedule that starts at SIGMA, before the
# scheduler's own shift) on a batch its data encoder cached, and returns what the transformer received. The noise is
# either passed as `latents` (where the pipeline takes the cache layout) or drawn by the pipeline from a seeded
# generator and redrawn here in the layout the pipeline draws it (`prepare_latents`' randn shape).

SIGMA = 0.6
SEED = 0
CAPTIONS = ("a red square", "a blue circle moving up on a white background")  # unequal lengths: padded masks


@dataclass
class PipelineStep:
    batch: dict[str, torch.Tensor]  # the cached conditioning (data encoder + collate)
    noisy: dict[str, torch.Tensor]  # the step's latents, in the cache layout
    sigmas: dict[str, torch.Tensor]  # (B,) per stream: the sigma the scheduler used
    kwargs: dict[str, Any]  # what the transformer got
    out: Any  # what it returned
    config: Any  # its config
    final: dict[str, torch.Tensor] | None = None  # the pipeline's result in the cache layout, where it returns that


@pytest.fixture(scope="module")
def tiny_pipelines(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tiny_pipelines")
    return functools.cache(lambda name: build_tiny_pipeline(name, root / name))


class _Step:
    """Wraps a pipeline's transformer forward (capturing its kwargs and output) and forces its schedulers' sigmas."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, transformer: torch.nn.Module) -> None:
        self.monkeypatch, self.transformer, self.calls = monkeypatch, transformer, []
        original = transformer.forward
        names = list(inspect.signature(original).parameters)

        @functools.wraps(original)  # the pipelines read the forward's signature
        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            kwargs = {**dict(zip(names, args)), **kwargs}  # positional arguments by name (ZImagePipeline's)
            self.calls.append(({k: _clone(v) for k, v in kwargs.items()}, out))
            return out

        monkeypatch.setattr(transformer, "forward", forward)

    def force_sigmas(self, scheduler: Any, sigmas: list[float]) -> None:
        original = scheduler.set_timesteps

        @functools.wraps(original)  # retrieve_timesteps checks that set_timesteps takes `sigmas`
        def set_timesteps(*args, device=None, mu=None, **kwargs):
            return original(sigmas=sigmas, device=device, **({} if mu is None else {"mu": mu}))

        self.monkeypatch.setattr(scheduler, "set_timesteps", set_timesteps)

    def result(self, batch, noisy, sigmas, final=None) -> PipelineStep:
        assert len(self.calls) == 1, f"expected one transformer call, got {len(self.calls)}"
        kwargs, out = self.calls[0]
        return PipelineStep(batch, noisy, sigmas, kwargs, out, self.transformer.config, final)


def _clone(value: Any) -> Any:
    """A captured argument: tensors (and lists of them, Z-Image's per-sample inputs) cloned."""
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value.clone() if torch.is_tensor(value) else value


def _cached_text(name: str, path: Path, count: int, **media: torch.Tensor) -> dict[str, torch.Tensor]:
    """The family encoder's cache tensors of CAPTIONS[:count] (plus the given per-sample media tensors), collated."""
    encoder = get_encoder(name)
    encoder.load(str(path))
    tokens = encoder.text_tokens(None)  # the family's default text length, as prepare uses it
    return collate([{**encoder.encode_text(c, tokens), **media} for c in CAPTIONS[:count]])


def _recipe_latents(name: str) -> tuple[int, ...]:
    return (BATCH, *tm.tiny_recipe(name).data.synthetic.shapes["latents"])


def _one_step(pipe: Any, monkeypatch: pytest.MonkeyPatch) -> _Step:
    step = _Step(monkeypatch, pipe.transformer)
    step.force_sigmas(pipe.scheduler, [SIGMA])
    return step


def _sigma(scheduler: Any, size: int) -> torch.Tensor:
    return scheduler.sigmas[:1].expand(size)


def _drive_flux(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    batch = _cached_text("flux", path, BATCH)
    pipe = diffusers.FluxPipeline.from_pretrained(path)
    step, (b, c, h, w), s = _one_step(pipe, monkeypatch), _recipe_latents("flux"), pipe.vae_scale_factor
    pipe(prompt_embeds=batch["prompt_embeds"], pooled_prompt_embeds=batch["pooled_embeds"], height=h * s,
         width=w * s, num_inference_steps=1, generator=_gen(SEED), output_type="latent")  # fmt: skip
    noisy = randn_tensor((b, c, h, w), generator=_gen(SEED))  # prepare_latents' draw, before _pack_latents
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)})


def _drive_cosmos(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """Cosmos2_5_PredictBasePipeline text2world (no image or video: no clean frames, the cache's condition_mask all
    False): its per-frame timestep (B, 1, F, 1, 1), the condition-mask channel and the padding mask; loaded with the
    family encoder's components (a pass-through safety checker without cosmos_guardrail). UniPC's one first-order
    step to sigma 0 is the Euler step."""
    b, _, f, h, w = _recipe_latents("cosmos")
    batch = _cached_text("cosmos", path, BATCH, condition_mask=torch.zeros(f, dtype=torch.bool))
    encoder = get_encoder("cosmos")
    pipe = diffusers.Cosmos2_5_PredictBasePipeline.from_pretrained(path, **encoder.pipeline_components(str(path), None))
    step, s, t = _Step(monkeypatch, pipe.transformer), pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    step.force_sigmas(pipe.scheduler, np.array([SIGMA]))
    noisy = torch.randn(b, tiny_config("cosmos")["out_channels"], f, h, w, generator=_gen(SEED))
    final = pipe(prompt_embeds=batch["prompt_embeds"], latents=noisy, height=h * s, width=w * s,
                 num_frames=(f - 1) * t + 1, guidance_scale=1.0, num_inference_steps=1,
                 output_type="latent").frames  # fmt: skip
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_chroma(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """ChromaPipeline given the captions themselves: it encodes them and builds its attention mask (padded text of two
    lengths) itself; the cache holds the family encoder's embeddings and tokenizer mask of the same captions."""
    batch = _cached_text("chroma", path, BATCH)
    assert not batch["prompt_mask"].all()  # a padded mask reaches the transformer
    pipe = diffusers.ChromaPipeline.from_pretrained(path)
    step, (b, c, h, w), s = _one_step(pipe, monkeypatch), _recipe_latents("chroma"), pipe.vae_scale_factor
    pipe(prompt=list(CAPTIONS[:b]), height=h * s, width=w * s, num_inference_steps=1, guidance_scale=1.0,
         generator=_gen(SEED), output_type="latent")  # fmt: skip
    noisy = randn_tensor((b, c, h, w), generator=_gen(SEED))  # prepare_latents' draw, before _pack_latents
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)})


def _drive_zimage(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """ZImagePipeline given the captions themselves (it templates, encodes and drops each prompt's padding itself:
    caption features of two lengths), CFG off (guidance 0: one call); the cache holds the family encoder's features of
    the same captions. Its (positional) list inputs and negated output are checked like any family's."""
    batch = _cached_text("zimage", path, BATCH)
    assert batch["prompt_mask"].sum(dim=1).unique().numel() == BATCH  # prompts of different lengths
    pipe = diffusers.ZImagePipeline.from_pretrained(path)
    step, (b, c, h, w), s = _one_step(pipe, monkeypatch), _recipe_latents("zimage"), pipe.vae_scale_factor
    noisy = torch.randn(b, c, h, w, generator=_gen(SEED))  # the pipeline takes latents in the cache layout
    final = pipe(prompt=list(CAPTIONS[:b]), latents=noisy, height=h * s, width=w * s, num_inference_steps=1,
                 guidance_scale=0.0, output_type="latent").images  # fmt: skip
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_flux_kontext(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """The Kontext pipeline given reference latents as its image (it packs them and offsets their ids itself)."""
    pipe = diffusers.FluxKontextPipeline.from_pretrained(path)
    step, (b, c, h, w), s = _one_step(pipe, monkeypatch), _recipe_latents("flux_kontext"), pipe.vae_scale_factor
    reference = torch.randn(b, *tm.tiny_recipe("flux_kontext").data.synthetic.shapes["reference_latents"],
                            generator=_gen(3))  # fmt: skip
    batch = _cached_text("flux_kontext", path, BATCH) | {"reference_latents": reference}
    pipe(image=reference, prompt_embeds=batch["prompt_embeds"], pooled_prompt_embeds=batch["pooled_embeds"],
         height=h * s, width=w * s, max_area=h * s * w * s, num_inference_steps=1, generator=_gen(SEED),
         output_type="latent")  # fmt: skip
    noisy = randn_tensor((b, c, h, w), generator=_gen(SEED))  # prepare_latents' draw, before _pack_latents
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)})


def _drive_qwenimage_edit(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """The edit pipeline given an input image (it resizes and encodes it itself); the cache's reference latents are
    the family encoder's of the same image."""
    from PIL import Image

    encoder = get_encoder("qwenimage_edit")
    encoder.load(str(path))
    batch = _cached_text("qwenimage_edit", path, BATCH)
    image = Image.fromarray(torch.randint(0, 256, (24, 40, 3), generator=_gen(3), dtype=torch.uint8).numpy())
    image.save(path.parent / "qwenimage_edit_reference.png")
    extra = encoder.load_extra(None, None, None, None, str(path.parent / "qwenimage_edit_reference.png"))
    reference = encoder.encode_extra(extra, None, "mode", None)["reference_latents"]
    batch["reference_latents"] = reference.expand(BATCH, *reference.shape)
    pipe = diffusers.QwenImageEditPipeline.from_pretrained(path, **encoder.pipeline_components(str(path), None))
    step, (b, c, _, h, w), s = _one_step(pipe, monkeypatch), _recipe_latents("qwenimage_edit"), pipe.vae_scale_factor
    pipe(image=[image] * b, prompt_embeds=batch["prompt_embeds"], prompt_embeds_mask=batch["prompt_mask"],
         height=h * s, width=w * s, num_inference_steps=1, generator=_gen(SEED), output_type="latent")  # fmt: skip
    noisy = randn_tensor((b, 1, c, h, w), generator=_gen(SEED)).permute(0, 2, 1, 3, 4)  # drawn (B, 1, C, H, W)
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)})


def _drive_qwenimage_edit_plus(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """QwenImageEditPlusPipeline (batch size 1, the most it takes) given two input images of other aspect ratios and
    the caption itself: it resizes each image twice (its VL and VAE areas), encodes the prompt with both ("Picture 1:
    ... Picture 2: ...") and packs both images' latents after the target's; the cache holds the family encoder's
    tensors of the same images and caption. The tiny transformer has zero_cond_t (2511's timestep-0 image tokens). The
    VAE area is 128 x 128 instead of 1024 x 1024 for speed: the pipeline and the encoder read one module constant."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
    from PIL import Image

    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 128 * 128)
    encoder = get_encoder("qwenimage_edit_plus")
    encoder.load(str(path))
    images, files = [], []
    for i, (h, w) in enumerate([(24, 40), (36, 20)]):
        pixels = torch.randint(0, 256, (h, w, 3), generator=_gen(3 + i), dtype=torch.uint8)
        images.append(Image.fromarray(pixels.numpy()))
        files.append(str(path.parent / f"qwenimage_edit_plus_control_{i}.png"))
        images[-1].save(files[-1])
    extra = encoder.load_extra(None, None, None, None, files)
    item = encoder.encode_extra(extra, None, "mode", None) | encoder.encode_item_text(CAPTIONS[1], None, extra)
    batch = collate([item])
    pipe = diffusers.QwenImageEditPlusPipeline.from_pretrained(path, **encoder.pipeline_components(str(path), None))
    (_, c, _, h, w), s = _recipe_latents("qwenimage_edit_plus"), pipe.vae_scale_factor
    step = _one_step(pipe, monkeypatch)
    final = pipe(image=images, prompt=CAPTIONS[1], height=h * s, width=w * s, num_inference_steps=1,
                 generator=_gen(SEED), output_type="latent").images  # fmt: skip
    noisy = randn_tensor((1, 1, c, h, w), generator=_gen(SEED)).permute(0, 2, 1, 3, 4)  # drawn (B, 1, C, H, W)
    final = pipe._unpack_latents(final, h * s, w * s, s)  # packed (B, H*W, C) -> (B, C, 1, H, W)
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, 1)}, {"latents": final})


def _drive_flux2(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    batch = _cached_text("flux2", path, BATCH)
    pipe = diffusers.Flux2Pipeline.from_pretrained(path)
    step, (b, c, h, w), s = _one_step(pipe, monkeypatch), _recipe_latents("flux2"), pipe.vae_scale_factor
    noisy = torch.randn(b, c, h, w, generator=_gen(SEED))  # the 2x2-patchified layout Flux2Pipeline takes
    pipe(prompt_embeds=batch["prompt_embeds"], latents=noisy, height=2 * h * s, width=2 * w * s,
         num_inference_steps=1, output_type="latent")  # fmt: skip
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)})


def _drive_krea2(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """Krea2Pipeline given the captions themselves (it templates them into its fixed-length block, padded in the
    middle, and stacks the tapped layers), CFG off (guidance_scale 0: one transformer call per step), given packed
    noise; the cache holds the family encoder's text of the same captions. Its latent result is unpacked as it
    decodes."""
    batch = _cached_text("krea2", path, BATCH)
    assert not batch["prompt_mask"].all()  # a padded mask reaches the transformer
    pipe = diffusers.Krea2Pipeline.from_pretrained(path)
    step, (b, c, _, h, w), s = _one_step(pipe, monkeypatch), _recipe_latents("krea2"), pipe.vae_scale_factor
    noisy = torch.randn(b, c, 1, h, w, generator=_gen(SEED))
    final = pipe(prompt=list(CAPTIONS[:b]), latents=pipe._pack_latents(noisy[:, :, 0], b, c, h, w), height=h * s,
                 width=w * s, guidance_scale=0.0, num_inference_steps=1, output_type="latent").images  # fmt: skip
    final = pipe._unpack_latents(final, h * s, w * s)  # packed -> (B, C, 1, H, W), as it decodes
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_qwenimage(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    batch = _cached_text("qwenimage", path, BATCH)
    assert not batch["prompt_mask"].all()  # a padded mask reaches the transformer
    pipe = diffusers.QwenImagePipeline.from_pretrained(path)
    step, (b, c, _, h, w), s = _one_step(pipe, monkeypatch), _recipe_latents("qwenimage"), pipe.vae_scale_factor
    pipe(prompt_embeds=batch["prompt_embeds"], prompt_embeds_mask=batch["prompt_mask"], height=h * s, width=w * s,
         num_inference_steps=1, generator=_gen(SEED), output_type="latent")  # fmt: skip
    noisy = randn_tensor((b, 1, c, h, w), generator=_gen(SEED)).permute(0, 2, 1, 3, 4)  # drawn (B, 1, C, H, W)
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)})


def _drive_wan(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    batch = _cached_text("wan", path, BATCH)
    pipe = diffusers.WanPipeline.from_pretrained(path)
    step, (b, c, f, h, w) = _one_step(pipe, monkeypatch), _recipe_latents("wan")
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    noisy = torch.randn(b, c, f, h, w, generator=_gen(SEED))
    final = pipe(
        prompt_embeds=batch["prompt_embeds"],
        latents=noisy,
        height=h * s,
        width=w * s,
        num_frames=(f - 1) * t + 1,
        guidance_scale=1.0,
        num_inference_steps=1,
        output_type="latent",
    ).frames
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _image_to_video_step(name: str, path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """Wan 2.1 I2V-style pipelines (the family's pipeline class): one step on an input image that is frame 0 of the
    cached clip; condition_latents and image_embeds come from the family encoder."""
    from PIL import Image

    # 5 frames (2 latent frames): what ChronoEditPipeline generates unless temporal reasoning is on
    b, c, f, h, w = BATCH, tiny_config(name)["out_channels"], 2, 2, 4
    pipe = getattr(diffusers, get_family(name).pipeline_class).from_pretrained(path)
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    image = torch.randint(0, 256, (3, h * s, w * s), generator=_gen(3), dtype=torch.uint8)
    clip = torch.rand(3, (f - 1) * t + 1, h * s, w * s, generator=_gen(4)) * 2 - 1
    clip[:, 0] = image / 127.5 - 1  # the input image is frame 0
    encoder = get_encoder(name)
    encoder.load(str(path))
    media = encoder.encode_media(clip, None, "mode", None)  # condition_latents and image_embeds, as cached
    batch = _cached_text(name, path, BATCH, condition_latents=media["condition_latents"],
                         image_embeds=media["image_embeds"])  # fmt: skip
    step = _one_step(pipe, monkeypatch)
    noisy = torch.randn(b, c, f, h, w, generator=_gen(SEED))
    final = pipe(image=Image.fromarray(image.permute(1, 2, 0).numpy()), prompt_embeds=batch["prompt_embeds"],
                 latents=noisy, height=h * s, width=w * s, num_frames=(f - 1) * t + 1, guidance_scale=1.0,
                 num_inference_steps=1, output_type="latent").frames  # fmt: skip
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_chronoedit(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    return _image_to_video_step("chronoedit", path, monkeypatch)


def _drive_wan_i2v(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    return _image_to_video_step("wan_i2v", path, monkeypatch)


def _drive_wan22_ti2v(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """WanImageToVideoPipeline with expand_timesteps: the cached latents' frame 0 (the family encoder's) is the image
    the pipeline conditions on, kept clean in the noisy latents as the trainer keeps it."""
    from PIL import Image

    b, c, f, h, w = BATCH, tiny_config("wan22_ti2v")["out_channels"], 2, 2, 4
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(path)  # the folder is a WanPipeline's, as released
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    image = torch.randint(0, 256, (3, h * s, w * s), generator=_gen(3), dtype=torch.uint8)
    clip = torch.rand(3, (f - 1) * t + 1, h * s, w * s, generator=_gen(4)) * 2 - 1
    clip[:, 0] = image / 127.5 - 1
    encoder = get_encoder("wan22_ti2v")
    encoder.load(str(path))
    latents = encoder.encode_media(clip, None, "mode", None)["latents"]
    batch = _cached_text("wan22_ti2v", path, BATCH, latents=latents)
    step = _one_step(pipe, monkeypatch)
    noisy = torch.randn(b, c, f, h, w, generator=_gen(SEED))
    noisy[:, :, 0] = batch["latents"][:, :, 0]  # the clean first frame
    final = pipe(image=Image.fromarray(image.permute(1, 2, 0).numpy()), prompt_embeds=batch["prompt_embeds"],
                 latents=noisy, height=h * s, width=w * s, num_frames=(f - 1) * t + 1, guidance_scale=1.0,
                 num_inference_steps=1, output_type="latent").frames  # fmt: skip
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_wan22(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """WanPipeline with two experts: the step's sigma is below boundary_ratio, so the low-noise expert runs it."""
    batch = _cached_text("wan22", path, BATCH)
    pipe = diffusers.WanPipeline.from_pretrained(path)
    step = _Step(monkeypatch, pipe.transformer_2)  # transformer (high noise) must not run: one call of this one
    step.force_sigmas(pipe.scheduler, [SIGMA])
    b, c, f, h, w = _recipe_latents("wan22")
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    noisy = torch.randn(b, c, f, h, w, generator=_gen(SEED))
    final = pipe(prompt_embeds=batch["prompt_embeds"], latents=noisy, height=h * s, width=w * s,
                 num_frames=(f - 1) * t + 1, guidance_scale=1.0, num_inference_steps=1,
                 output_type="latent").frames  # fmt: skip
    assert float(_sigma(pipe.scheduler, 1)) < pipe.config.boundary_ratio
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_wan22_i2v(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """WanImageToVideoPipeline with two experts and no image encoder: the step's sigma is below boundary_ratio, so
    the low-noise expert runs it, on [latents | mask | condition_latents] (the family encoder's of the input image,
    frame 0 of the cached clip) and no image embeddings."""
    from PIL import Image

    b, c, f, h, w = BATCH, tiny_config("wan22_i2v")["out_channels"], 2, 2, 4
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(path)
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    image = torch.randint(0, 256, (3, h * s, w * s), generator=_gen(3), dtype=torch.uint8)
    clip = torch.rand(3, (f - 1) * t + 1, h * s, w * s, generator=_gen(4)) * 2 - 1
    clip[:, 0] = image / 127.5 - 1  # the input image is frame 0
    encoder = get_encoder("wan22_i2v")
    encoder.load(str(path))
    media = encoder.encode_media(clip, None, "mode", None)
    assert "image_embeds" not in media
    batch = _cached_text("wan22_i2v", path, BATCH, condition_latents=media["condition_latents"])
    step = _Step(monkeypatch, pipe.transformer_2)  # transformer (high noise) must not run: one call of this one
    step.force_sigmas(pipe.scheduler, [SIGMA])
    noisy = torch.randn(b, c, f, h, w, generator=_gen(SEED))
    final = pipe(image=Image.fromarray(image.permute(1, 2, 0).numpy()), prompt_embeds=batch["prompt_embeds"],
                 latents=noisy, height=h * s, width=w * s, num_frames=(f - 1) * t + 1, guidance_scale=1.0,
                 num_inference_steps=1, output_type="latent").frames  # fmt: skip
    assert float(_sigma(pipe.scheduler, 1)) < pipe.config.boundary_ratio
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_wan_vace(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """WanVACEPipeline (one video per call: batch 1) given the control video's frames and no mask: it preprocesses
    and encodes them and builds the mask cells itself; the cache holds the family encoder's control_latents of the
    same frames."""
    from PIL import Image

    b, c, f, h, w = 1, tiny_config("wan_vace")["out_channels"], 2, 2, 4
    pipe = diffusers.WanVACEPipeline.from_pretrained(path)
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    control = torch.randint(0, 256, ((f - 1) * t + 1, 3, h * s, w * s), generator=_gen(3), dtype=torch.uint8)
    encoder = get_encoder("wan_vace")
    encoder.load(str(path))
    batch = _cached_text("wan_vace", path, b, control_latents=encoder.control_latents(control))
    step = _one_step(pipe, monkeypatch)
    noisy = torch.randn(b, c, f, h, w, generator=_gen(SEED))
    final = pipe(video=[Image.fromarray(x.permute(1, 2, 0).numpy()) for x in control],
                 prompt_embeds=batch["prompt_embeds"], latents=noisy, height=h * s, width=w * s,
                 num_frames=(f - 1) * t + 1, guidance_scale=1.0, num_inference_steps=1,
                 output_type="latent").frames  # fmt: skip
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_wan_animate(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """WanAnimatePipeline in animation mode, one segment of the clip's frames, given a reference image of another
    shape (it letterboxes it), a pose video and a face video of another size (it resizes the face frames to the
    motion encoder's): the cache holds the family encoder's conditioning of the same media; the noise covers the
    reference frame and the clip's T latent frames."""
    from PIL import Image

    b, c, f, h, w = BATCH, tiny_config("wan_animate")["out_channels"], 2, 2, 4  # 5 frames: 2 latent frames + 1
    pipe = diffusers.WanAnimatePipeline.from_pretrained(path)
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    frames, gen = (f - 1) * t + 1, _gen(3)
    image = torch.randint(0, 256, (3, 24, 24), generator=gen, dtype=torch.uint8)
    pose = torch.randint(0, 256, (frames, 3, h * s, w * s), generator=gen, dtype=torch.uint8)
    face = torch.randint(0, 256, (frames, 3, 24, 20), generator=gen, dtype=torch.uint8)
    pil = lambda x: Image.fromarray(x.permute(1, 2, 0).numpy())  # noqa: E731
    encoder = get_encoder("wan_animate")
    encoder.load(str(path))
    media = encoder.conditioning(pil(image), pose, face)
    del media["reference_frame"]  # the clean value of the noised frame 0, not a conditioning input
    batch = _cached_text("wan_animate", path, b, **media)
    step = _one_step(pipe, monkeypatch)
    noisy = torch.randn(b, c, f + 1, h, w, generator=_gen(SEED))
    final = pipe(image=pil(image), pose_video=[pil(x) for x in pose], face_video=[pil(x) for x in face],
                 prompt_embeds=batch["prompt_embeds"], latents=noisy, height=h * s, width=w * s,
                 segment_frame_length=frames, guidance_scale=1.0, num_inference_steps=1,
                 output_type="latent").frames  # fmt: skip
    # its "latent" output is what it decodes: the denoised latents un-normalised (z * std + mean); normalised again
    vae = pipe.vae.config
    mean, std = (torch.tensor(v).view(1, c, 1, 1, 1) for v in (vae.latents_mean, vae.latents_std))
    final = (final - mean) / std
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_skyreels_v2(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """SkyReelsV2DiffusionForcingPipeline, asynchronous (ar_step=1, one frame per block), stopped after its first
    transformer call: frame 0 at the step's timestep, the later frames at generate_timestep_matrix's not-started 999,
    a non-decreasing per-frame (B, F) timestep as the family trains. Its step matrix holds int64 timesteps (UniPC
    truncates sigma * 1000), so the schedule starts where the shifted sigma is 0.875 (7/8: sigma * 1000 is an integer
    in float32 too), and the captured timestep is compared as float32: the transformer's sinusoidal embedding casts it
    to float first, so the same integers are the same input. One sample: with two, the pipeline's own transformer
    call fails (its forward adds the per-sample fps projection repeated per frame, (F * B, 6, D), to the timestep
    projection (B, F, 6, D); build_inputs passes one fps index for a batch that shares it)."""
    batch = _cached_text("skyreels_v2", path, 1)
    pipe = diffusers.SkyReelsV2DiffusionForcingPipeline.from_pretrained(path)
    step, (_, c, f, h, w), b = _Step(monkeypatch, pipe.transformer), _recipe_latents("skyreels_v2"), 1
    shift = pipe.scheduler.config.flow_shift
    # UniPC takes an array; the per-frame schedulers are deep copies made after this set_timesteps (their own
    # set_timesteps, the patched function deep-copied as is, resets this one to the same sigmas)
    step.force_sigmas(pipe.scheduler, np.array([0.875 / (shift - (shift - 1) * 0.875)]))
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal

    def stop(pipe, i, timestep, tensors):  # the later frames would each take further calls
        pipe._interrupt = True
        return {}

    # no `latents=`: its prepare_latents returns them alone where __call__ unpacks four values (diffusers 0.42.1)
    final = pipe(prompt=None, prompt_embeds=batch["prompt_embeds"], height=h * s, width=w * s,
                 num_frames=(f - 1) * t + 1, guidance_scale=1.0, num_inference_steps=1, ar_step=1,
                 generator=_gen(SEED), callback_on_step_end=stop, output_type="latent").frames  # fmt: skip
    noisy = randn_tensor((b, c, f, h, w), generator=_gen(SEED))  # prepare_latents' draw
    sigma = float(pipe.scheduler.sigmas[0])
    sigmas = torch.full((b, 1, f, 1, 1), 0.999)
    sigmas[:, :, 0] = sigma
    run = step.result(batch, {"latents": noisy}, {"latents": sigmas})
    timestep = run.kwargs["timestep"]
    assert timestep.dtype == torch.int64 and timestep.tolist() == [[round(sigma * 1000)] + [999] * (f - 1)] * b
    run.kwargs["timestep"] = timestep.float()
    # Only frame 0 was stepped (UniPC's one first-order step to sigma 0: x0 = x - sigma * v); the later frames are
    # unchanged, so the generic per-frame Euler check (which steps every frame) does not apply: checked here.
    pred = get_family("skyreels_v2").predictions(run.out, {"latents": noisy.shape}, model_config=run.config)["latents"]
    torch.testing.assert_close(final[:, :, 0], noisy[:, :, 0] - sigma * pred[:, :, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final[:, :, 1:], noisy[:, :, 1:], rtol=0, atol=0)
    return run


def _drive_ltx(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    batch = _cached_text("ltx", path, BATCH, frame_rate=torch.tensor(24.0))
    assert not batch["prompt_mask"].all()  # a padded mask reaches the transformer
    pipe = diffusers.LTXPipeline.from_pretrained(path)
    step, (b, c, f, h, w) = _one_step(pipe, monkeypatch), _recipe_latents("ltx")
    s, t = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
    pipe(prompt_embeds=batch["prompt_embeds"], prompt_attention_mask=batch["prompt_mask"], height=h * s,
         width=w * s, num_frames=(f - 1) * t + 1, frame_rate=24, guidance_scale=1.0, num_inference_steps=1,
         generator=_gen(SEED), output_type="latent")  # fmt: skip
    noisy = randn_tensor((b, c, f, h, w), generator=_gen(SEED))  # prepare_latents' draw, before _pack_latents
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)})


def _drive_ltx_i2v(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """LTXImageToVideoPipeline: the cached latents' frame 0 (the family encoder's) is the image the pipeline conditions
    on, kept clean in the noisy latents as the trainer keeps it; per-token timesteps; only frames 1.. stepped."""
    from PIL import Image

    pipe = diffusers.LTXImageToVideoPipeline.from_pretrained(path)
    b, c, f, h, w = BATCH, pipe.transformer.config.in_channels, 2, 1, 2
    s, t = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
    image = torch.randint(0, 256, (3, h * s, w * s), generator=_gen(3), dtype=torch.uint8)
    clip = torch.rand(3, (f - 1) * t + 1, h * s, w * s, generator=_gen(4)) * 2 - 1
    clip[:, 0] = image / 127.5 - 1
    encoder = get_encoder("ltx_i2v")
    encoder.load(str(path))
    latents = encoder.encode_media(clip, None, "mode", 24.0)["latents"]
    batch = _cached_text("ltx_i2v", path, BATCH, latents=latents, frame_rate=torch.tensor(24.0))
    assert not batch["prompt_mask"].all()  # a padded mask reaches the transformer
    step = _one_step(pipe, monkeypatch)
    noisy = torch.randn(b, c, f, h, w, generator=_gen(SEED))
    noisy[:, :, 0] = batch["latents"][:, :, 0]  # the clean first frame
    final = pipe(image=Image.fromarray(image.permute(1, 2, 0).numpy()), prompt_embeds=batch["prompt_embeds"],
                 prompt_attention_mask=batch["prompt_mask"], latents=pipe._pack_latents(noisy), height=h * s,
                 width=w * s, num_frames=(f - 1) * t + 1, frame_rate=24, guidance_scale=1.0, num_inference_steps=1,
                 output_type="latent").frames  # fmt: skip
    final = pipe._unpack_latents(final, f, h, w)
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_ltx2(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """LTX2Pipeline, one step on both streams: the cached connector outputs of the family encoder as the prompt (the
    pipeline's connectors run on the raw Gemma states, so the step is driven through them: the same captions'
    `encode_prompt` states), video latents packed (not normalised again), audio latents given so that the pipeline's
    own normalisation makes them the noisy audio; its final latents renormalised into the cache layout."""
    batch = _cached_text("ltx2", path, BATCH, frame_rate=torch.tensor(24.0))
    pipe = diffusers.LTX2Pipeline.from_pretrained(path)
    # sigmas through the call, not force_sigmas: the pipeline deep-copies its scheduler for the audio stream
    step = _Step(monkeypatch, pipe.transformer)
    b, c, f, h, w = _recipe_latents("ltx2")
    s, t = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
    num_frames = (f - 1) * t + 1
    audio_frames = round(num_frames / 24 * pipe.audio_sampling_rate / pipe.audio_hop_length / 4)
    mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
    noisy = torch.randn(b, c, f, h, w, generator=_gen(SEED))
    audio = torch.randn(b, pipe.audio_vae.config.latent_channels, audio_frames, mel, generator=_gen(SEED + 1))
    mean, std = pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std
    given = pipe._unpack_audio_latents(pipe._denormalize_audio_latents(pipe._pack_audio_latents(audio), mean, std),
                                       audio_frames, mel)  # fmt: skip
    embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS[:BATCH], do_classifier_free_guidance=False)
    video_out, audio_out = pipe(prompt_embeds=embeds, prompt_attention_mask=mask, latents=pipe._pack_latents(noisy),
                                audio_latents=given, height=h * s, width=w * s, num_frames=num_frames, frame_rate=24,
                                sigmas=[SIGMA], guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0,
                                audio_guidance_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0,
                                num_inference_steps=1, output_type="latent", return_dict=False)  # fmt: skip
    vae = pipe.vae  # (no guidance of any kind above: one conditional transformer call)
    final = {"latents": pipe._normalize_latents(video_out, vae.latents_mean, vae.latents_std,
                                                vae.config.scaling_factor),
             "audio_latents": pipe._unpack_audio_latents(pipe._normalize_audio_latents(
                 pipe._pack_audio_latents(audio_out), mean, std), audio_frames, mel)}  # fmt: skip
    sigma = _sigma(pipe.scheduler, b)
    return step.result(batch, {"latents": noisy, "audio_latents": audio}, {"latents": sigma, "audio_latents": sigma},
                       final)  # fmt: skip


def _drive_hunyuan_video(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    from train.models.hunyuan_video.spec import GUIDANCE_SCALE

    batch = _cached_text("hunyuan_video", path, BATCH)
    assert not batch["prompt_mask"].all()  # a padded mask reaches the transformer
    pipe = diffusers.HunyuanVideoPipeline.from_pretrained(path)
    step, (b, c, f, h, w) = _one_step(pipe, monkeypatch), _recipe_latents("hunyuan_video")
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    noisy = torch.randn(b, c, f, h, w, generator=_gen(SEED))  # the pipeline takes latents in the cache layout
    final = pipe(prompt_embeds=batch["prompt_embeds"], pooled_prompt_embeds=batch["pooled_embeds"],
                 prompt_attention_mask=batch["prompt_mask"], latents=noisy, height=h * s, width=w * s,
                 num_frames=(f - 1) * t + 1, guidance_scale=GUIDANCE_SCALE, num_inference_steps=1,
                 output_type="latent").frames  # fmt: skip
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_hunyuan_video15(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    batch = _cached_text("hunyuan_video15", path, BATCH)
    assert not batch["prompt_mask"].all()  # a padded mask reaches the transformer
    pipe = diffusers.HunyuanVideo15Pipeline.from_pretrained(path)
    pipe.guider = pipe.guider.new(guidance_scale=1.0)  # CFG off: the one conditional transformer call per step
    step, (b, c, f, h, w) = _one_step(pipe, monkeypatch), _recipe_latents("hunyuan_video15")
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    noisy = torch.randn(b, c, f, h, w, generator=_gen(SEED))  # the pipeline takes latents in the cache layout
    final = pipe(prompt_embeds=batch["prompt_embeds"], prompt_embeds_mask=batch["prompt_mask"],
                 prompt_embeds_2=batch["byt5_embeds"], prompt_embeds_mask_2=batch["byt5_mask"], latents=noisy,
                 height=h * s, width=w * s, num_frames=(f - 1) * t + 1, num_inference_steps=1,
                 output_type="latent").frames  # fmt: skip
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_hunyuanimage(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """HunyuanImagePipeline given the captions themselves (it encodes them: the Qwen template and the 34 tokens it
    drops, the ByT5 glyph text), its guider off: the one conditional transformer call per step."""
    batch = _cached_text("hunyuanimage", path, BATCH)
    assert not batch["prompt_mask"].all()  # a padded mask reaches the transformer
    pipe = diffusers.HunyuanImagePipeline.from_pretrained(path)
    pipe.guider = pipe.guider.new(enabled=False)
    step, (b, c, h, w), s = _one_step(pipe, monkeypatch), _recipe_latents("hunyuanimage"), pipe.vae_scale_factor
    noisy = torch.randn(b, c, h, w, generator=_gen(SEED))  # the pipeline takes latents in the cache layout
    final = pipe(prompt=list(CAPTIONS[:b]), latents=noisy, height=h * s, width=w * s, num_inference_steps=1,
                 output_type="latent").images  # fmt: skip
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_kandinsky5(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """Kandinsky5T2VPipeline given two captions of one token length (its transformer takes no text mask: a batch
    shares one text length) that it encodes itself; it draws the noise channels-last and appends T2V's zero condition
    and mask; the cache holds the family encoder's embeddings of the same captions."""
    captions = ("a red square", "a red circle")
    encoder = get_encoder("kandinsky5")
    encoder.load(str(path))
    batch = collate([encoder.encode_text(c, encoder.text_tokens(None)) for c in captions])
    assert batch["prompt_mask"].all()  # one length: nothing padded
    pipe = diffusers.Kandinsky5T2VPipeline.from_pretrained(path, **encoder.pipeline_components(str(path), None))
    step, (b, c, f, h, w) = _one_step(pipe, monkeypatch), _recipe_latents("kandinsky5")
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    final = pipe(prompt=list(captions), height=h * s, width=w * s, num_frames=(f - 1) * t + 1, guidance_scale=1.0,
                 num_inference_steps=1, generator=_gen(SEED), output_type="latent").frames  # fmt: skip
    noisy = randn_tensor((b, f, h, w, c), generator=_gen(SEED)).permute(0, 4, 1, 2, 3)  # prepare_latents' draw
    sigmas, final = _sigma(pipe.scheduler, b), final.permute(0, 4, 1, 2, 3)
    return step.result(batch, {"latents": noisy}, {"latents": sigmas}, {"latents": final})


def _drive_kandinsky5_i2v(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """Kandinsky5I2VPipeline given an 8-bit image and two captions of one token length: it draws the noise
    channels-last, then encodes the image into latent frame 0 (sampling its posterior with the same generator: the
    cache samples it with the generator in that state), appends the zero condition and the first-frame mask, passes one
    timestep for all frames and steps frames 1.. only. The cache is the family encoder's, of a clip whose frame 0 is
    that image. Its decode-time normalize_first_frame (a statistics fix of the first 4 latent frames) is off: the
    result is the step's own latents."""
    from PIL import Image

    captions = ("a red square", "a red circle")
    encoder = get_encoder("kandinsky5_i2v")
    encoder.load(str(path))
    pipe = diffusers.Kandinsky5I2VPipeline.from_pretrained(path, **encoder.pipeline_components(str(path), None))
    b, c, f, h, w = _recipe_latents("kandinsky5_i2v")
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    image = torch.randint(0, 256, (3, h * s, w * s), generator=_gen(3), dtype=torch.uint8)
    clip = torch.rand(3, (f - 1) * t + 1, h * s, w * s, generator=_gen(4)) * 2 - 1
    clip[:, 0] = image / 127.5 - 1  # the input image is frame 0
    generator = _gen(SEED)
    noise = randn_tensor((b, f, h, w, c), generator=generator)  # prepare_latents' draw, then its image's posterior
    latents = encoder.encode_media(clip, generator, "sample", None)["latents"]
    batch = collate([{**encoder.encode_text(x, encoder.text_tokens(None)), "latents": latents} for x in captions])
    assert batch["prompt_mask"].all()  # one length: nothing padded
    step = _one_step(pipe, monkeypatch)
    monkeypatch.setattr(pipe, "normalize_first_frame", lambda latents: latents)
    final = pipe(image=Image.fromarray(image.permute(1, 2, 0).numpy()), prompt=list(captions), height=h * s,
                 width=w * s, num_frames=(f - 1) * t + 1, guidance_scale=1.0, num_inference_steps=1,
                 generator=_gen(SEED), output_type="latent").frames  # fmt: skip
    noisy = noise.permute(0, 4, 1, 2, 3).clone()
    noisy[:, :, 0] = batch["latents"][:, :, 0]  # the clean first frame
    sigmas, final = _sigma(pipe.scheduler, b), final.permute(0, 4, 1, 2, 3)
    return step.result(batch, {"latents": noisy}, {"latents": sigmas}, {"latents": final})


def _drive_qwenimage21(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """QwenImage21Pipeline given the captions themselves (it templates and encodes them and pads the batch to its
    longest prompt), without its prefix KV cache (every step runs the whole joint sequence, as training does); the
    cache holds the family encoder's text of the same captions padded beyond that, as a cache whose longest caption is
    longer pads them (the spec trims them back). The prediction is the last H*W tokens of the joint output."""
    encoder = get_encoder("qwenimage21")
    encoder.load(str(path))
    items = [encoder.encode_text(c, encoder.text_tokens(None)) for c in CAPTIONS[:BATCH]]
    batch = collate([pad_text(it, max(len(i["prompt_embeds"]) for i in items) + 3) for it in items])
    pipe = diffusers.QwenImage21Pipeline.from_pretrained(path, **encoder.pipeline_components(str(path), None))
    step, (b, c, _, h, w), s = _one_step(pipe, monkeypatch), _recipe_latents("qwenimage21"), pipe.vae_scale_factor
    final = pipe(prompt=list(CAPTIONS[:b]), height=h * s, width=w * s, num_inference_steps=1, use_kv_cache=False,
                 generator=_gen(SEED), output_type="latent").images  # fmt: skip
    noisy = randn_tensor((b, 1, c, h, w), generator=_gen(SEED)).permute(0, 2, 1, 3, 4)  # drawn (B, 1, C, H, W)
    final = pipe._unpack_latents(final, h * s, w * s, s)  # packed (B, H*W, C) -> (B, C, 1, H, W), as it decodes
    return step.result(batch, {"latents": noisy}, {"latents": _sigma(pipe.scheduler, b)}, {"latents": final})


def _drive_minimax_h3(path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineStep:
    """The modular pipeline's t2va core denoise blocks (layout, latents, timesteps, denoise loop, unpack) for one
    sample (the pipeline generates one), at its shortest duration (5 s: 124 frames, 37 latent frames)."""
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MINIMAX_H3_TEXT_TAG, audio_latent_num_frames

    batch = _cached_text("minimax_h3", path, 1)
    pipe = MiniMaxH3CoreDenoiseStep().init_pipeline(str(path))
    pipe.load_components(dtype=torch.float32)
    step = _Step(monkeypatch, pipe.transformer)
    step.force_sigmas(pipe.scheduler, [SIGMA, 0.0])  # MiniMaxH3Scheduler sigmas end at 0
    step.force_sigmas(pipe.audio_scheduler, [SIGMA / 2, 0.0])
    frames, side = 124, 32
    video = torch.randn(1, tiny_config("minimax_h3")["in_channels"], 37, side // 16, side // 16, generator=_gen(1))
    audio = torch.randn(2, 32, audio_latent_num_frames(frames), generator=_gen(2))
    text = batch["prompt_embeds"]
    state = pipe(latents=video, audio_latents=audio, prompt_embeds=text, height=side, width=side, num_frames=frames,
                 text_token_tags=torch.full(text.shape[1:2], MINIMAX_H3_TEXT_TAG), num_inference_steps=2,
                 output=["latents", "audio_latents"])  # fmt: skip
    noisy = {"latents": video, "audio_latents": audio[None]}  # the cache layout (B, 2, 32, N)
    sigmas = {"latents": _sigma(pipe.scheduler, 1), "audio_latents": _sigma(pipe.audio_scheduler, 1)}
    final = {"latents": state["latents"], "audio_latents": state["audio_latents"][None]}
    return step.result(batch, noisy, sigmas, final)


PIPELINE_DRIVERS: dict[str, Callable[[Path, pytest.MonkeyPatch], PipelineStep]] = {
    name.removeprefix("_drive_"): fn for name, fn in globals().items() if name.startswith("_drive_")
}


def _assert_kwargs_equal(ours: dict[str, Any], theirs: dict[str, Any], name: str) -> None:
    assert set(ours) <= set(theirs), f"{name}: the pipeline passes no {sorted(set(ours) - set(theirs))}"
    for key, value in ours.items():
        got = theirs[key]
        if isinstance(value, list) and value and all(torch.is_tensor(v) for v in value):  # per-sample (Z-Image)
            assert isinstance(got, list) and len(got) == len(value), (name, key, got)
            for i, (v, g) in enumerate(zip(value, got)):
                assert torch.is_tensor(g) and v.dtype == g.dtype, (key, i, v.dtype, g)
                torch.testing.assert_close(v, g, msg=lambda m, k=f"{key}[{i}]": f"{name}.{k}: {m}")
        elif torch.is_tensor(value):
            assert torch.is_tensor(got) and value.dtype == got.dtype, (key, value.dtype, got)
            torch.testing.assert_close(value, got, msg=lambda m, k=key: f"{name}.{k}: {m}")
        else:
            assert value == got, (name, key, value, got)
    extra = {k: v for k, v in theirs.items() if k not in ours and k != "return_dict"}
    assert all(v is None or v == {} for v in extra.values()), f"{name}: the pipeline also passes {extra}"


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_forward_kwargs_match_the_pipeline_step(name: str, tiny_pipelines, monkeypatch: pytest.MonkeyPatch) -> None:
    assert name in PIPELINE_DRIVERS, f"tests/test_families.py: add _drive_{name} (how its pipeline runs one step)"
    run = PIPELINE_DRIVERS[name](tiny_pipelines(name), monkeypatch)
    spec = get_family(name)
    assert float(run.sigmas["latents"].flatten()[0]) not in (0.0, 1.0)  # a step where the timestep convention shows
    # clean conditioning (Wan 2.2 TI2V's first frame): per-element sigmas, 0 there, as the trainer passes them
    cond = spec.conditioning(run.batch, run.noisy["latents"])
    element = {**run.sigmas, "latents": objective.condition_sigmas(run.sigmas["latents"], cond)}
    ours = spec.forward_kwargs(run.batch, run.noisy, element, model_config=run.config)
    _assert_kwargs_equal(ours, run.kwargs, name)
    preds = spec.predictions(run.out, {s: x.shape for s, x in run.noisy.items()}, model_config=run.config)
    assert {s: p.shape for s, p in preds.items()} == {s: x.shape for s, x in run.noisy.items()}
    if run.final is not None:  # one Euler step from sigma to 0: x0 = x_sigma - sigma * (noise - x0) in our convention
        for s, x in run.noisy.items():
            sigma = element[s] if element[s].ndim == x.ndim else element[s].view(-1, *[1] * (x.ndim - 1))
            torch.testing.assert_close(run.final[s], x - sigma * preds[s], rtol=1e-5, atol=1e-5)


def test_every_family_has_a_pipeline_driver() -> None:
    assert set(PIPELINE_DRIVERS) == set(NAMES)


def test_qwenimage_drops_an_all_ones_mask() -> None:
    spec, model, batch, noisy, sigmas, kw = prepared("qwenimage")
    _assert_same(kw["encoder_hidden_states_mask"], batch["prompt_mask"])
    batch["prompt_mask"] = torch.ones_like(batch["prompt_mask"])  # as QwenImagePipeline.encode_prompt
    assert spec.forward_kwargs(batch, noisy, sigmas, model_config=model.config)["encoder_hidden_states_mask"] is None


def test_minimax_h3_batch_shares_layout() -> None:
    spec, model, batch, noisy, sigmas, _ = prepared("minimax_h3")
    assert spec.shared_timestep and spec.velocity_sign == -1.0
    for stream in spec.streams:
        assert torch.equal(sigmas[stream], sigmas[stream][:1].expand(BATCH))
    assert not torch.equal(sigmas["latents"], sigmas["audio_latents"])  # shift 12 vs 3 of one base draw
    bad = {**sigmas, "latents": torch.tensor([0.3, 0.6])}
    with pytest.raises(ValueError, match="same for every sample"):
        spec.forward_kwargs(batch, noisy, bad, model_config=model.config)
    # A prompt_mask shared by the batch drops padding rows from the packed text.
    length = batch["prompt_embeds"].shape[1]
    batch["prompt_mask"] = (torch.arange(length) < 3).expand(BATCH, length)
    kw = spec.forward_kwargs(batch, noisy, sigmas, model_config=model.config)
    _assert_same(kw["encoder_hidden_states"], batch["prompt_embeds"][:, :3])
    assert kw["text_indices"].numel() == 3


# (2) Forward runs, output in latent layout, unpack(pack(x)) == x ------------------------------------------------------


def _packed_like_outputs(kwargs: dict[str, Any], out: list[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
    """The packed noisy inputs in the places of the model's outputs (same shapes), or None where an output has no
    such input (ChronoEdit's hidden_states carry the condition channels too)."""
    inputs = [v for v in kwargs.values() if torch.is_tensor(v)]
    matched = [next((x for x in inputs if x.shape == o.shape), None) for o in out]
    return None if any(m is None for m in matched) else tuple(matched)


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_forward_and_unpack(name: str) -> None:
    spec, model, batch, noisy, sigmas, kw = prepared(name)
    shapes = {k: v.shape for k, v in noisy.items()}
    out = model(**kw, return_dict=False)
    preds = spec.predictions(out, shapes, model_config=model.config)
    assert set(preds) == set(spec.streams)
    for stream, pred in preds.items():
        assert pred.shape == shapes[stream], (stream, pred.shape, shapes[stream])
        assert torch.isfinite(pred).all()
    # predictions are in the `noise - x0` convention: MiniMax-H3's raw output is negated
    raw = spec.unpack_output(out, shapes, model_config=model.config)
    torch.testing.assert_close(preds["latents"], spec.velocity_sign * raw["latents"])
    # the loss runs on them
    targets = {s: objective.flow_matching_target(batch[s], noisy[s]) for s in spec.streams}
    losses = objective.stream_losses(preds, targets)
    assert all(torch.isfinite(v) and v.ndim == 0 for v in losses.values())

    packed = _packed_like_outputs(kw, output_tensors(out))
    if packed is not None:
        roundtrip = spec.unpack_output(packed, shapes, model_config=model.config)
        for stream in spec.streams:
            _assert_same(roundtrip[stream], noisy[stream])


def test_forward_with_grad_reaches_lora_targets() -> None:
    spec, model, batch, noisy, sigmas, kw = prepared("flux")
    model.train()
    preds = spec.predictions(model(**kw, return_dict=False), noisy["latents"].shape, model_config=model.config)
    loss = objective.flow_matching_loss(preds["latents"], noisy["latents"], objective.loss_weight(sigmas["latents"]))
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if n.endswith("attn.to_q.weight")]
    assert grads and all(g is not None and torch.any(g) for g in grads)


# (3) Timestep sampling -----------------------------------------------------------------------------------------------


def _scheduler_sigmas(shift_spec, u: torch.Tensor, mu: float | None) -> torch.Tensor:
    """The family scheduler's own shift of base sigmas u."""
    config = dict(shift_spec.scheduler_config)
    if shift_spec.scheduler_class == "UniPCMultistepScheduler":
        scheduler = UniPCMultistepScheduler.from_config(config)
        scheduler.set_timesteps(sigmas=u.numpy())
        return scheduler.sigmas[:-1].float()
    if shift_spec.scheduler_class == "FlowMatchEulerDiscreteScheduler":
        config["shift_terminal"] = None  # inference-schedule stretching, not part of the per-sigma shift
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        scheduler.set_timesteps(sigmas=u.numpy(), mu=mu)
        return scheduler.sigmas[:-1].float()
    raise AssertionError(shift_spec.scheduler_class)


def _pipeline_mu(spec: FamilySpec, image_seq_len: int) -> float | None:
    """mu as the family's pipeline module computes it from its scheduler config (None: static shift): its own
    `calculate_shift`, or Flux.2's `compute_empirical_mu` at the pipeline's default step count."""
    if spec.shift.kind == "static":
        return None
    module = sys.modules[getattr(diffusers, spec.pipeline_class).__module__]
    cfg = spec.shift.scheduler_config
    if hasattr(module, "calculate_shift"):
        args = (cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"], cfg["max_shift"])
        return module.calculate_shift(image_seq_len, *args)
    return module.compute_empirical_mu(image_seq_len=image_seq_len, num_steps=50)


def matches_lora_target(module_name: str, target: str) -> bool:
    """Whether peft's ``target_modules=[target]`` selects ``module_name`` (exact name or ``.``-suffix match)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    return bool(check_target_module_exists(LoraConfig(target_modules=[target]), module_name))


def sigmas(batch_size: int, spec: FamilySpec, **kwargs: Any) -> torch.Tensor:
    """The primary stream's sigmas, as the trainer draws them."""
    return objective.sample_stream_sigmas(batch_size, spec, **kwargs)["latents"]


def _latents_shape(name: str) -> tuple[int, ...]:
    return tuple(tm.tiny_recipe(name).data.synthetic.shapes["latents"])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scheme", get_args(objective.SamplingScheme))
def test_sample_timesteps_deterministic_and_in_range(name: str, scheme: str) -> None:
    spec = get_family(name)
    seq_len = spec.image_seq_len(_latents_shape(name))
    draw = lambda seed: sigmas(64, spec, scheme=scheme, image_seq_len=seq_len, generator=_gen(seed))  # noqa: E731
    a, b, c = draw(0), draw(0), draw(1)
    assert a.shape == (64,) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert bool(((a > 0) & (a < 1)).all())
    if spec.shared_timestep:
        assert torch.equal(a, a[:1].expand(64))
    for stream in spec.streams:
        s = objective.sample_stream_sigmas(8, spec, scheme=scheme, image_seq_len=seq_len, generator=_gen(3))[stream]
        assert bool(((s > 0) & (s < 1)).all())


@pytest.mark.parametrize("name", NAMES)
def test_shift_matches_scheduler(name: str) -> None:
    spec = get_family(name)
    u = torch.tensor([0.02, 0.1, 0.25, 0.5, 0.75, 0.9, 0.98])
    for seq_len in (256, 1024, 4608, 9000):
        mu = _pipeline_mu(spec, seq_len)
        for stream in spec.streams:
            shift_spec = spec.stream_shift(stream)
            ours = objective.shift_sigmas(u, shift_spec, seq_len)
            if shift_spec.scheduler_class == "MiniMaxH3Scheduler":
                base = torch.linspace(1.0, 0.0, 9)
                scheduler = MiniMaxH3Scheduler(**shift_spec.scheduler_config)
                scheduler.set_timesteps(9)
                torch.testing.assert_close(objective.shift_sigmas(base, shift_spec), scheduler.sigmas)
                continue
            if mu is not None:
                assert shift_spec.kind == "dynamic"
                assert shift_spec.mu(seq_len) == pytest.approx(mu, rel=1e-12)
            torch.testing.assert_close(ours, _scheduler_sigmas(shift_spec, u, mu), rtol=1e-6, atol=1e-6)
    # the primary stream's sigmas = the shifted base draw
    seq_len = spec.image_seq_len(_latents_shape(name))
    u = objective.sample_base(1 if spec.shared_timestep else 16, generator=_gen(7)).expand(16)
    expected = objective.shift_sigmas(u, spec.shift, seq_len).clamp(objective.SIGMA_EPS, 1 - objective.SIGMA_EPS)
    _assert_same(sigmas(16, spec, image_seq_len=seq_len, generator=_gen(7)), expected)


def test_dynamic_shift_needs_seq_len_and_depends_on_it() -> None:
    spec = get_family("flux")
    with pytest.raises(ValueError, match="image_seq_len"):
        sigmas(4, spec, generator=_gen(0))
    small = sigmas(256, spec, image_seq_len=256, generator=_gen(0))
    large = sigmas(256, spec, image_seq_len=4096, generator=_gen(0))
    assert bool((large >= small).all()) and large.mean() > small.mean()  # larger images -> noisier
    assert get_family("wan").image_seq_len((4, 5, 2, 14)) is None  # a static shift needs no resolution


def test_objective_pieces() -> None:
    gen = _gen(0)
    x0 = torch.randn(3, 4, 5, generator=gen)
    noise = objective.sample_noise(x0.shape, generator=gen)
    sigmas = torch.tensor([0.1, 0.5, 0.9])
    noisy = objective.add_noise(x0, noise, sigmas)
    torch.testing.assert_close(noisy[1], 0.5 * x0[1] + 0.5 * noise[1])
    target = objective.flow_matching_target(x0, noise)
    _assert_same(target, noise - x0)
    # x0 = noisy - sigma * v, for the v = noise - x0 velocity
    torch.testing.assert_close(noisy - sigmas[:, None, None] * target, x0)

    assert torch.equal(objective.loss_weight(sigmas, "none"), torch.ones(3))
    torch.testing.assert_close(objective.loss_weight(sigmas, "sigma_sqrt"), sigmas**-2)
    torch.testing.assert_close(objective.loss_weight(sigmas, "cosmap"), 2 / (np.pi * (1 - 2 * sigmas + 2 * sigmas**2)))
    # (an unknown scheme is refused by the recipe schema: train.timestep_sampling / train.loss_weighting are Literals)

    pred = target + torch.randn(target.shape, generator=gen)
    weights = torch.tensor([1.0, 2.0, 0.0])
    per_sample = ((pred - target) ** 2).reshape(3, -1).mean(dim=1)
    torch.testing.assert_close(objective.flow_matching_loss(pred, target, weights), (per_sample * weights).mean())
    torch.testing.assert_close(objective.flow_matching_loss(pred, target), per_sample.mean())
    assert objective.flow_matching_loss(target, target) == 0
    with pytest.raises(ValueError):
        objective.flow_matching_loss(pred, target[:2])


# (4) LoRA targets ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_lora_targets_match_modules(name: str) -> None:
    spec = get_family(name)
    modules = dict(tiny_model(name).named_modules())
    assert spec.lora_targets
    for target in spec.lora_targets:
        hits = [n for n in modules if n and matches_lora_target(n, target)]
        assert hits, f"{name}: LoRA target {target!r} matches no module"
        assert all(isinstance(modules[n], torch.nn.Linear) for n in hits)


# (5) No family named outside train/models/ ----------------------------------------------------------------------------


def family_mentions(root: Path, names: tuple[str, ...]) -> list[str]:
    """Every string literal or identifier equal to a family key in the Python files under `root` (a `train/` folder),
    outside `root/models/`: variable, attribute, argument, function, class and import names, keyword arguments,
    dict keys and the pieces of f-strings alike."""
    keys = set(names)
    hits = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "models":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found = []
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append(node.value)
            elif isinstance(node, ast.Name):
                found.append(node.id)
            elif isinstance(node, ast.Attribute):
                found.append(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append(node.name)
            elif isinstance(node, ast.arg):
                found.append(node.arg)
            elif isinstance(node, ast.keyword) and node.arg is not None:
                found.append(node.arg)
            elif isinstance(node, ast.alias):
                found += [node.name, *node.name.split("."), node.asname or ""]
            hits += [f"train/{rel}:{node.lineno}: {word!r}" for word in sorted(set(found) & keys)]
    return hits


def test_no_family_named_outside_models(tmp_path: Path) -> None:
    assert family_mentions(REPO / "train", NAMES) == []
    # the scan catches a planted mention of every kind, and leaves train/models/ alone
    fake = tmp_path / "train"
    (fake / "models").mkdir(parents=True)
    (fake / "models" / "flux.py").write_text('if name == "flux":\n    pass\n')
    (fake / "data").mkdir()
    (fake / "data" / "clean.py").write_text('"""Wan-style 4k+1 frames; see recipes/tiny/wan.yaml."""\nx = "wan2"\n')
    (fake / "trainer.py").write_text(
        'if family == "wan":\n    pass\n'
        "def step(ltx=None):\n    return spec.flux2\n"
        'FAMILIES = {"qwenimage": 1}\n'
        'msg = f"{chronoedit}"\n'
        "from train.models import minimax_h3\n"
    )
    hits = family_mentions(fake, NAMES)
    words = sorted(h.split(": ")[1] for h in hits)
    assert words == sorted(repr(n) for n in ("wan", "ltx", "flux2", "qwenimage", "chronoedit", "minimax_h3")), hits
    assert all(h.startswith("train/trainer.py:") for h in hits)


def test_output_tensors() -> None:
    t = torch.zeros(1)
    assert output_tensors(t) == (t,)
    assert output_tensors((t, t)) == (t, t)
