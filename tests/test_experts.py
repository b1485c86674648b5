"""`model.both_experts`: Wan 2.2 A14B's high- and low-noise experts trained in one run (train/experts.py).

One CP 2 launch (2 processes, FSDP2 sharded start of both experts from the tiny two-expert WanPipeline folder),
2 steps, a checkpoint with its export after each step, validation samples with both experts at the end. Proven:
- step 1 trains `transformer` on sigmas >= boundary, step 2 `transformer_2` below it: each step's loss and gradient
  norm equal the serial reference of that expert alone on that step's batch, noise and sigmas (tests/harness.py
  `first_step`, a one-expert recipe), and the high expert's step-1 weights equal a one-expert serial launch's;
- the expert a step does not train is untouched (its adapter still B = 0 after step 1; the high one's the same at
  step 2 as at step 1);
- resume from step 1 continues exactly (both experts and their optimizer state in the checkpoint);
- the exports load as WanPipeline loads them (`lora/`; `lora_2/` with `load_into_transformer_2=True`), and the run's
  last validation sample equals a fresh WanPipeline with both exported LoRAs;
- the estimate counts both experts' shards and optimizer state, one expert's gradients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import REL_TOL, REPO, check_lora_reload, first_step, load_lora, load_pipeline, train

pytestmark = pytest.mark.slow

TINY = "recipes/tiny/wan22.yaml"
SAMPLE = ("validation={prompts: [{prompt: a red square}], every_n_steps: 100, num_inference_steps: 2, height: 32, "
          "width: 32, num_frames: 9, save_tensors: true}")  # fmt: skip


def _both(pipeline: Path) -> tuple[str, ...]:
    return (f"model.pretrained_path={pipeline}", "model.init_config=null", "model.both_experts=true",
            "train.max_steps=2", "parallel.cp=2", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3",
            "checkpoint.export_every_checkpoint=true")  # fmt: skip


@pytest.fixture(scope="module")
def both(tiny_pipeline, tmp_path_factory) -> dict:
    pipeline = tiny_pipeline("wan22")
    out = tmp_path_factory.mktemp("both") / "run"
    run = train(out, TINY, *_both(pipeline), SAMPLE, nproc=2)
    return {"pipeline": pipeline, "out": out, "metrics": run.metrics}


def _one(pipeline: Path, expert: str) -> tuple[str, ...]:
    return (f"model.pretrained_path={pipeline}", "model.init_config=null", f"model.subfolder={expert}")


def test_each_step_equals_its_expert_alone(both: dict) -> None:
    pipeline, steps = both["pipeline"], both["metrics"]
    for step, expert in ((0, "transformer"), (1, "transformer_2")):
        ref = first_step(TINY, *_one(pipeline, expert), step=step)
        for key in ("loss", "grad_norm"):
            got = steps[step][key]
            assert abs(got - ref[key]) <= REL_TOL * abs(ref[key]), (expert, key, got, ref[key])


def test_the_idle_expert_is_untouched_and_the_high_expert_equals_its_own_run(both: dict, tmp_path: Path) -> None:
    ckpts = both["out"] / "checkpoints"
    step1, step2 = (ckpts / f"step_{s:06d}" for s in (1, 2))
    low1 = load_file(step1 / "lora_2" / "pytorch_lora_weights.safetensors")
    assert all(not v.any() for k, v in low1.items() if ".lora_B." in k)  # transformer_2 not trained at step 1
    high1, high2 = (load_file(s / "lora" / "pytorch_lora_weights.safetensors") for s in (step1, step2))
    assert any(v.any() for k, v in high1.items() if ".lora_B." in k)
    assert all(torch.equal(high1[k], high2[k]) for k in high1)  # transformer not trained at step 2
    low2 = load_file(step2 / "lora_2" / "pytorch_lora_weights.safetensors")
    assert any(v.any() for k, v in low2.items() if ".lora_B." in k)
    alone = train(tmp_path / "alone", TINY, *_one(both["pipeline"], "transformer"), "train.max_steps=1",
                  "parallel.cp=1")  # fmt: skip
    own = load_file(alone.out / "lora" / "pytorch_lora_weights.safetensors")
    # AdamW's first update is ~lr * g / |g|: where a gradient is ~eps (to_k under softmax, FACTS) CP's reordered sums
    # move it by up to ~1e-5 of lr; elsewhere the two agree to float rounding
    for k, v in own.items():
        assert (high1[k] - v).abs().max() <= 1e-4 * v.abs().max(), k


def test_resume_continues_exactly(both: dict, tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "run"
    shutil.copytree(both["out"], out)
    shutil.rmtree(out / "checkpoints" / "step_000002")
    for name in ("lora", "lora_2", "metrics.jsonl"):
        (out / name).unlink() if (out / name).is_file() else shutil.rmtree(out / name)
    (out / "metrics.jsonl").write_text("")  # the interrupted run's log is not compared
    run = train(out, TINY, *_both(both["pipeline"]), resume=True, nproc=2)
    resumed = [m for m in run.metrics if m["step"] == 2][0]
    for key in ("loss", "grad_norm"):
        assert resumed[key] == both["metrics"][1][key], key
    for name in ("lora", "lora_2"):
        a = load_file(out / name / "pytorch_lora_weights.safetensors")
        b = load_file(both["out"] / name / "pytorch_lora_weights.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_exports_load_into_both_experts_and_the_sample_is_the_pipelines(both: dict) -> None:
    from train.config import load_recipe
    from train.validation import sample_paths

    out, pipeline = both["out"], both["pipeline"]
    check_lora_reload("wan22", pipeline, out / "lora")
    check_lora_reload("wan22", pipeline, out / "lora_2", load_into_transformer_2=True)
    pipe = load_pipeline("wan22", pipeline)
    load_lora(pipe, out / "lora")
    load_lora(pipe, out / "lora_2", load_into_transformer_2=True)
    v = load_recipe(REPO / TINY, [*_both(pipeline), SAMPLE]).validation
    ref = pipe(prompt=v.prompts[0].prompt, num_inference_steps=2, height=32, width=32, num_frames=9, output_type="np",
               generator=torch.Generator("cpu").manual_seed(v.seed)).frames[0]  # fmt: skip
    path = sample_paths(out, 2, 1, "video")[0]
    sample = torch.load(path.with_suffix(".pt")).numpy()
    assert abs(sample - ref).max() <= 1e-5, abs(sample - ref).max()


def test_estimate_counts_both_experts() -> None:
    from train.config import load_recipe
    from train.estimate import estimate

    one = load_recipe(REPO / "recipes/wan22/a14b_low_noise_lora.yaml")
    both = load_recipe(REPO / "recipes/wan22/a14b_both_lora.yaml")
    a, b = estimate(one, 16), estimate(both, 16)
    for key in ("parameters", "optimizer state (AdamW)"):
        assert b.components[key] == 2 * a.components[key], key
    assert b.components["gradients"] == a.components["gradients"]
    assert b.components["activations (blocks)"] == a.components["activations (blocks)"]
