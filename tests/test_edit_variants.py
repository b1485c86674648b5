"""The editing variants (Qwen-Image-Edit, FLUX.1 Kontext), end to end against their diffusers pipelines.

1. The cache `train.prepare` writes from media + reference images, fed through the family spec, gives exactly the
   transformer inputs the pipeline's own __call__ builds for that reference image and prompt (reference latents,
   packed layout, prompt embeddings with the image, img_shapes / position ids): captured from a one-step pipeline run.
2. The loss covers only the target tokens: its gradient on the reference slice of the output is exactly zero, and the
   prediction does not change when the reference slice of the output does.
3. Bad and missing reference images are bad items of `train.prepare`, counted by reason.
4. The tiny recipes' sequences (target + reference tokens) are uneven for CP 2, 3 and 4.
Elsewhere: model-level parity at every CP layout in tests/test_cp_models.py; each variant's prepared cache trained
through the launcher (Qwen-Image-Edit under CP 2, Kontext under ring 2 x Ulysses 2) with the serial oracle's first
step, and its LoRA export reloaded into its pipeline, in tests/test_families_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train.config import recipe_from_dict
from train.data.synthetic_media import make_media_set
from train.models import get_encoder, get_family
from train.prepare import prepare
from train.tools import tiny_models as tm

FAMILIES = ("qwenimage_edit", "flux_kontext")
HEIGHT, WIDTH = 48, 80  # target: 3 x 5 packed tokens; references at the pipelines' ~1 MP size


def _pipeline(family: str, folder: Path):
    """The variant's pipeline from its tiny folder, with the components its encoder loads it with."""
    import diffusers

    spec = get_family(family)
    # Qwen-Image-Edit: its processor without torchvision
    components = get_encoder(family).pipeline_components(str(folder), None)
    return getattr(diffusers, spec.pipeline_class).from_pretrained(folder, **components)


def _prepared(family: str, tmp: Path, pipeline: Path) -> list[dict]:
    """One image with its reference, cached by `train.prepare`; the media rows."""
    media = tmp / "media"
    rows = make_media_set(media, num_videos=0, num_images=1, height=HEIGHT, width=WIDTH, references=True)
    recipe = {
        "model": {"family": family, "pretrained_path": str(pipeline), "dtype": "float32"},
        "data": {"source": str(media), "cache_dir": str(tmp / "cache"), "height": HEIGHT, "width": WIDTH,
                 "num_frames": 1, "max_text_tokens": 16},
        "train": {"seed": 0},
    }  # fmt: skip
    manifest = prepare(recipe_from_dict(recipe), log=lambda _: None)
    assert manifest["counts"]["ok"] == 1 and manifest["counts"]["bad"] == 0
    return rows


def _close(a, b, what: str, tol: float = 1e-5) -> None:
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape, (what, a.shape, b.shape)
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
        assert err <= tol, f"{what}: relative error {err:.3g}"
    else:
        assert a == b, (what, a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_gives_the_pipelines_transformer_inputs_and_the_loss_only_the_target(
    family: str, tmp_path: Path, tiny_pipeline
) -> None:
    from PIL import Image

    spec = get_family(family)
    folder = tiny_pipeline(family)
    pipe = _pipeline(family, folder)
    rows = _prepared(family, tmp_path, folder)

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


def test_bad_and_missing_references_are_bad_items(tmp_path: Path, tiny_pipeline) -> None:
    family = "flux_kontext"
    folder = tiny_pipeline(family)
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
