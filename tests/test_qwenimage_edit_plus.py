"""Qwen-Image-Edit-Plus (`qwenimage_edit_plus`: 2509 and 2511), what the family-generic tests do not cover (those pick
it up: the two-image pipeline-step driver in test_families.py, model-level CP parity at every layout with zero_cond_t
in test_cp_models.py, prepare + trainer CP 3 run + LoRA reload in test_families_e2e.py, the 2509 / 2511 configs and
the 2509 recipe in test_real_models.py).

(1) The cache of an item's 1, 2 or 3 control images, and of 3 columns one of which the item lacks, is what
    QwenImageEditPlusPipeline hands its transformer for the same images (the ones the item has, in order) and caption:
    the prompt embeddings ("Picture k: ..." per image, each image at the VL area) exactly, the packed image latents
    after the target tokens (each image at the VAE area) exactly, and one img_shapes entry per image; an item with no
    readable control image is bad, a recipe naming more columns than the family reads is refused.
(2) zero_cond_t (2511's config, the tiny recipe's): from our img_shapes the transformer modulates exactly the control
    tokens at timestep 0, and its prediction differs from the same weights without it (2509).
(3) Mixed control counts: train.prepare of items with 1, 2 and 3 control images (one lacking its second column)
    records each sample's layout, the sampler's batches never mix layouts (a mixed batch would not collate), and a
    trainer run at CP 2 over every layout equals the serial run step for step.
Each image is resized to the pipeline module's CONDITION_IMAGE_SIZE / VAE_IMAGE_SIZE areas; the VAE area is patched to
128 x 128 (64 x 64 in (3)) for speed, read by the pipeline and the encoder alike.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import diffusers
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
from PIL import Image

from tests.harness import assert_same_steps
from train.config import recipe_from_dict
from train.data.batches import build_dataset, make_batches
from train.data.dataset import CachedLatentDataset, collate
from train.data.media import BadMediaError
from train.errors import UserError
from train.models import cache_reads, get_encoder, get_family, real_configs, tiny_config, transformer_config
from train.models.qwenimage_edit_plus.spec import REFERENCES
from train.prepare import prepare
from train.tools import tiny_models as tm

FAMILY = "qwenimage_edit_plus"
CAPTION = "put the cat from picture 2 on the sofa of picture 1"
SIZES = ((24, 40), (36, 20), (30, 30))  # (H, W) of three control images: three aspect ratios


def _images(root: Path) -> list[tuple[Image.Image, str]]:
    out = []
    for i, (h, w) in enumerate(SIZES):
        pixels = torch.randint(0, 256, (h, w, 3), generator=torch.Generator().manual_seed(10 + i), dtype=torch.uint8)
        image, path = Image.fromarray(pixels.numpy()), root / f"control_{i}.png"
        image.save(path)
        out.append((image, str(path)))
    return out


class _Called(Exception):
    """Raised by the captured transformer forward: the pipeline's inputs are all we need."""


def _pipeline_inputs(pipe: Any, images: list[Image.Image], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What QwenImageEditPlusPipeline.__call__ passes its transformer at the first step for `images` and CAPTION."""
    seen: dict[str, Any] = {}
    original = pipe.transformer.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise _Called

    monkeypatch.setattr(pipe.transformer, "forward", forward)
    _, _, _, h, w = _target()
    with pytest.raises(_Called):
        pipe(image=images, prompt=CAPTION, height=h * 8, width=w * 8, num_inference_steps=1, output_type="latent")
    return seen


def _target() -> tuple[int, ...]:
    return (1, *tm.tiny_recipe(FAMILY).data.synthetic.shapes["latents"])


@pytest.fixture(scope="module")
def loaded(tiny_pipeline, tmp_path_factory: pytest.TempPathFactory):
    """(the family encoder, the Plus pipeline) of the tiny pipeline, and the three control images."""
    path = tiny_pipeline(FAMILY)
    encoder = get_encoder(FAMILY)
    encoder.load(str(path))
    pipe = diffusers.QwenImageEditPlusPipeline.from_pretrained(path, **encoder.pipeline_components(str(path), None))
    return encoder, pipe, _images(tmp_path_factory.mktemp("controls"))


# (1) The cache is the pipeline's inputs -------------------------------------------------------------------------------

# the item's columns (indices into SIZES, None: the item lacks that column) -> the images the pipeline is given
CASES = {"1 image": [0], "2 images": [0, 1], "3 images": [0, 1, 2], "3 columns, the 2nd missing": [0, None, 2]}


@pytest.mark.parametrize("columns", CASES.values(), ids=CASES.keys())
@torch.no_grad()
def test_cache_is_the_pipelines_prompt_and_packed_latents(
    columns: list[int | None], loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 128 * 128)
    encoder, pipe, images = loaded
    extra = encoder.load_extra("item", None, None, None, [None if i is None else images[i][1] for i in columns])
    item = encoder.encode_extra(extra, None, "mode", None) | encoder.encode_item_text(CAPTION, None, extra)
    given = [images[i][0] for i in columns if i is not None]
    assert [k for k in item if k.startswith("reference")] == list(REFERENCES[: len(given)])  # the first k keys
    theirs = _pipeline_inputs(pipe, given, monkeypatch)

    spec, batch = get_family(FAMILY), collate([item])
    noisy = torch.randn(*_target(), generator=torch.Generator().manual_seed(0))
    ours = spec.forward_kwargs(batch, noisy, torch.tensor([0.5]), model_config=pipe.transformer.config)
    target = noisy.shape[-2] // 2 * (noisy.shape[-1] // 2)
    # tolerance 0: the same functions on the same pixels
    assert torch.equal(ours["encoder_hidden_states"], theirs["encoder_hidden_states"])
    assert ours["encoder_hidden_states_mask"] is None and theirs["encoder_hidden_states_mask"] is None  # batch 1
    assert ours["hidden_states"].shape == theirs["hidden_states"].shape
    assert torch.equal(ours["hidden_states"][:, target:], theirs["hidden_states"][:, target:])  # the packed images
    assert ours["img_shapes"] == theirs["img_shapes"] and len(ours["img_shapes"][0]) == 1 + len(given)
    # each image at its own aspect ratio: the Plus pipeline's VAE size (a multiple of 32 near the VAE area)
    for (_, h, w), image in zip(ours["img_shapes"][0][1:], given):
        assert (w * 16, h * 16) == plus.calculate_dimensions(128 * 128, image.size[0] / image.size[1])
    sizes = [f"{h * 2}x{w * 2}" for _, h, w in ours["img_shapes"][0][1:]]  # latent H' x W' of each image
    assert encoder.batch_layout(item) == "controls " + " ".join(sizes)


def test_items_without_a_control_image_are_bad_and_a_fifth_column_is_refused(loaded, tmp_path: Path) -> None:
    encoder, _, _ = loaded
    with pytest.raises(BadMediaError) as none:
        encoder.load_extra("item", None, None, None, [None, None, None])
    (tmp_path / "broken.png").write_bytes(b"not a png")
    with pytest.raises(BadMediaError) as broken:
        encoder.load_extra("item", None, None, None, [None, str(tmp_path / "broken.png")])
    assert (none.value.reason, broken.value.reason) == ("no_reference", "bad_reference")
    from train.prepare import check_ready

    for family, columns in ((FAMILY, ["a", "b", "c", "d"]), ("qwenimage_edit", ["a", "b"])):
        recipe = recipe_from_dict({"model": {"family": family, "pretrained_path": str(tmp_path)},
                                   "data": {"source": str(tmp_path), "cache_dir": str(tmp_path / "c"),
                                            "reference_column": columns}})  # fmt: skip
        with pytest.raises(UserError, match=r"data.reference_column: .* at most \d reference image"):
            check_ready(recipe)


# (2) zero_cond_t ------------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_zero_cond_t_gives_exactly_the_control_tokens_timestep_zero() -> None:
    assert real_configs(FAMILY)["Qwen/Qwen-Image-Edit-2511"]["zero_cond_t"] is True
    assert "zero_cond_t" not in real_configs(FAMILY)["Qwen/Qwen-Image-Edit-2509"]
    assert transformer_config(FAMILY, pretrained_path="Qwen/Qwen-Image-Edit-2511")["zero_cond_t"] is True
    case = tm.family_case(FAMILY, 0, batch_size=2)
    model = tm.build_model(FAMILY).eval()
    assert model.config.zero_cond_t and tiny_config(FAMILY)["zero_cond_t"]
    seen: list[torch.Tensor] = []
    model.transformer_blocks[0].register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["modulate_index"]), with_kwargs=True
    )
    out = model(**case.kwargs, return_dict=False)[0]
    shapes = case.kwargs["img_shapes"][0]  # target, control 1, control 2
    tokens = [s[1] * s[2] for s in shapes]
    assert tokens == [35, 30, 12]
    expected = torch.tensor([[0] * tokens[0] + [1] * (tokens[1] + tokens[2])] * 2, dtype=torch.int)
    assert torch.equal(seen[0], expected)  # 0: the target's tokens (the step's timestep), 1: the images' (t = 0)
    plain = diffusers.QwenImageTransformer2DModel.from_config({**model.config, "zero_cond_t": False}).eval()
    plain.load_state_dict(model.state_dict())
    other = plain(**case.kwargs, return_dict=False)[0]
    assert (out[:, : tokens[0]] - other[:, : tokens[0]]).abs().max() > 1e-3  # the flag reaches the prediction


# (3) Mixed control counts: bucketed apart, CP 2 = serial -------------------------------------------------------------

# per item: its three control columns (an index into the image sizes below, None: the item lacks that column)
ITEMS = [(0, None, None), (0, None, None), (0, 1, None), (0, None, 1), (0, 1, 2), (0, 1, 2)]
MIXED_SIZES = ((24, 24), (24, 40), (40, 24))  # (H, W) of the control images of each column


def _mixed_media(root: Path) -> Path:
    """Six images with captions of different lengths and the control columns of ITEMS (one reference column each)."""
    from train.data.synthetic_media import make_media_set, render_clip, write_image

    rows = make_media_set(root, num_videos=0, num_images=len(ITEMS), height=32, width=48, references=True)
    for j, (row, columns) in enumerate(zip(rows, ITEMS)):
        row["text"] = " ".join(row["text"].split()[: 3 + j])
        row.pop("reference")
        for k, size in enumerate(columns):
            if size is not None:
                row[f"control_{k + 1}"] = f"control_{j}_{k}.png"
                h, w = MIXED_SIZES[size]
                image = render_clip(
                    ("square", "circle", "triangle")[k], "red", None, "gray", frames=1, height=h, width=w
                )
                write_image(root / row[f"control_{k + 1}"], image[0])
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_mixed_control_counts_are_bucketed_apart_and_cp_equals_serial(
    tiny_pipeline, runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 64 * 64)
    recipe = {
        "model": {"family": FAMILY, "pretrained_path": str(tiny_pipeline(FAMILY)), "dtype": "float32"},
        "data": {"source": str(_mixed_media(tmp_path / "media")), "cache_dir": str(tmp_path / "cache"), "height": 32,
                 "width": 48, "reference_column": ["control_1", "control_2", "control_3"]},
        "train": {"max_steps": 3, "batch_size": 2, "lr": 1e-3, "seed": 1, "mixed_precision": "no"},
        "finetune": {"method": "lora", "lora_rank": 4, "lora_alpha": 8.0},
        "checkpoint": {"export": "none"},
    }  # fmt: skip
    manifest = prepare(recipe_from_dict(recipe), log=lambda _: None)
    assert manifest["counts"]["ok"] == len(ITEMS) and manifest["counts"]["bad"] == 0, manifest["counts"]
    layouts = [s["layout"] for s in manifest["samples"]]
    assert [len(x.split()) - 1 for x in layouts] == [1, 1, 2, 2, 3, 3], layouts  # the control count
    assert layouts[2] == layouts[3] and len(set(layouts)) == 3  # the missing 2nd column: the 3rd comes 2nd
    dataset = CachedLatentDataset(tmp_path / "cache", family=cache_reads(FAMILY))
    assert len(set(dataset.buckets)) == 3
    with pytest.raises(ValueError, match="different tensors"):  # what one batch of 1 and 2 control images would do
        collate([dataset[1], dataset[2]])
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    r = recipe_from_dict(recipe)
    batches = make_batches(build_dataset(r, get_family(FAMILY), cache_reads(FAMILY)), r, 0, 1, torch.device("cpu"))
    seen = set()
    for _ in range(3):  # one epoch: a batch of each layout
        batch = next(batches)
        counts = {sum(k.startswith("reference_latents") for k in batch)}
        seen |= counts
        assert batch["latents"].shape[0] == 2
    assert seen == {1, 2, 3}
    serial = runs(path, nproc=1).ok().metrics
    cp = runs(path, "parallel.cp=2", nproc=2).ok().metrics
    assert [m["step"] for m in cp] == [1, 2, 3]
    assert_same_steps(cp, serial, "CP 2 vs serial over batches of 1, 2 and 3 control images")
    rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(cp, serial))
    print(f"\nmixed control counts: CP 2 losses {[m['loss'] for m in cp]}, largest relative error vs serial {rel:.2e}")
    assert len({m["loss"] for m in cp}) == 3
