"""Validation samples (train/validation.py): the family's diffusers pipeline around the training transformer.

Three launches of the tiny Wan recipe with the tiny WanPipeline's VAE and text encoder (`model.pretrained_path`), 4
LoRA steps, samples (2 prompts, 2 denoising steps, 9 × 32 × 32) at steps 0, 2 and 4, started together:
- CP 2 on 2 processes, wandb offline (the demo's setting): decodable mp4 files under samples/step_N/, the same videos
  in the wandb offline run's files/media/, report.md;
- CP 2 with validation off: the same loss, grad norm and lr at every step as with it on;
- 1 process: its float samples (`save_tensors`) equal the CP 2 ones: exactly at step 0 (Ulysses computes each head
  over the whole sequence, as the serial forward does); at steps 2 and 4 the weights differ between the layouts by
  float rounding of the gradient reductions (tests/test_finetune.py: ≤ 1e-5 relative), so the samples are compared
  within 1e-4 absolute (pixels in [0, 1]; measured ≤ 1.2e-5), while training moves them by more than 2e-3 (measured
  ~7e-3): the sample of a step is rendered with that step's weights. The last step's sample also equals the plain
  diffusers pipeline's with the exported LoRA loaded (`load_lora_weights`) on the same random base.
In-process on a 1-rank group: an image family (FLUX.1 tiny) renders a png, an image-conditioned one (Wan 2.1 I2V) an
mp4 from its image, each equal to the pipeline's own output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["a red square moving left", "a blue circle on a gray background"]
FRAMES, SIZE, STEPS = 9, 32, 4
VALIDATION = ("validation={prompts: [" + ", ".join(f"{{prompt: {p}}}" for p in PROMPTS) + "], every_n_steps: 2, "
              f"at_start: true, num_inference_steps: 2, height: {SIZE}, width: {SIZE}, num_frames: {FRAMES}, "
              "save_tensors: true}")  # fmt: skip
SAMPLE_STEPS = (0, 2, 4)
CP_TOL = 1e-4  # float frames, CP 2 vs 1 process (weights equal to float rounding; exactly equal at step 0)
RELOAD_TOL = 1e-5  # the run's sample vs a fresh diffusers pipeline with the exported weights (FACTS: ~2e-6)


def _cmd(out: Path, nproc: int, pipeline: Path, *overrides: str) -> list[str]:
    sets = [f"output_dir={out}", f"parallel.cp={nproc}", f"train.max_steps={STEPS}", "logging.progress_bar=false",
            f"model.pretrained_path={pipeline}", *overrides]  # fmt: skip
    return [sys.executable, "-m", "train.launch", "--config_file", "configs/accelerate/cpu.yaml", "--num_processes",
            str(nproc), "train/finetune.py", "--recipe", "recipes/tiny/wan.yaml",
            *(a for s in sets for a in ("--set", s))]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from train.models import build_tiny_pipeline

    root = tmp_path_factory.mktemp("validation")
    pipeline = build_tiny_pipeline("wan", root / "pipeline")
    layouts = {"cp2": (2, VALIDATION, "logging.wandb_mode=offline"), "cp2_off": (2, "validation=null"),
               "serial": (1, VALIDATION, "logging.wandb_mode=disabled")}  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    procs = {name: subprocess.Popen(_cmd(root / name, n, pipeline, *sets), cwd=REPO, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for name, (n, *sets) in layouts.items()}  # fmt: skip
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}:\n{out[-6000:]}"
        if name != "cp2_off":
            assert f"validation: 2 sample(s) of step {STEPS} in {root / name / 'samples' / f'step_{STEPS}'}" in out
    return {"pipeline": pipeline, **{name: root / name for name in layouts}}


def _decode(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_cp_run_writes_mp4_samples_wandb_media_and_report(runs: dict[str, Path]) -> None:
    out = runs["cp2"]
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
    assert not (runs["cp2_off"] / "samples").exists()


def _metrics(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: m[k] for k in ("step", "loss", "grad_norm", "lr")} for m in lines]


def test_validation_on_and_off_log_identical_metrics(runs: dict[str, Path]) -> None:
    on, off = _metrics(runs["cp2"]), _metrics(runs["cp2_off"])
    assert [m["step"] for m in on] == list(range(1, STEPS + 1))
    assert on == off  # bit-identical: no RNG, mode or weight touched by the samples


def test_cp_sample_equals_single_process_sample(runs: dict[str, Path]) -> None:
    def sample(name: str, step: int, i: int) -> torch.Tensor:
        return torch.load(runs[name] / "samples" / f"step_{step}" / f"{i}.pt")

    for step in SAMPLE_STEPS:
        for i in range(len(PROMPTS)):
            a, b = sample("cp2", step, i), sample("serial", step, i)
            assert a.shape == (FRAMES, SIZE, SIZE, 3)
            err = (a - b).abs().max().item()
            assert err <= (1e-6 if step == 0 else CP_TOL), (step, i, err)
    moved = (sample("cp2", STEPS, 0) - sample("cp2", 0, 0)).abs().max().item()
    assert moved > 20 * CP_TOL, moved  # ~7e-3 after 4 LoRA steps at lr 1e-3


def test_last_sample_equals_diffusers_pipeline_with_exported_lora(runs: dict[str, Path]) -> None:
    """The rendering path is the family's own pipeline: a fresh WanPipeline, the recipe's random-init base, the
    exported LoRA loaded by diffusers, the same arguments and generator, gives the sample of the last step."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from train.config import load_recipe

    recipe = load_recipe(REPO / "recipes/tiny/wan.yaml")
    torch.manual_seed(recipe.train.seed)  # as the trainer's random init (train/modeling.py)
    base = WanTransformer3DModel.from_config(recipe.model.init_config)
    pipe = WanPipeline.from_pretrained(runs["pipeline"], transformer=base)
    pipe.load_lora_weights(runs["serial"] / "lora")
    pipe.set_progress_bar_config(disable=True)
    for i, prompt in enumerate(PROMPTS):
        out = pipe(prompt=prompt, num_inference_steps=2, height=SIZE, width=SIZE, num_frames=FRAMES, output_type="np",
                   generator=torch.Generator().manual_seed(i)).frames[0]  # fmt: skip
        ours = torch.load(runs["serial"] / "samples" / f"step_{STEPS}" / f"{i}.pt").numpy()
        assert np.abs(out - ours).max() <= RELOAD_TOL


IN_PROCESS = {  # family: (validation settings, the file written, the reference pipeline needs the ftfy skip)
    "flux": ("height: 32, width: 48, guidance_scale: 2.0", "0.png", False),  # an image family
    "wan_i2v": ("height: 32, width: 32, num_frames: 5, save_tensors: true", "0.mp4", True),  # conditioned on an image
}


@pytest.mark.parametrize("family", sorted(IN_PROCESS))
def test_in_process_sample_is_the_pipelines_own_output(tmp_path: Path, family: str) -> None:
    """In-process on a 1-rank gloo group, the pipeline's transformer as the "training" one (plain, in train mode):
    FLUX.1 writes a png, Wan 2.1 I2V an mp4 from a conditioning image; each equal to a fresh pipeline's own output
    of the same call (png: 8-bit levels within 1; mp4: the float output within RELOAD_TOL). The transformer is back
    in train mode after."""
    import diffusers
    import torch.distributed as dist
    from PIL import Image

    from train.config import load_recipe
    from train.metrics import MetricsLogger
    from train.models import build_tiny_pipeline, get_encoder, get_family
    from train.validation import Validation

    spec, (settings, written, no_ftfy) = get_family(family), IN_PROCESS[family]
    pipeline = build_tiny_pipeline(family, tmp_path / "pipeline")
    prompt, image = "a green triangle", None
    entry = f"{{prompt: {prompt}}}"
    if get_encoder(family).validation_image == "required":
        image = tmp_path / "first.png"
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(image)
        entry = f"{{prompt: {prompt}, image: {image}}}"
    recipe = load_recipe(REPO / f"recipes/tiny/{family}.yaml", [
        f"model.pretrained_path={pipeline}", f"output_dir={tmp_path / 'run'}", "train.max_steps=3",
        "logging.wandb_mode=disabled", f"validation={{prompts: [{entry}], every_n_steps: 3, num_inference_steps: 2, "
        f"{settings}}}"])  # fmt: skip
    model = getattr(diffusers, spec.transformer_class).from_pretrained(pipeline, subfolder="transformer").train()
    accelerator = type("Main", (), {"is_main_process": True})()
    metrics = MetricsLogger(accelerator, tmp_path, {}, recipe.logging, "test")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        validation = Validation(recipe, spec, model, torch.device("cpu"), None, metrics)
        assert [s for s in range(4) if validation.due(s)] == [3]
        (path,) = validation.at_step(3)
    finally:
        dist.destroy_process_group()
    assert path == tmp_path / "run" / "samples" / "step_3" / written and model.training
    pipe = getattr(diffusers, spec.pipeline_class).from_pretrained(pipeline)  # fresh, with its own transformer
    if no_ftfy:  # diffusers 0.42.1's Wan I2V prompt_clean needs ftfy (not installed): train/models/wan_i2v/encoder.py
        from train.models.wan_i2v.encoder import skip_missing_ftfy

        skip_missing_ftfy(pipe)
    pipe.set_progress_bar_config(disable=True)
    v = recipe.validation
    kwargs = {k: getattr(v, k) for k in ("height", "width", "num_frames", "guidance_scale") if getattr(v, k)}
    if image is not None:
        kwargs["image"] = Image.open(image).convert("RGB")
    ref = pipe(prompt=prompt, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0),
               **kwargs)[0][0]  # fmt: skip
    if path.suffix == ".png":
        png = np.asarray(Image.open(path))
        assert png.shape == (32, 48, 3)
        assert np.abs(png.astype(int) - (np.clip(ref, 0, 1) * 255).round().astype(int)).max() <= 1
    else:
        assert _decode(path).shape == (5, 32, 32, 3)
        assert np.abs(torch.load(path.with_suffix(".pt")).numpy() - ref).max() <= RELOAD_TOL


def test_recipe_mistakes_are_one_line_errors(tmp_path: Path) -> None:
    from train.config import load_recipe
    from train.errors import UserError
    from train.models import get_family
    from train.validation import check_validation

    base = "validation={prompts: [{prompt: a red square}]}"
    with pytest.raises(UserError, match="model.pretrained_path is null"):
        check_validation(load_recipe(REPO / "recipes/tiny/wan.yaml", [base]), get_family("wan"))
    i2v = load_recipe(REPO / "recipes/tiny/wan_i2v.yaml", [f"model.pretrained_path={tmp_path}", base])
    with pytest.raises(UserError, match=r"prompts\[0\].image: wan_i2v samples are conditioned on an image"):
        check_validation(i2v, get_family("wan_i2v"))
    with_image = "validation={prompts: [{prompt: a, image: " + str(tmp_path / "missing.png") + "}]}"
    t2v = load_recipe(REPO / "recipes/tiny/wan.yaml", [f"model.pretrained_path={tmp_path}", with_image])
    with pytest.raises(UserError, match="takes no conditioning image"):
        check_validation(t2v, get_family("wan"))
    i2v = load_recipe(REPO / "recipes/tiny/wan_i2v.yaml", [f"model.pretrained_path={tmp_path}", with_image])
    with pytest.raises(UserError, match="no file"):
        check_validation(i2v, get_family("wan_i2v"))
