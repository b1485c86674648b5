"""Validation samples (train/validation.py): the family's diffusers pipeline around the training transformer.

Launches through the session's `runs`, sharing tests/test_finetune.py's 4-step tiny-wan LoRA runs. One CP 2 launch
on 2 processes with wandb offline (the demo's setting), the tiny WanPipeline's VAE and text encoder
(`model.pretrained_path`, the session's `tiny_pipeline`), samples (2 prompts, 2 denoising steps, 9 × 32 × 32) at
steps 0, 2 and 4:
- decodable mp4 files under samples/step_N/, the same videos in the wandb offline run's files/media/, report.md;
- the same CP 2 run without validation (tests/test_finetune.py's): the same loss, grad norm and lr at every step;
- its float samples (`save_tensors`) equal the single-process ones, the plain diffusers pipeline (a fresh WanPipeline
  on the recipe's random base, the validation's arguments and generators) with the serial run's weights: at step 0
  the base (within 1e-5: another pipeline instance, FACTS ~2e-6), at step 4 the serial run's exported LoRA (within
  1e-4 absolute, pixels in [0, 1]: the weights differ between the layouts by float rounding of the gradient
  reductions, tests/test_finetune.py ≤ 1e-5 relative), while training moves them by more than 2e-3 (measured ~7e-3);
  and the last sample equals that pipeline with the run's own exported LoRA (within 1e-5): the sample of a step is
  rendered with that step's weights.
An image family under CP: FLUX.1 tiny trained from its tiny pipeline's transformer at CP 2 (wandb offline) writes its
step-0 sample as png (and logs it), equal to the single-process sample of the same weights (to 1e-6, the png to the
8-bit level) and to the plain pipeline's own output.
In-process on a 1-rank group (the single-process samples): an image family (FLUX.1 tiny) renders a png, an
image-conditioned one (Wan 2.1 I2V) an mp4 from its image, each equal to the pipeline's own output.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import REPO

TINY = "recipes/tiny/wan.yaml"
PROMPTS = ["a red square moving left", "a blue circle on a gray background"]
FRAMES, SIZE, STEPS = 9, 32, 4
VALIDATION = ("validation={prompts: [" + ", ".join(f"{{prompt: {p}}}" for p in PROMPTS) + "], every_n_steps: 2, "
              f"at_start: true, num_inference_steps: 2, height: {SIZE}, width: {SIZE}, num_frames: {FRAMES}, "
              "save_tensors: true}")  # fmt: skip
SAMPLE_STEPS = (0, 2, 4)
STEP0_TOL = 1e-6  # float frames at step 0, CP 2 vs the single-process validation (the same weights; FLUX.1)
CP_TOL = 1e-4  # float frames, CP 2 vs the serial run's weights (equal to float rounding of the reductions)
RELOAD_TOL = 1e-5  # the run's sample vs a fresh diffusers pipeline with the exported weights (FACTS: ~2e-6)
# tests/test_finetune.py's runs (identical overrides: one run each per session): a checkpoint after every step
CKPT = ("checkpoint.every_n_steps=1", "checkpoint.keep_last=3")
SERIAL = ("parallel.cp=1", *CKPT)
CP2 = ("parallel.cp=2", "logging.wandb_mode=offline", *CKPT)


@pytest.fixture
def wan(runs, tiny_pipeline) -> dict:
    """The Wan runs: CP 2 with validation (one run), and tests/test_finetune.py's CP 2 (without validation) and
    serial runs."""
    pipeline = tiny_pipeline("wan")
    done = {"pipeline": pipeline, "cp2": runs(TINY, *CP2, f"model.pretrained_path={pipeline}", VALIDATION, nproc=2),
            "cp2_off": runs(TINY, *CP2, nproc=2), "serial": runs(TINY, *SERIAL)}  # fmt: skip
    out = done["cp2"].out
    assert f"validation: 2 sample(s) of step {STEPS} in {out / 'samples' / f'step_{STEPS}'}" in done["cp2"].stdout
    return {k: v if k == "pipeline" else v.out for k, v in done.items()}


def _decode(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_cp_run_writes_mp4_samples_wandb_media_and_report(wan: dict[str, Path]) -> None:
    out = wan["cp2"]
    for step in SAMPLE_STEPS:
        for i in range(len(PROMPTS)):
            frames = _decode(out / "samples" / f"step_{step}" / f"{i}.mp4")
            assert frames.shape == (FRAMES, SIZE, SIZE, 3)
            floats = torch.load(out / "samples" / f"step_{step}" / f"{i}.pt").numpy()
            # libx264 yuv420p: chroma subsampled, lossy (FACTS: ~1.7/255 mean on natural frames)
            assert np.abs(frames / 255.0 - floats).mean() < 0.03
    assert not (out / "samples" / "step_1").exists() and not (out / "samples" / "step_3").exists()
    (run,) = (out / "wandb").glob("offline-run-*")
    logged = sorted((run / "files" / "media" / "videos" / "validation").glob("*.mp4"))
    assert len(logged) == len(PROMPTS) * len(SAMPLE_STEPS)
    for path in logged:
        assert _decode(path).shape == (FRAMES, SIZE, SIZE, 3)
    assert (out / "report.md").is_file()
    assert not (wan["cp2_off"] / "samples").exists()


def _metrics(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: m[k] for k in ("step", "loss", "grad_norm", "lr")} for m in lines]


def test_validation_on_and_off_log_identical_metrics(wan: dict[str, Path]) -> None:
    on, off = _metrics(wan["cp2"]), _metrics(wan["cp2_off"])
    assert [m["step"] for m in on] == list(range(1, STEPS + 1))
    assert on == off  # bit-identical: no RNG, mode or weight touched by the samples


def _pipeline_samples(pipeline: Path, lora: Path | None) -> list[np.ndarray]:
    """The family's own pipeline outside the trainer: a fresh WanPipeline on the recipe's random-init base (drawn as
    the trainer draws it, train/modeling.py), `lora` loaded by diffusers (None: the step-0 weights), called with the
    arguments and generators the validation uses: one float video per prompt."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from train.config import load_recipe

    recipe = load_recipe(REPO / TINY)
    torch.manual_seed(recipe.train.seed)
    base = WanTransformer3DModel.from_config(recipe.model.init_config)
    pipe = WanPipeline.from_pretrained(pipeline, transformer=base)
    if lora is not None:
        pipe.load_lora_weights(lora)
    pipe.set_progress_bar_config(disable=True)
    return [pipe(prompt=prompt, num_inference_steps=2, height=SIZE, width=SIZE, num_frames=FRAMES, output_type="np",
                 generator=torch.Generator().manual_seed(i)).frames[0] for i, prompt in enumerate(PROMPTS)]  # fmt: skip


def _sample(out: Path, step: int, i: int) -> np.ndarray:
    return torch.load(out / "samples" / f"step_{step}" / f"{i}.pt").numpy()


def test_cp_samples_equal_the_single_process_ones(wan: dict[str, Path]) -> None:
    """The CP 2 run's samples against the single-process reference, the plain pipeline with the serial run's weights:
    at step 0 the random base (within RELOAD_TOL: the same weights, another pipeline instance), at the last step the
    serial run's exported LoRA (within CP_TOL: the weights differ by float rounding between the layouts); training
    moved the sample by far more."""
    errors = {}
    for step, lora in ((0, None), (STEPS, wan["serial"] / "lora")):
        tol = RELOAD_TOL if step == 0 else CP_TOL
        for i, ref in enumerate(_pipeline_samples(wan["pipeline"], lora)):
            ours = _sample(wan["cp2"], step, i)
            assert ours.shape == (FRAMES, SIZE, SIZE, 3)
            errors[step, i] = float(np.abs(ours - ref).max())
            assert errors[step, i] <= tol, (step, i, errors[step, i])
    print(f"CP 2 samples vs the single-process pipeline: max abs difference per (step, prompt) {errors}")
    moved = np.abs(_sample(wan["cp2"], STEPS, 0) - _sample(wan["cp2"], 0, 0)).max()
    assert moved > 20 * CP_TOL, moved  # ~7e-3 after 4 LoRA steps at lr 1e-3


def test_last_sample_equals_diffusers_pipeline_with_exported_lora(wan: dict[str, Path]) -> None:
    """The rendering path is the family's own pipeline, with the weights of the step: a fresh WanPipeline, the
    recipe's random-init base, the CP 2 run's exported LoRA loaded by diffusers, the same arguments and generator,
    gives that run's sample of the last step."""
    for i, ref in enumerate(_pipeline_samples(wan["pipeline"], wan["cp2"] / "lora")):
        assert np.abs(ref - _sample(wan["cp2"], STEPS, i)).max() <= RELOAD_TOL


IN_PROCESS = {  # family: (validation settings, the file written, the reference pipeline needs the ftfy skip)
    "flux": ("height: 32, width: 48, guidance_scale: 2.0, save_tensors: true", "0.png", False),  # an image family
    # its joint text | image mask, and CFG with the empty negative prompt
    "chroma": ("height: 32, width: 48, guidance_scale: 2.0, save_tensors: true", "0.png", False),
    # per-sample list inputs, the negated output, and CFG with the empty negative prompt
    "zimage": ("height: 32, width: 48, guidance_scale: 2.0, save_tensors: true", "0.png", False),
    "wan_i2v": ("height: 32, width: 32, num_frames: 5, save_tensors: true", "0.mp4", True),  # conditioned on an image
    # channels-last latents, its processor as tokenizer (the encoder's pipeline_components), CFG with its default
    # negative prompt
    "kandinsky5": ("height: 32, width: 32, num_frames: 5, save_tensors: true", "0.mp4", False),
    # conditioned on an image kept as latent frame 0; 17 frames: its normalize_first_frame needs 5 latent frames
    "kandinsky5_i2v": ("height: 32, width: 32, num_frames: 17, save_tensors: true", "0.mp4", False),
    # its control stream (no control video in a sample: the pipeline's zero video and full mask)
    "wan_vace": ("height: 32, width: 32, num_frames: 5, save_tensors: true", "0.mp4", False),
    # text2world: the pipeline's own conditioning frames and per-frame timestep
    "cosmos": ("height: 32, width: 32, num_frames: 5, guidance_scale: 2.0, save_tensors: true", "0.mp4", False),
    # two text encoders (Qwen and ByT5) packed by forward(); its x32 VAE: 64 x 96
    "hunyuanimage": ("height: 64, width: 96, save_tensors: true", "0.png", False),
    # the joint [text | image] output's last H*W tokens, Qwen3-VL text through its processor (the encoder's
    # pipeline_components), an RGBA image (its VAE decodes 4 channels); sides multiples of 32
    "qwenimage21": ("height: 32, width: 64, save_tensors: true", "0.png", False),
    # a reference image and each prompt's pose and face videos (media), in the pipeline's 77-frame segment
    "wan_animate": ("height: 32, width: 32, save_tensors: true", "0.mp4", True),
}
# the png's (height, width, channels) where it is not (32, 48, 3)
PNG_SHAPES = {"hunyuanimage": (64, 96, 3), "qwenimage21": (32, 64, 4)}
# the mp4's frames where it is not 5
VIDEO_FRAMES = {"kandinsky5_i2v": 17}
PROMPT = "a green triangle"


@pytest.fixture(scope="module")
def in_process(tmp_path_factory, tiny_pipeline):
    """`in_process(family)` → (the sample written, the fresh pipeline's own output of the same call): rendered once
    per family in this process on a 1-rank gloo group, the pipeline's transformer as the "training" one (plain, in
    train mode), which is back in train mode after."""

    @functools.cache
    def render(family: str) -> tuple[Path, np.ndarray]:
        import diffusers
        import torch.distributed as dist
        from PIL import Image

        from train.config import load_recipe
        from train.data.synthetic_media import write_video
        from train.metrics import MetricsLogger
        from train.models import get_encoder, get_family
        from train.validation import Validation

        tmp = tmp_path_factory.mktemp(f"in_process_{family}")
        spec, (settings, written, no_ftfy) = get_family(family), IN_PROCESS[family]
        pipeline = tiny_pipeline(family)
        image, entry = None, f"{{prompt: {PROMPT}}}"
        if get_encoder(family).validation_image == "required":
            image = tmp / "first.png"
            Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(image)
            entry = f"{{prompt: {PROMPT}, image: {image}}}"
        media: dict[str, np.ndarray] = {}  # the family's conditioning videos (Wan Animate's pose and face), lossless
        for i, name in enumerate(get_encoder(family).condition_media):
            side = 32 if i == 0 else 16
            media[name] = np.random.default_rng(i + 1).integers(0, 256, (5, side, side, 3), dtype=np.uint8)
            write_video(tmp / f"{name}.mp4", media[name])
        if media:
            paths = ", ".join(f"{name}: {tmp / name}.mp4" for name in media)
            entry = entry[:-1] + f", media: {{{paths}}}}}"
        recipe = load_recipe(REPO / f"recipes/tiny/{family}.yaml", [
            f"model.pretrained_path={pipeline}", f"output_dir={tmp / 'run'}", "train.max_steps=3",
            "logging.wandb_mode=disabled", f"validation={{prompts: [{entry}], every_n_steps: 3, "
            f"num_inference_steps: 2, {settings}}}"])  # fmt: skip
        model = getattr(diffusers, spec.transformer_class).from_pretrained(pipeline, subfolder="transformer").train()
        accelerator = type("Main", (), {"is_main_process": True})()
        metrics = MetricsLogger(accelerator, tmp, {}, recipe.logging, "test")
        dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
        try:
            validation = Validation(recipe, spec, model, torch.device("cpu"), None, metrics)
            assert [s for s in range(4) if validation.due(s)] == [3]
            (path,) = validation.at_step(3)
        finally:
            dist.destroy_process_group()
        assert path == tmp / "run" / "samples" / "step_3" / written and model.training
        components = get_encoder(family).pipeline_components(str(pipeline), None)  # as a user loads it (harness)
        pipe = getattr(diffusers, spec.pipeline_class).from_pretrained(pipeline, **components)  # its own transformer
        if no_ftfy:  # diffusers 0.42.1's Wan I2V prompt_clean needs ftfy (not installed): wan_i2v/encoder.py
            from train.models.wan_i2v.encoder import skip_missing_ftfy

            skip_missing_ftfy(pipe)
        pipe.set_progress_bar_config(disable=True)
        v = recipe.validation
        kwargs = {k: getattr(v, k) for k in ("height", "width", "num_frames", "guidance_scale") if getattr(v, k)}
        if image is not None:
            kwargs["image"] = Image.open(image).convert("RGB")
        kwargs |= {name: [Image.fromarray(frame) for frame in video] for name, video in media.items()}
        ref = pipe(prompt=PROMPT, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0),
                   **kwargs)[0][0]  # fmt: skip
        return path, ref

    return render


def _levels(png: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(png)).astype(int)


@pytest.mark.parametrize("family", sorted(IN_PROCESS))
def test_in_process_sample_is_the_pipelines_own_output(in_process, family: str) -> None:
    """In-process on a 1-rank gloo group: FLUX.1 and Chroma write a png, Wan 2.1 I2V an mp4 from a conditioning
    image; each equal to a fresh pipeline's own output of the same call (png: 8-bit levels within 1; the float output
    within RELOAD_TOL)."""
    path, ref = in_process(family)
    if path.suffix == ".png":
        png = _levels(path)
        assert png.shape == PNG_SHAPES.get(family, (32, 48, 3))
        assert np.abs(png - (np.clip(ref, 0, 1) * 255).round().astype(int)).max() <= 1
    else:
        assert _decode(path).shape == (VIDEO_FRAMES.get(family, 5), 32, 32, 3)
    assert np.abs(torch.load(path.with_suffix(".pt")).numpy() - ref).max() <= RELOAD_TOL


def test_image_family_cp_sample_equals_single_process_sample(runs, tiny_pipeline, in_process) -> None:
    """FLUX.1 tiny under CP 2 (its pipeline's transformer, LoRA, 1 step, wandb offline): the step-0 sample is a png
    logged to wandb, equal to the single-process sample of the same weights (the in-process render: floats within
    STEP0_TOL, the png's 8-bit levels within 1) and to the fresh pipeline's own output within RELOAD_TOL."""
    settings = IN_PROCESS["flux"][0]
    run = runs("recipes/tiny/flux.yaml", "parallel.cp=2", "logging.wandb_mode=offline", "model.init_config=null",
               f"model.pretrained_path={tiny_pipeline('flux')}", "train.max_steps=1",
               f"validation={{prompts: [{{prompt: {PROMPT}}}], at_start: true, num_inference_steps: 2, {settings}}}",
               nproc=2)  # fmt: skip
    assert "SUM over cp=2" in json.loads((run.out / "layout.json").read_text())["gradient_reduction"]
    serial, ref = in_process("flux")
    png = run.out / "samples" / "step_0" / "0.png"
    assert _levels(png).shape == (32, 48, 3)
    assert np.abs(_levels(png) - _levels(serial)).max() <= 1
    ours = torch.load(png.with_suffix(".pt"))
    err = (ours - torch.load(serial.with_suffix(".pt"))).abs().max().item()
    print(f"flux step-0 sample, CP 2 vs 1 process: max abs difference {err:.2e}")
    assert err <= STEP0_TOL, err
    assert np.abs(ours.numpy() - ref).max() <= RELOAD_TOL
    (wandb_run,) = (run.out / "wandb").glob("offline-run-*")
    logged = sorted((wandb_run / "files" / "media" / "images" / "validation").glob("*.png"))
    assert len(logged) == 2, logged  # step 0 and the last step, 1
    assert {_levels(p).shape for p in logged} == {(32, 48, 3)}


def test_recipe_mistakes_are_one_line_errors(tmp_path: Path) -> None:
    from train.config import load_recipe
    from train.errors import UserError
    from train.models import get_family
    from train.validation import check_validation

    base = "validation={prompts: [{prompt: a red square}]}"
    with pytest.raises(UserError, match="model.pretrained_path is null"):
        check_validation(load_recipe(REPO / TINY, [base]), get_family("wan"))
    i2v = load_recipe(REPO / "recipes/tiny/wan_i2v.yaml", [f"model.pretrained_path={tmp_path}", base])
    with pytest.raises(UserError, match=r"prompts\[0\].image: wan_i2v samples are conditioned on an image"):
        check_validation(i2v, get_family("wan_i2v"))
    with_image = "validation={prompts: [{prompt: a, image: " + str(tmp_path / "missing.png") + "}]}"
    t2v = load_recipe(REPO / TINY, [f"model.pretrained_path={tmp_path}", with_image])
    with pytest.raises(UserError, match="takes no conditioning image"):
        check_validation(t2v, get_family("wan"))
    i2v = load_recipe(REPO / "recipes/tiny/wan_i2v.yaml", [f"model.pretrained_path={tmp_path}", with_image])
    with pytest.raises(UserError, match="no file"):
        check_validation(i2v, get_family("wan_i2v"))
    (tmp_path / "missing.png").write_text("not a png\n")  # a text file named .png: refused before any sample
    with pytest.raises(UserError, match=r"prompts\[0\].image: .*missing.png is not an image PIL can read"):
        check_validation(i2v, get_family("wan_i2v"))
    from PIL import Image

    png = tmp_path / "cut.png"  # a real PNG cut in half: its header reads, its data does not
    Image.new("RGB", (64, 64), (200, 10, 10)).save(png)
    png.write_bytes(png.read_bytes()[: png.stat().st_size // 2])
    image = "validation={prompts: [{prompt: a, image: " + str(png) + "}]}"
    cut = load_recipe(REPO / "recipes/tiny/wan_i2v.yaml", [f"model.pretrained_path={tmp_path}", image])
    with pytest.raises(UserError, match="cut.png is not an image PIL can read"):
        check_validation(cut, get_family("wan_i2v"))
    # Kandinsky 5 I2V's decode renders NaN below 17 frames (5 latent frames after the first 4)
    short = "validation={prompts: [{prompt: a, image: " + str(tmp_path / "ref.png") + "}], num_frames: 5}"
    Image.new("RGB", (32, 32)).save(tmp_path / "ref.png")
    k5 = load_recipe(REPO / "recipes/tiny/kandinsky5_i2v.yaml", [f"model.pretrained_path={tmp_path}", short])
    with pytest.raises(UserError, match="validation.num_frames 5: Kandinsky5I2VPipeline renders NaN frames below 17"):
        check_validation(k5, get_family("kandinsky5_i2v"))
    # Wan Animate's pose and face videos (media): all of them, only the family's, each a readable video
    Image.new("RGB", (32, 32)).save(tmp_path / "ref.png")
    text = tmp_path / "pose.mp4"
    text.write_text("not a video\n")

    def animate(media: str) -> str:
        prompt = f"validation={{prompts: [{{prompt: a, image: {tmp_path / 'ref.png'}, media: {{{media}}}}}]}}"
        recipe = load_recipe(REPO / "recipes/tiny/wan_animate.yaml", [f"model.pretrained_path={tmp_path}", prompt])
        with pytest.raises(UserError) as err:
            check_validation(recipe, get_family("wan_animate"))
        assert "\n" not in str(err.value)
        return str(err.value)

    assert re.match(r"validation.prompts\[0\].media: wan_animate samples are conditioned on .*face_video: <video",
                    animate(f"pose_video: {text}"))  # fmt: skip
    assert "takes no ['mask']" in animate(f"pose_video: {text}, face_video: {text}, mask: {text}")
    assert re.search(r"media.pose_video: .*pose.mp4 is not a video PyAV can read",
                     animate(f"pose_video: {text}, face_video: {text}"))  # fmt: skip


def test_guidance_scale_the_pipeline_does_not_take_is_refused(tmp_path: Path) -> None:
    """HunyuanImagePipeline takes no `guidance_scale` (its own guidance argument differs): one line before anything is
    built, not a TypeError at the first sample."""
    from train.config import load_recipe
    from train.errors import UserError
    from train.models import get_family
    from train.validation import check_validation

    sets = [f"model.pretrained_path={tmp_path}", "validation={prompts: [{prompt: a}], guidance_scale: 3.5}"]
    recipe = load_recipe(REPO / "recipes/tiny/hunyuanimage.yaml", sets)
    with pytest.raises(UserError, match="validation.guidance_scale: HunyuanImagePipeline takes no guidance_scale"):
        check_validation(recipe, get_family("hunyuanimage"))
    check_validation(load_recipe(REPO / TINY, sets), get_family("wan"))  # Wan's pipeline takes it
