"""The editing variants (Qwen-Image-Edit, FLUX.1 Kontext), end to end against their diffusers pipelines.

1. The cache `train.prepare` writes from media + reference images, fed through the family spec, gives exactly the
   transformer inputs the pipeline's own __call__ builds for that reference image and prompt (reference latents,
   packed layout, prompt embeddings with the image, img_shapes / position ids): captured from a one-step pipeline run.
2. The loss covers only the target tokens: its gradient on the reference slice of the output is exactly zero, and the
   prediction does not change when the reference slice of the output does.
3. The prepared cache trains under CP 3 on 3 processes through the real entry point with the 1-process loss and
   grad-norm (1e-5 relative); the LoRA it exports loads in the variant's pipeline with the trained values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import tiny_models as tm
from tests.test_families_e2e import _train
from train.config import recipe_from_dict
from train.data.synthetic_media import make_media_set
from train.models import build_tiny_pipeline, get_encoder, get_family
from train.prepare import prepare

FAMILIES = ("qwenimage_edit", "flux_kontext")
HEIGHT, WIDTH = 48, 80  # target: 3 x 5 packed tokens; references at the pipelines' ~1 MP size
REL_TOL = 1e-5


def _pipeline(family: str, path: Path):
    import diffusers

    spec = get_family(family)
    folder = build_tiny_pipeline(family, path)
    components = get_encoder(family)._components(str(folder), None)  # Qwen-Image-Edit: processor without torchvision
    return getattr(diffusers, spec.pipeline_class).from_pretrained(folder, **components), folder


def _prepared(family: str, tmp: Path, pipeline: Path) -> tuple[dict, list[dict]]:
    media = tmp / "media"
    rows = make_media_set(media, num_videos=0, num_images=3, height=HEIGHT, width=WIDTH, references=True)
    recipe = {
        "model": {"family": family, "pretrained_path": str(pipeline), "dtype": "float32"},
        "data": {"source": str(media), "cache_dir": str(tmp / "cache"), "height": HEIGHT, "width": WIDTH,
                 "num_frames": 1, "max_text_tokens": 16},
        "train": {"max_steps": 2, "batch_size": 1, "lr": 1e-3, "seed": 0, "mixed_precision": "no"},
        "finetune": {"method": "lora", "lora_rank": 4, "lora_alpha": 8.0},
        "logging": {"wandb_mode": "disabled", "progress_bar": False},
        "checkpoint": {"export": "lora"},
    }  # fmt: skip
    manifest = prepare(recipe_from_dict(recipe), log=lambda _: None)
    assert manifest["counts"]["ok"] == 3 and manifest["counts"]["bad"] == 0
    return recipe, rows


def _close(a, b, what: str, tol: float = 1e-5) -> None:
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape, (what, a.shape, b.shape)
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
        assert err <= tol, f"{what}: relative error {err:.3g}"
    else:
        assert a == b, (what, a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_gives_the_pipelines_transformer_inputs_and_trains_under_cp3(family: str, tmp_path: Path) -> None:
    from PIL import Image

    spec = get_family(family)
    pipe, folder = _pipeline(family, tmp_path / "pipe")
    recipe, rows = _prepared(family, tmp_path, folder)

    # 1. the pipeline's own preparation of item 0: one denoising step, the transformer's inputs captured
    captured: dict = {}

    def grab(module, args, kwargs):
        captured.update(kwargs)

    pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    media = tmp_path / "media"
    reference = Image.open(media / rows[0]["reference"]).convert("RGB")
    size = {"max_area": HEIGHT * WIDTH} if family == "flux_kontext" else {}  # Kontext rescales the target to it
    pipe(image=reference, prompt=rows[0]["text"], height=HEIGHT, width=WIDTH, num_inference_steps=1,
         max_sequence_length=16, output_type="latent", generator=torch.Generator().manual_seed(0), **size)  # fmt: skip
    sample = load_file(tmp_path / "cache" / "samples" / "000000.safetensors")
    batch = {k: v[None] for k, v in sample.items()}
    target = captured["hidden_states"][:, : (HEIGHT // 16) * (WIDTH // 16)]  # the pipeline's noisy target tokens
    shapes = {"latents": batch["latents"].shape}
    noisy = spec.unpack_output((target,), shapes, model_config=pipe.transformer.config)["latents"]
    sigma = captured["timestep"]  # the pipelines pass timestep / 1000 = sigma
    ours = spec.forward_kwargs(batch, noisy, sigma, model_config=pipe.transformer.config)
    assert ours["hidden_states"].shape[1] == spec.tokens_per_sample(
        {k: v.shape for k, v in sample.items()}, pipe.transformer.config
    )
    for key, value in ours.items():
        ref = captured[key]
        if key == "encoder_hidden_states_mask" and ref is None:
            assert value is None or bool(value.all())
            continue
        if key in ("encoder_hidden_states_mask",) and value is not None:
            value, ref = value.bool(), ref.bool()
            assert torch.equal(value, ref), key
            continue
        if isinstance(value, torch.Tensor) and not value.is_floating_point():
            assert torch.equal(value, ref), key
            continue
        _close(value, ref, f"{family} {key}")

    # 2. the prediction is the first H/2 * W/2 tokens; the loss's gradient on the reference slice is exactly 0
    out = captured["hidden_states"].clone().requires_grad_(True)  # stands in for the transformer output
    pred = spec.predictions((out,), shapes, model_config=pipe.transformer.config)["latents"]
    torch.nn.functional.mse_loss(pred, torch.randn_like(pred)).backward()
    n = target.shape[1]
    assert out.grad[:, n:].abs().max() == 0 and out.grad[:, :n].abs().min() > 0
    changed = out.detach().clone()
    changed[:, n:] = torch.randn_like(changed[:, n:])
    assert torch.equal(spec.predictions((changed,), shapes, model_config=pipe.transformer.config)["latents"], pred)

    # 3. CP 3 on 3 processes vs 1 through the real entry point, then the LoRA export in the pipeline
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    serial, cp3 = _train(path, tmp_path / "cp1", 1), _train(path, tmp_path / "cp3", 3)
    assert [m["step"] for m in cp3] == [1, 2]
    for a, b in zip(cp3, serial):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= REL_TOL * abs(b[key]), f"{family} step {a['step']} {key}: {a} vs {b}"
    pipe.load_lora_weights(tmp_path / "cp3" / "lora")
    exported = load_file(tmp_path / "cp3" / "lora" / "pytorch_lora_weights.safetensors")
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert len(loaded) == len(exported) > 0
    for name, value in exported.items():
        module, kind = name.removeprefix("transformer.").rsplit(".lora_", 1)
        match = [p for n, p in loaded.items() if n.startswith(module + ".lora_" + kind.split(".")[0] + ".")]
        assert len(match) == 1 and torch.equal(match[0], value), name


def test_bad_and_missing_references_are_bad_items(tmp_path: Path) -> None:
    family = "flux_kontext"
    folder = build_tiny_pipeline(family, tmp_path / "pipe")
    media = tmp_path / "media"
    make_media_set(media, num_videos=0, num_images=4, height=HEIGHT, width=WIDTH, references=True)
    rows = [json.loads(line) for line in (media / "metadata.jsonl").read_text().splitlines()]
    del rows[1]["reference"]
    (media / rows[2]["reference"]).write_bytes(b"not an image")
    (media / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "model": {"family": family, "pretrained_path": str(folder), "dtype": "float32"},
        "data": {"source": str(media), "cache_dir": str(tmp_path / "cache"), "height": HEIGHT, "width": WIDTH,
                 "num_frames": 1, "max_text_tokens": 16, "max_bad_fraction": 0.5},
    }  # fmt: skip
    manifest = prepare(recipe_from_dict(recipe), log=lambda _: None)
    assert manifest["counts"]["ok"] == 2
    assert manifest["counts"]["bad_by_reason"] == {"bad_reference": 1, "no_reference": 1}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_recipe_sequence_is_target_plus_reference(family: str) -> None:
    """The tiny recipe's transformer sequence (target + reference tokens) is uneven for CP 2, 3 and 4, and the plan's
    rope tables / position ids cover it whole."""
    case = tm.family_case(family)
    tokens = case.kwargs["hidden_states"].shape[1]
    assert tokens == get_family(family).tokens_per_sample(
        {k: v.shape[1:] for k, v in case.batch.items()}, tm.tiny_config(family)
    )
    assert all(tokens % d for d in (2, 3, 4))
