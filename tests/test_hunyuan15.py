"""HunyuanVideo 1.5 (no diffusers CP plan: cp_plans/hunyuan_video15.yaml): the cache is what HunyuanVideo15Pipeline
computes (its own `encode_prompt`: Qwen2.5-VL states after the template crop, ByT5 states of the quoted glyph text; the
VAE's scaling), the key-mask processor the plan installs under CP gives the stock processor's output and every
gradient, the tiny recipe under CP 3 matches 1 process through the real entry point, and its LoRA export loads in
HunyuanVideo15Pipeline. Model-level parity at CP 2, 3, 4 is in tests/test_cp_models.py; the forward kwargs vs one
pipeline step in tests/test_families.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_models import build_model, family_case, family_loss, output_tensors
from train.models import build_tiny_pipeline, get_encoder, tiny_config
from train.models.hunyuan_video15.attention import HunyuanVideo15KeyMaskAttnProcessor, install

REPO = Path(__file__).resolve().parents[1]
NAME = "hunyuan_video15"
CAPTIONS = ("a red square", 'a sign that reads "OPEN" in a blue circle')  # the second quotes glyph text for ByT5


@pytest.fixture(scope="module")
def pipeline_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_pipeline(NAME, tmp_path_factory.mktemp("hunyuan15") / "pipe")


@torch.no_grad()
def test_cache_is_the_pipelines(pipeline_path: Path) -> None:
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(pipeline_path)
    encoder = get_encoder(NAME)
    encoder.load(str(pipeline_path))
    assert encoder.text_tokens(None) == pipe.tokenizer_max_length  # prepare's default: the pipeline's 1000
    for caption in CAPTIONS:
        ours = encoder.encode_text(caption, pipe.tokenizer_max_length)
        embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(prompt=caption, device="cpu")
        torch.testing.assert_close(ours["prompt_embeds"], embeds[0], rtol=0, atol=0)
        torch.testing.assert_close(ours["byt5_embeds"], embeds_2[0], rtol=0, atol=0)
        assert torch.equal(ours["prompt_mask"], mask[0].bool()) and torch.equal(ours["byt5_mask"], mask_2[0].bool())
        assert not ours["prompt_mask"].all()  # right-padded to the pipeline's length
        quoted = '"' in caption
        assert bool(ours["byt5_mask"].any()) == quoted and bool(ours["byt5_embeds"].abs().sum() > 0) == quoted

    # Latents: the VAE posterior's mean times scaling_factor, what the pipeline's decode divides back out.
    clip = torch.rand(3, 9, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = encoder.encode_media(clip, None, "mode", 24.0)["latents"]
    expected = pipe.vae.encode(clip[None]).latent_dist.mode()[0] * pipe.vae.config.scaling_factor
    assert pipe.vae.config.scaling_factor != 1.0
    torch.testing.assert_close(latents, expected, rtol=0, atol=0)
    assert latents.shape == (tiny_config(NAME)["out_channels"], 3, 2, 3)  # 4k + 1 frames -> k + 1, x16 spatial


def test_key_mask_processor_is_exact() -> None:
    """The key mask (B, 1, 1, S) gives the stock (B, 1, S, S) processor's output and every gradient, in fp64, for a
    batch of two whose Qwen and ByT5 masks are padded (the stock mask's extra rows only touch padded tokens)."""
    case = family_case(NAME, seed=1, dtype=torch.float64)
    assert not bool(case.kwargs["encoder_attention_mask"].all())
    results = []
    for swap in (False, True):
        model = build_model(NAME, seed=0, dtype=torch.float64)
        if swap:
            assert (
                install(model) == tiny_config(NAME)["num_layers"]
            )  # one per dual-stream block, the refiner keeps its own
            assert all(type(b.attn.processor) is HunyuanVideo15KeyMaskAttnProcessor for b in model.transformer_blocks)
        out = output_tensors(NAME, model(**case.kwargs, return_dict=False))
        family_loss(case, out, model.config).backward()
        results.append((out[0], {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (ref, ref_grads), (got, grads) = results
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-14)
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-12, atol=1e-14, msg=lambda m, n=name: f"{n}: {m}")


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
    """Batch of two with padded masks of both text encoders: exact under CP (no text cut)."""
    recipe = REPO / "recipes" / "tiny" / f"{NAME}.yaml"
    serial, cp3 = _train(recipe, tmp_path / "cp1", 1), _train(recipe, tmp_path / "cp3", 3)
    assert [m["step"] for m in cp3] == [1, 2]
    for a, b in zip(cp3, serial, strict=True):
        print(f"step {a['step']}: loss {a['loss']:.9g} vs {b['loss']:.9g}, "
              f"grad_norm {a['grad_norm']:.9g} vs {b['grad_norm']:.9g}")  # fmt: skip
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), f"step {a['step']} {key}: {a} vs {b}"

    # The CP run's LoRA export loads into HunyuanVideo15Pipeline's transformer with its trained values and scale (the
    # pipeline has no load_lora_weights in diffusers 0.42.1; its transformer is a PeftAdapterMixin).
    from diffusers import HunyuanVideo15Pipeline
    from safetensors.torch import load_file

    pipe = HunyuanVideo15Pipeline.from_pretrained(pipeline_path)
    assert not hasattr(pipe, "load_lora_weights")
    pipe.transformer.load_lora_adapter(
        tmp_path / "cp3" / "lora", prefix="transformer", weight_name="pytorch_lora_weights.safetensors"
    )
    exported = load_file(tmp_path / "cp3" / "lora" / "pytorch_lora_weights.safetensors")
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert len(loaded) == len(exported) > 0
    for name, value in exported.items():  # transformer.<module>.lora_A.weight -> <module>.lora_A.<adapter>.weight
        module, kind = name.removeprefix("transformer.").rsplit(".lora_", 1)
        match = [p for n, p in loaded.items() if n.startswith(module + ".lora_" + kind.split(".")[0] + ".")]
        assert len(match) == 1 and torch.equal(match[0], value), name
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    assert layer.scaling[next(iter(layer.scaling))] == 8.0 / 4
    assert any(n.startswith("transformer.context_embedder.") for n in exported)  # the refiner's attention too
