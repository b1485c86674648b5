"""HunyuanVideo (no diffusers CP plan: cp_plans/hunyuan_video.yaml): the cache is what HunyuanVideoPipeline computes
(its own `encode_prompt` with the template crop counted for the tokenizer, the VAE's scaling), the CP forward kwargs
(text cut, all-ones mask) give the padded-mask forward for one prompt, the tiny recipe under CP 3 matches 1 process
through the real entry point, and its LoRA export loads in HunyuanVideoPipeline. Model-level parity at CP 2, 3, 4 is
in tests/test_cp_models.py; the forward kwargs vs one pipeline step in tests/test_families.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_models import build_model, family_case
from train.models import build_tiny_pipeline, get_encoder, tiny_config
from train.models.hunyuan_video.encoder import prompt_template

REPO = Path(__file__).resolve().parents[1]
NAME = "hunyuan_video"
CAPTIONS = ("a red square", "a blue circle moving up on a white background")


@pytest.fixture(scope="module")
def pipeline_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_pipeline(NAME, tmp_path_factory.mktemp("hunyuan") / "pipe")


@torch.no_grad()
def test_cache_is_the_pipelines(pipeline_path: Path) -> None:
    from diffusers import HunyuanVideoPipeline

    pipe = HunyuanVideoPipeline.from_pretrained(pipeline_path)
    encoder = get_encoder(NAME)
    encoder.load(str(pipeline_path))
    template = prompt_template(pipe.tokenizer)
    for caption in CAPTIONS:
        ours = encoder.encode_text(caption, 64)
        embeds, pooled, mask = pipe.encode_prompt(prompt=caption, prompt_template=template, max_sequence_length=64)
        torch.testing.assert_close(ours["prompt_embeds"], embeds[0], rtol=0, atol=0)
        torch.testing.assert_close(ours["pooled_embeds"], pooled[0], rtol=0, atol=0)
        assert torch.equal(ours["prompt_mask"], mask[0].bool())
        # The crop lands on the prompt: what is kept starts with the caption's own tokens, then <|eot_id|>, padding.
        ids = pipe.tokenizer(template["template"].format(caption))["input_ids"][template["crop_start"] :]
        own = pipe.tokenizer(caption, add_special_tokens=False)["input_ids"]
        assert ids == [*own, pipe.tokenizer.convert_tokens_to_ids("<|eot_id|>")]
        assert int(ours["prompt_mask"].sum()) == len(ids) < 64

    # Latents: the VAE posterior's mean times scaling_factor, what the pipeline's decode divides back out.
    clip = torch.rand(3, 9, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = encoder.encode_media(clip, None, "mode", 24.0)["latents"]
    expected = pipe.vae.encode(clip[None]).latent_dist.mode()[0] * pipe.vae.config.scaling_factor
    assert pipe.vae.config.scaling_factor != 1.0
    torch.testing.assert_close(latents, expected, rtol=0, atol=0)
    assert latents.shape == (tiny_config(NAME)["in_channels"], 3, 4, 6)  # 4k + 1 frames -> k + 1, x8 spatial


@torch.no_grad()
def test_cp_kwargs_are_the_padded_forward_for_one_prompt() -> None:
    """A CP step cuts the text to the prompt and passes an all-ones mask; for one prompt that is the forward the
    pipeline runs with its padded mask (the padding is masked as a key and dropped from the refiner's mean)."""
    case = family_case(NAME, seed=1, batch_size=1)
    serial = family_case(NAME, seed=1, batch_size=1, cp=False)
    mask = serial.kwargs["encoder_attention_mask"]
    assert not bool(mask.all()) and bool(case.kwargs["encoder_attention_mask"].all())
    assert case.kwargs["encoder_hidden_states"].shape[1] == int(mask.sum()) < mask.shape[1]
    model = build_model(NAME, dtype=torch.float64)
    cast = {k: v.double() if torch.is_floating_point(v) else v for k, v in case.kwargs.items()}
    cast_serial = {k: v.double() if torch.is_floating_point(v) else v for k, v in serial.kwargs.items()}
    out = model(**cast, return_dict=False)[0]
    ref = model(**cast_serial, return_dict=False)[0]
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def _train(recipe: Path, out: Path, nproc: int) -> list[dict]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu.yaml",
           "--num_processes", str(nproc), "train/finetune.py", "--recipe", str(recipe), f"--set=output_dir={out}",
           f"--set=parallel.cp={nproc}", "--set=train.max_steps=2", "--set=logging.wandb_mode=disabled",
           "--set=checkpoint.export=lora"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_recipe_cp3_matches_one_process_and_lora_loads(tmp_path: Path, pipeline_path: Path) -> None:
    recipe = REPO / "recipes" / "tiny" / f"{NAME}.yaml"
    serial, cp3 = _train(recipe, tmp_path / "cp1", 1), _train(recipe, tmp_path / "cp3", 3)
    assert [m["step"] for m in cp3] == [1, 2]
    for a, b in zip(cp3, serial, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), f"step {a['step']} {key}: {a} vs {b}"

    # The CP run's LoRA export loads into HunyuanVideoPipeline with its trained values and scale.
    from diffusers import HunyuanVideoPipeline
    from safetensors.torch import load_file

    pipe = HunyuanVideoPipeline.from_pretrained(pipeline_path)
    pipe.load_lora_weights(tmp_path / "cp3" / "lora")
    exported = load_file(tmp_path / "cp3" / "lora" / "pytorch_lora_weights.safetensors")
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert len(loaded) == len(exported) > 0
    for name, value in exported.items():  # transformer.<module>.lora_A.weight -> <module>.lora_A.<adapter>.weight
        module, kind = name.removeprefix("transformer.").rsplit(".lora_", 1)
        match = [p for n, p in loaded.items() if n.startswith(module + ".lora_" + kind.split(".")[0] + ".")]
        assert len(match) == 1 and torch.equal(match[0], value), name
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    assert layer.scaling[next(iter(layer.scaling))] == 8.0 / 4
    # the refiner's attention is adapted too (its projections share the LoRA target names)
    assert any(n.startswith("transformer.context_embedder.") for n in exported)
