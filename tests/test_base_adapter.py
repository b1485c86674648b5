"""`finetune.base_adapter`: a LoRA trained on a distilled base with a frozen training adapter (train/base_adapter.py).

One CP 2 launch (2 processes, FSDP2 sharded start from the tiny WanPipeline folder, the "distilled base"), 2 steps,
with someone else's adapter as the training adapter (a musubi-tuner Wan LoRA, tests/harness.py `musubi_wan_lora`) and
a validation sample at the end. Proven:
- training sees base + training adapter: step 1's loss equals the serial reference whose model is the pipeline's
  transformer with that file loaded by diffusers' `load_lora_weights` (the trained adapter starts at B = 0), and
  differs from a run without it;
- the export holds only the trained adapter: the same keys as a run without base adapter, none of the training
  adapter's;
- the validation sample equals the pipeline on the distilled base with the exported LoRA alone (a fresh
  WanPipeline, `load_lora_weights` of the export), and differs from that pipeline with the training adapter loaded
  too.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import REL_TOL, first_step, load_lora, load_pipeline, musubi_wan_lora, train

pytestmark = pytest.mark.slow

TINY = "recipes/tiny/wan.yaml"
SAMPLE = ("validation={prompts: [{prompt: a red square}], every_n_steps: 100, num_inference_steps: 2, height: 32, "
          "width: 32, num_frames: 9, save_tensors: true}")  # fmt: skip


@pytest.fixture(scope="module")
def run(tiny_pipeline, tmp_path_factory) -> dict:
    pipeline = tiny_pipeline("wan")
    tmp = tmp_path_factory.mktemp("base_adapter")
    base = musubi_wan_lora(tmp / "training_adapter.safetensors", load_pipeline("wan", pipeline).transformer, 4, 4.0)
    common = (f"model.pretrained_path={pipeline}", "model.init_config=null", "train.max_steps=2")
    out = train(tmp / "run", TINY, *common, f"finetune.base_adapter={base}", "parallel.cp=2", SAMPLE, nproc=2)
    return {"pipeline": pipeline, "base": base, "common": common, "run": out}


def _sample(pipe) -> torch.Tensor:
    out = pipe(prompt="a red square", num_inference_steps=2, height=32, width=32, num_frames=9, output_type="np",
               generator=torch.Generator("cpu").manual_seed(0)).frames[0]  # fmt: skip
    return torch.as_tensor(out)


def test_training_sees_the_training_adapter(run: dict) -> None:
    pipe = load_pipeline("wan", run["pipeline"])
    pipe.load_lora_weights(run["base"])  # diffusers' own reading of the training adapter
    transformer = pipe.transformer.train()
    for name, p in transformer.named_parameters():
        p.requires_grad_(".lora_" in name)
    serial = first_step(TINY, *run["common"], model=transformer)
    step = run["run"].metrics[0]
    assert abs(step["loss"] - serial["loss"]) <= REL_TOL * abs(serial["loss"]), (step["loss"], serial["loss"])
    without = first_step(TINY, *run["common"])
    assert abs(without["loss"] - serial["loss"]) > 1e-3 * abs(serial["loss"])


def test_export_is_the_trained_adapter_and_validation_is_the_distilled_base_with_it(run: dict) -> None:
    from train.validation import sample_paths

    out = run["run"].out
    exported = load_file(out / "lora" / "pytorch_lora_weights.safetensors")
    base_keys = len(load_file(run["base"]))
    wan_targets = 2 * 4  # 2 blocks x attn1/attn2 q, k, v, o ... as the recipe's default targets give
    assert len(exported) == 2 * wan_targets * 2 and len(exported) != base_keys  # A and B of each target
    assert not any("base_adapter" in k for k in exported)
    sample = torch.load(sample_paths(out, 2, 1, "video")[0].with_suffix(".pt"))
    pipe = load_pipeline("wan", run["pipeline"])
    load_lora(pipe, out / "lora")
    assert (sample - _sample(pipe)).abs().max() <= 1e-5
    pipe.load_lora_weights(run["base"], adapter_name="training_adapter")
    pipe.set_adapters(["default_0", "training_adapter"])
    assert (sample - _sample(pipe)).abs().max() > 1e-4  # the sample was rendered without the training adapter
