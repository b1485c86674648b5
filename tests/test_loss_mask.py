"""Masked training (`data.mask_column`): train.prepare pools each item's mask to the latents, the loss multiplies by it.

The source: clips of 9 frames at 32x64 (tiny Wan pipeline), centre-cropped to the 9x32x48 bucket with no resampling
(columns 8-55 kept), so the crop alone moves the mask and every pooled value is exact. Wan latents are (C, 3, 4, 6):
8x8 pixels per latent cell, frames [0], [1-4], [5-8] per latent frame (checked against the tiny VAE itself). The
expected masks are computed here cell by cell from how the test draws them, not by the code under test. The loss is
checked on a batch of the prepared cache (the trainer's path from cache to loss), on a conditioning family (the `keep`
path) and an image family, and under CP 2 against the one-process oracle (train/tools/oracle.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import rank_job
from train.config import recipe_from_dict
from train.data.batches import Batches
from train.data.dataset import BucketBatchSampler, CachedLatentDataset, collate
from train.data.synthetic_media import render_clip, write_image, write_video
from train.models import cache_reads, get_family, tiny_config
from train.models.encoder import causal_frame_cells
from train.prepare import prepare
from train.step import Objective, forward, loss_of
from train.step import prepare as step_inputs
from train.tools.tiny_models import build_model, family_case

F, H, W, FPS = 9, 32, 48, 16.0
SRC_W, LEFT = 64, 8  # source width; the centre crop to W drops LEFT columns on each side
CELLS = ([0], [1, 2, 3, 4], [5, 6, 7, 8])  # Wan's causal VAE: frame 0 alone, then 4 frames per latent frame
STRIDE = 8  # pixels per latent cell, each way


def _clip_mask_0() -> np.ndarray:
    """Item 0's mask as its clip sees it, (F, H, W) in {0, 1}: clip columns < 20 (source < 28) of frames 0-6."""
    m = np.zeros((F, H, W))
    m[:7, :, :20] = 1
    return m


def _clip_mask_1() -> np.ndarray:
    """Item 1's still mask, on every frame: rows < 12."""
    m = np.zeros((F, H, W))
    m[:, :12] = 1
    return m


def _pooled(pixels: np.ndarray) -> torch.Tensor:
    """(1, 3, 4, 6): the mean of the clip's mask over each latent cell's frames and 8x8 pixels."""
    out = np.zeros((1, len(CELLS), H // STRIDE, W // STRIDE))
    for f, frames in enumerate(CELLS):
        for h in range(H // STRIDE):
            for w in range(W // STRIDE):
                out[0, f, h, w] = pixels[frames, h * STRIDE : (h + 1) * STRIDE, w * STRIDE : (w + 1) * STRIDE].mean()
    return torch.from_numpy(out).float()


def _mask_rgb(source_mask: np.ndarray) -> np.ndarray:
    """uint8 (..., 3): the mask in the red channel, its inverse in green: only the red channel may be read."""
    red = (source_mask * 255).astype(np.uint8)
    return np.stack([red, 255 - red, np.zeros_like(red)], axis=-1)


def _to_source(clip_mask: np.ndarray) -> np.ndarray:
    """A clip-geometry mask (F, H, W) placed in the source frame (F, H, SRC_W) the crop cuts it from."""
    src = np.zeros((clip_mask.shape[0], H, SRC_W))
    src[:, :, LEFT : LEFT + W] = clip_mask
    return src


@pytest.fixture(scope="module")
def masked_cache(tmp_path_factory, tiny_pipeline) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("masked")
    rows = []
    for i in range(6):
        clip = render_clip("square", "red", "left", frames=F, height=H, width=SRC_W)
        write_video(root / f"clip_{i}.mp4", clip, FPS)
        rows.append({"file_name": f"clip_{i}.mp4", "text": f"a red square, take {i}"})
    write_video(root / "mask_0.mp4", _mask_rgb(_to_source(_clip_mask_0())), FPS)  # lossless RGB
    write_image(root / "mask_1.png", _mask_rgb(_to_source(_clip_mask_1())[0]))
    write_image(root / "mask_3.png", _mask_rgb(np.ones((H, W))))  # the bucket's size, not the media's
    write_video(root / "mask_5.mp4", _mask_rgb(_to_source(_clip_mask_0())[:5]), FPS)  # 5 frames for 9
    masks = {0: "mask_0.mp4", 1: "mask_1.png", 2: "", 3: "mask_3.png", 4: "nowhere.png", 5: "mask_5.mp4"}
    for i, mask in masks.items():
        if mask:
            rows[i]["mask"] = mask  # item 2 has none: all ones
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = root / "cache"
    data = {"cache_dir": str(cache), "source": str(root), "height": H, "width": W, "num_frames": F, "fps": FPS,
            "mask_column": "mask", "max_bad_fraction": 0.6}  # fmt: skip
    model = {"family": "wan", "pretrained_path": str(tiny_pipeline("wan")), "dtype": "float32"}
    manifest = prepare(recipe_from_dict({"model": model, "data": data, "logging": {"progress_bar": False}}),
                       log=lambda _: None)  # fmt: skip
    return cache, manifest


# ------------------------------------------------------------------------------------------------------- prepare


def test_prepare_caches_masks_pooled_to_the_latents(masked_cache):
    cache, manifest = masked_cache
    assert [s["source"] for s in manifest["samples"]] == ["clip_0.mp4", "clip_1.mp4", "clip_2.mp4"]
    ds = CachedLatentDataset(cache, family=cache_reads("wan"))  # what the trainer opens: no key it refuses
    expected = [_pooled(_clip_mask_0()), _pooled(_clip_mask_1()), torch.ones(1, 3, 4, 6)]
    for i, want in enumerate(expected):
        item = ds[i]
        assert item["latents"].shape[1:] == want.shape[1:], item["latents"].shape
        assert item["loss_mask"].dtype == torch.float32
        assert torch.equal(item["loss_mask"], want), (i, item["loss_mask"], want)
    # each sample's mean mask, recorded for the trainer's startup check (train/data/batches.py check_masks)
    means = [s["mask_mean"] for s in manifest["samples"]]
    assert means == pytest.approx([float(w.mean()) for w in expected], abs=1e-6), means
    # the values the rule predicts where the mask's edges cut cells: columns 16-23 half in, frames 5-8 half in
    assert _pooled(_clip_mask_0())[0, :, 0].tolist() == [[1, 1, 0.5, 0, 0, 0], [1, 1, 0.5, 0, 0, 0],
                                                         [0.5, 0.5, 0.25, 0, 0, 0]]  # fmt: skip
    # batches stack it, and caption dropout passes it through untouched
    sampler = BucketBatchSampler(ds.buckets, 3, shuffle=False)
    batches = Batches(ds, sampler, torch.device("cpu"))
    batch = next(batches)
    assert batch["loss_mask"].shape == (3, 1, 3, 4, 6)
    dropped = batches.caption_dropout(batch, 1.0, torch.Generator().manual_seed(0))
    assert dropped["loss_mask"] is batch["loss_mask"]
    assert not torch.equal(dropped["prompt_embeds"], batch["prompt_embeds"])
    # a sample of a cache without masks, batched with masked ones (several datasets), is trained whole
    mixed = collate([ds[0], {k: v for k, v in ds[1].items() if k != "loss_mask"}])
    assert torch.equal(mixed["loss_mask"][0], expected[0])
    assert torch.equal(mixed["loss_mask"][1], torch.ones(1, 3, 4, 6))


def test_bad_masks_are_counted_and_skipped(masked_cache):
    cache, manifest = masked_cache
    assert manifest["counts"]["bad_by_reason"] == {"bad_mask": 3}
    bad = {r["source"]: r["detail"] for r in manifest["bad"]}
    assert "media's size" in bad["clip_3.mp4"] and "is 48x32 (WxH), its media 64x32" in bad["clip_3.mp4"], bad
    assert "nowhere.png" in bad["clip_4.mp4"], bad
    assert "5 frames" in bad["clip_5.mp4"], bad
    assert sorted(p.name for p in (cache / "samples").iterdir()) == [f"{i:06d}.safetensors" for i in range(3)]


def test_frame_cells_follow_the_vae(tiny_pipeline):
    """A pixel frame changes latent frames from its own cell on (a causal VAE), never an earlier one: the cells the
    test's expectations use are the tiny Wan VAE's. MiniMax-H3's chunked cells give diffusers' own latent count."""
    from diffusers import AutoencoderKLWan
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import video_latent_num_frames

    vae = AutoencoderKLWan.from_pretrained(tiny_pipeline("wan"), subfolder="vae")
    x = torch.rand(1, 3, F, H, W, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        base = vae.encode(x).latent_dist.mean
        for j in range(F):
            y = x.clone()
            y[:, :, j] = -y[:, :, j]
            changed = (vae.encode(y).latent_dist.mean - base).abs().amax((0, 1, 3, 4)) > 1e-6
            first = int(changed.nonzero()[0])
            assert j in CELLS[first], (j, changed)
    assert [list(c) for c in causal_frame_cells(F, 4)] == [list(c) for c in CELLS]
    for n in (0, 1, 2):
        frames = 17 * n + 5
        cells = causal_frame_cells(frames, 4, 17)[: video_latent_num_frames(frames, 17, 5)]
        assert all(len(c) > 0 for c in cells) and [f for c in cells for f in c] == list(range(frames))


# ---------------------------------------------------------------------------------------------------------- loss


def _cache_inputs(cache: Path, mask: str = "cached"):
    """A step's inputs on the cache's first two samples, with their mask, all ones, or none."""
    ds = CachedLatentDataset(cache)
    batch = collate([ds[0], ds[1]])
    if mask == "ones":
        batch["loss_mask"] = torch.ones_like(batch["loss_mask"])
    elif mask == "none":
        del batch["loss_mask"]
    spec = get_family("wan")
    gen = torch.Generator().manual_seed(5)
    return spec, step_inputs(spec, batch, Objective(), gen, model_config=tiny_config("wan"))


def test_masked_loss_on_a_cache_batch(masked_cache):
    cache, _ = masked_cache
    spec, plain = _cache_inputs(cache, "none")
    pred = torch.randn(plain.x0["latents"].shape, generator=torch.Generator().manual_seed(1))
    config = tiny_config("wan")
    unmasked = loss_of(spec, plain, (pred,), Objective(), model_config=config)
    ones = loss_of(spec, _cache_inputs(cache, "ones")[1], (pred,), Objective(), model_config=config)
    assert torch.equal(ones, unmasked)  # bit for bit
    _, masked = _cache_inputs(cache)
    loss = loss_of(spec, masked, (pred,), Objective(), model_config=config)
    # the masked MSE by hand: squared error against noise - x0, times the mask, mean over every element
    target = masked.noise["latents"].double() - masked.x0["latents"].double()
    want = ((pred.double() - target) ** 2 * masked.batch["loss_mask"].double()).mean()
    assert abs(loss.item() - want.item()) <= 1e-6 * want.item(), (loss, want)
    assert loss.item() < 0.5 * unmasked.item()  # half the elements or fewer kept


@pytest.mark.parametrize("family", ["wan22_ti2v", "flux"])
def test_mask_with_conditioning_and_on_images(family):
    """wan22_ti2v keeps its clean first frame out of the loss (`keep`, normalised by the kept count): the mask
    multiplies within that. Flux caches (C, H, W) latents: its mask is (B, 1, H, W)."""
    spec, inputs = get_family(family), family_case(family, seed=1, batch_size=2)
    latents = inputs.x0["latents"]
    mask = (torch.arange(latents.shape[-1]) < latents.shape[-1] // 2).to(latents.dtype)
    mask = mask.expand(latents.shape[0], 1, *latents.shape[2:]).contiguous()
    model = build_model(family, seed=0)
    config = model.config
    with torch.no_grad():
        out = forward(model, inputs)  # Flux's is packed (B, N, 4C): predictions() unpacks it
    pred = spec.predictions(out, inputs.shapes, model_config=config)["latents"]
    plain = loss_of(spec, inputs, out, Objective(), model_config=config)
    with_ones = dataclasses.replace(inputs, batch={**inputs.batch, "loss_mask": torch.ones_like(mask)})
    assert torch.equal(loss_of(spec, with_ones, out, Objective(), model_config=config), plain)
    masked = dataclasses.replace(inputs, batch={**inputs.batch, "loss_mask": mask})
    loss = loss_of(spec, masked, out, Objective(), model_config=config)
    err = (pred.double() - (inputs.noise["latents"].double() - latents.double())) ** 2
    keep = torch.ones_like(err) if inputs.condition is None else (1 - inputs.condition.double()).expand_as(err)
    per_sample = (err * mask.double() * keep).flatten(1).sum(1) / keep.flatten(1).sum(1)
    assert (inputs.condition is not None) == (family == "wan22_ti2v")
    assert abs(loss.item() - per_sample.mean().item()) <= 1e-6 * per_sample.mean().item()


def test_masked_out_predictions_get_no_gradient():
    spec, inputs = get_family("wan"), family_case("wan", seed=1, batch_size=2)
    latents = inputs.x0["latents"]
    mask = torch.zeros(latents.shape[0], 1, *latents.shape[2:])
    mask[..., : latents.shape[-1] // 2] = 1.0
    mask[1, :, -1] = 0.5  # a partial weight too
    inputs = dataclasses.replace(inputs, batch={**inputs.batch, "loss_mask": mask})
    model = build_model("wan", seed=0)
    out = forward(model, inputs)
    out[0].retain_grad()
    loss_of(spec, inputs, out, Objective(), model_config=model.config).backward()
    grad = out[0].grad
    dropped = (mask == 0).expand_as(grad)
    assert torch.count_nonzero(grad[dropped]) == 0
    assert bool((grad[~dropped] != 0).all())
    # where kept, the gradient is the unmasked one times the mask: d/dpred of mean(mask * err) = 2 mask (p - t) / N
    target = inputs.noise["latents"] - latents
    torch.testing.assert_close(grad, 2 * mask * (out[0].detach() - target) / grad.numel())


# ------------------------------------------------------------------------------------------------------------ CP


def _cp_masked(rank: int, world: int) -> dict:
    """One step of the tiny Wan model with a half mask: serial (no CP) and CP over the group, then the errors."""
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import GradReduction, enable_context_parallel
    from train.tools.oracle import compare, run_step

    inputs = family_case("wan", seed=1, batch_size=2)
    latents = inputs.x0["latents"]
    mask = torch.zeros(latents.shape[0], 1, *latents.shape[2:])
    mask[..., : latents.shape[-1] // 2] = 1.0
    unmasked = run_step(build_model("wan", seed=0), inputs)
    inputs = dataclasses.replace(inputs, batch={**inputs.batch, "loss_mask": mask})
    serial = run_step(build_model("wan", seed=0), inputs)
    model = build_model("wan", seed=0)
    state = enable_context_parallel(model, mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses")))
    cp = run_step(model, inputs, reduce=GradReduction("allreduce", cp_group=state.cp_group).reduce_gradients)
    errors = compare(cp, serial)
    return {"out": errors.out, "loss": errors.loss, "grad": errors.grad, "worst": errors.worst,
            "masked_loss": serial.loss, "unmasked_loss": unmasked.loss}  # fmt: skip


rank_job(2)(_cp_masked)


def test_cp2_with_a_mask_equals_one_process(group):
    for r in group(_cp_masked, 2):
        assert r["masked_loss"] < 0.75 * r["unmasked_loss"], r  # the mask is in effect
        assert r["out"] < 1e-5 and r["loss"] < 1e-6 and r["grad"] < 2e-5, r
