"""Data pipeline: media decoding, synthetic media, prepare (cache writing), the cached dataset and the sampler.

Serial, CPU, small: clips are 9 frames of 32x48 (Wan: 3 latent frames of 4x6), tiny random pipelines from
`train.models.build_tiny_pipeline`. Cache-vs-direct comparisons re-encode with the VAE loaded on its own (not through
the pipeline) and the same per-item generator (`train.prepare.item_seed`), so `latent_sample: sample` is checked
exactly; `mode` (the posterior mean) is checked against the pipelines' own argmax helpers for the other families.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.harness import WARM
from train.config import recipe_from_dict
from train.data.batches import check_text_lengths
from train.data.dataset import BucketBatchSampler, CachedLatentDataset, collate, read_manifest
from train.data.media import BadMediaError, Bucket, Geometry, load_audio, load_clip, load_item, probe
from train.data.synthetic_media import (
    COLOR_TONES,
    COLORS,
    SHAPE_TONES,
    make_media_set,
    render_clip,
    render_tones,
    write_image,
    write_video,
)
from train.errors import UserError
from train.models import build_tiny_pipeline, get_encoder
from train.prepare import PrepareError, check_geometry, item_seed, list_source, prepare

REPO = Path(__file__).resolve().parents[1]
F, H, W, FPS = 9, 32, 48, 16.0
BAD = ["corrupt", "missing", "short", "no_caption", "small"]


def _recipe(family: str, pipe: Path, source: Path, cache: Path, **data) -> object:
    d = {"cache_dir": str(cache), "source": str(source), "height": H, "width": W, "num_frames": F, "fps": FPS}
    d.update(data)
    model = {"family": family, "pretrained_path": str(pipe), "dtype": "float32"}
    return recipe_from_dict({"model": model, "data": d, "logging": {"progress_bar": False}})


def _settings(family, pipe, source, cache, data=None, **overrides):
    return _recipe(family, pipe, source, cache, **{**(data or {}), **overrides})  # overrides: more data.* keys


def _quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("media")
    rows = make_media_set(root, num_videos=4, num_images=1, frames=F, height=H, width=W, fps=FPS, bad=BAD, seed=3)
    return root, rows


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> Path:
    return build_tiny_pipeline("wan", tmp_path_factory.mktemp("pipes") / "wan")


@pytest.fixture(scope="module")
def wan_cache(tmp_path_factory, media, wan) -> Path:
    """A complete Wan cache of the media set (video bucket + a 1-frame bucket for the image)."""
    cache = tmp_path_factory.mktemp("cache") / "wan"
    s = _settings("wan", wan, media[0], cache, buckets=[f"{F}x{H}x{W}", f"1x{H}x{W}"], max_bad_fraction=0.6)
    prepare(s, log=_quiet)
    return cache


# ------------------------------------------------------------------------------------------------------------- media


@pytest.mark.parametrize("codec", ["libx264rgb", "ffv1"])
def test_lossless_clip_round_trip_and_fps_resampling(tmp_path, codec):
    frames = render_clip("square", "red", "left", frames=F, height=H, width=W)
    path = write_video(tmp_path / ("a.mkv" if codec == "ffv1" else "a.mp4"), frames, FPS, codec)
    clip = load_clip(path, Bucket(F, H, W), FPS)
    assert clip.dtype == torch.uint8 and clip.shape == (F, 3, H, W)
    assert torch.equal(clip.permute(0, 2, 3, 1), torch.from_numpy(frames))
    half = load_clip(path, Bucket(5, H, W), FPS / 2)  # every other source frame
    assert torch.equal(half.permute(0, 2, 3, 1), torch.from_numpy(frames[::2]))
    assert torch.equal(load_clip(path, Bucket(3, H, W), None).permute(0, 2, 3, 1), torch.from_numpy(frames[:3]))


def test_resize_cover_and_centre_crop(tmp_path):
    # 64x96 with red | green | blue thirds -> scaled by 1/2 to 32x48 -> centre 32 columns: 8 red, 16 green, 8 blue
    img = np.zeros((64, 96, 3), np.uint8)
    img[:, :32], img[:, 32:64], img[:, 64:] = COLORS["red"], COLORS["green"], COLORS["blue"]
    path = write_image(tmp_path / "x.png", img)
    clip = load_clip(path, Bucket(1, 32, 32))
    assert clip.shape == (1, 3, 32, 32)
    for cols, color in ((slice(0, 6), "red"), (slice(10, 22), "green"), (slice(26, 32), "blue")):
        mean = clip[0, :, :, cols].float().mean((1, 2))
        assert (mean - torch.tensor(COLORS[color]).float()).abs().max() < 3, (color, mean)
    with pytest.raises(BadMediaError) as e:
        load_clip(path, Bucket(1, 128, 128))
    assert e.value.reason == "too_small"
    assert load_clip(path, Bucket(1, 128, 128), allow_upscale=True).shape == (1, 3, 128, 128)


def test_bad_media_reasons(media):
    root, rows = media
    buckets = [Bucket(F, H, W), Bucket(1, H, W)]  # the 1-frame bucket takes images, never short clips
    for row in rows:
        if row["expect"] in ("ok", "no_caption"):
            continue
        with pytest.raises(BadMediaError) as e:
            load_item(root / row["file_name"], buckets, FPS)
        assert e.value.reason == row["expect"], row
    with pytest.raises(BadMediaError, match="unreadable"):
        probe(b"not a video at all")


def _peak_hz(wave: torch.Tensor, rate: int) -> list[float]:
    spectrum = np.abs(np.fft.rfft(wave.numpy() * np.hanning(wave.shape[-1]), axis=-1))
    return np.fft.rfftfreq(wave.shape[-1], 1 / rate)[spectrum.argmax(-1)].tolist()


def test_audio_track_is_resampled_stereo_from_the_first_frame(tmp_path):
    clip = render_clip("circle", "blue", "up", frames=24, height=H, width=W)
    tones = render_tones(COLOR_TONES["blue"], SHAPE_TONES["circle"], 1.0, 16000)
    path = write_video(tmp_path / "a.mp4", clip, 24, audio=tones, audio_rate=16000, audio_codec="flac")
    wave = load_audio(path, 7000, 8000)  # 16 kHz FLAC -> 8 kHz
    assert wave.shape == (2, 7000) and wave.dtype == torch.float32
    assert _peak_hz(wave, 8000) == pytest.approx([COLOR_TONES["blue"], SHAPE_TONES["circle"]], abs=1.5)
    t = np.arange(7000) / 8000  # sample k at k / 8000 s after the first frame: in phase with the source
    ref = 0.3 * np.sin(2 * np.pi * np.array([[COLOR_TONES["blue"]], [SHAPE_TONES["circle"]]]) * t)
    assert np.abs(wave.numpy() - ref)[:, 100:-100].max() < 1e-3
    later = load_audio(path, 4000, 8000, start=0.25)
    assert np.abs(later.numpy() - ref[:, 2000:6000])[:, 100:-100].max() < 1e-3
    mono = write_video(tmp_path / "m.mp4", clip, 24, audio=tones[:1], audio_codec="aac")
    wave = load_audio(mono, 4000, 8000)
    assert torch.equal(wave[0], wave[1]) and _peak_hz(wave, 8000)[0] == pytest.approx(COLOR_TONES["blue"], abs=2.5)
    with pytest.raises(BadMediaError) as e:
        load_audio(path, 8400, 8000, max_pad=399)  # 1 s of sound for a 1.05 s window
    assert e.value.reason == "too_short"
    assert load_audio(path, 8400, 8000, max_pad=400)[:, 8000:].abs().max() == 0  # zero-padded end
    with pytest.raises(BadMediaError) as e:
        load_audio(write_video(tmp_path / "silent.mp4", clip, 24), 100, 8000)
    assert e.value.reason == "no_audio"


def test_synthetic_captions_describe_the_clip():
    clip = render_clip("circle", "yellow", "right", "black", frames=5, height=H, width=W)
    masks = [(f == COLORS["yellow"]).all(-1) for f in clip]
    assert all(m.sum() > 20 for m in masks)  # a yellow shape in every frame, the rest is background
    assert all(((f == COLORS["yellow"]).all(-1) | (f == (10, 10, 10)).all(-1)).all() for f in clip)
    xs = [np.nonzero(m)[1].mean() for m in masks]
    assert all(b > a for a, b in itertools.pairwise(xs))  # moving right


def test_geometry_rules_and_startup_errors(media, wan, tmp_path):
    g = Geometry("wan", "video", 16, 4, 1)
    assert g.problems(Bucket(17, 480, 832)) == []
    assert any("4k+1" in p and "use 13 or 17" in p for p in g.problems(Bucket(16, 480, 832)))
    assert any("multiple of 16" in p for p in g.problems(Bucket(17, 50, 832)))
    assert any("image family" in p for p in Geometry("flux", "image", 16).problems(Bucket(5, 64, 64)))
    assert Geometry("ltx", "video", 32, 8, 1).problems(Bucket(17, 64, 96)) == []
    # from the tiny pipeline's own configs, before any weight is loaded
    for data, match in [({"num_frames": 8}, "4k\\+1"), ({"height": 40}, "multiple of 16")]:
        with pytest.raises(ValueError, match=match):
            prepare(_recipe("wan", wan, media[0], tmp_path / "c", **data), log=_quiet)
    assert not (tmp_path / "c").exists()
    with pytest.raises(PrepareError, match="pretrained_path"):
        prepare(recipe_from_dict({"model": {"family": "wan", "init_config": {}}, "data": {}}), log=_quiet)
    check_geometry(_settings("wan", wan, media[0], tmp_path / "c"))
    mm = Geometry("minimax_h3", "video", 32, 17, 5)  # MiniMax-H3: 17n + 5 frames, sides of multiples of 32
    assert mm.problems(Bucket(5, 32, 64)) == mm.problems(Bucket(22, 64, 96)) == []
    assert any("17k+5" in p and "use 5 or 22" in p for p in mm.problems(Bucket(9, 32, 64)))
    assert get_encoder("minimax_h3").geometry(None) == mm


# ----------------------------------------------------------------------------------------------------------- prepare


def test_prepare_reports_bad_items_and_caches_only_good_ones(media, wan_cache):
    root, rows = media
    m = read_manifest(wan_cache)
    expect_bad = {i: r["expect"] for i, r in enumerate(rows) if r["expect"] != "ok"}
    assert {b["index"]: b["reason"] for b in m["bad"]} == expect_bad
    assert m["counts"]["bad_by_reason"] == {k: list(expect_bad.values()).count(k) for k in set(expect_bad.values())}
    ok = [i for i, r in enumerate(rows) if r["expect"] == "ok"]
    assert [s["index"] for s in m["samples"]] == ok
    assert sorted(p.name for p in (wan_cache / "samples").iterdir()) == [f"{i:06d}.safetensors" for i in ok]
    assert m["buckets"] == {f"{F}x{H}x{W}": 4, f"1x{H}x{W}": 1}  # 4 clips + the image in the 1-frame bucket
    assert m["tensors"][f"{F}x{H}x{W}"]["latents"]["shape"] == [4, 3, 4, 6]
    assert m["counts"]["total"] == len(rows) and m["timing"]["seconds"] > 0


def test_too_many_bad_items_fail_after_writing_the_manifest(media, wan, tmp_path):
    with pytest.raises(PrepareError, match="max_bad_fraction"):
        prepare(_settings("wan", wan, media[0], tmp_path / "c"), log=_quiet)
    m = read_manifest(tmp_path / "c")  # one video bucket only: both images (good and small) are too short too
    assert m["counts"]["bad"] == len(BAD) + 1 and m["counts"]["bad_by_reason"]["too_short"] == 3


def test_cached_latents_equal_a_direct_vae_encode(media, wan, wan_cache):
    from diffusers import AutoencoderKLWan, WanPipeline

    root, rows = media
    vae = AutoencoderKLWan.from_pretrained(wan, subfolder="vae")
    pipe = WanPipeline.from_pretrained(wan, transformer=None)
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(-1, 1, 1, 1)
    seed = json.loads((wan_cache / "prepare_config.json").read_text())["seed"]
    m = read_manifest(wan_cache)
    for s in m["samples"]:
        cached = load_file(wan_cache / s["file"])
        frames = F if s["bucket"].startswith(f"{F}x") else 1
        clip = load_clip(root / rows[s["index"]]["file_name"], Bucket(frames, H, W), FPS)
        x = clip.permute(1, 0, 2, 3).float() / 127.5 - 1  # (3, F, H, W) in [-1, 1]
        with torch.no_grad():
            z = vae.encode(x[None]).latent_dist.sample(torch.Generator().manual_seed(item_seed(seed, s["index"])))[0]
        torch.testing.assert_close(cached["latents"], (z - mean) / std, rtol=1e-5, atol=1e-6)
        embeds = pipe.encode_prompt(s["caption"], do_classifier_free_guidance=False, max_sequence_length=512)[0][0]
        torch.testing.assert_close(cached["prompt_embeds"], embeds, rtol=1e-5, atol=1e-5)
        n_tokens = len(pipe.tokenizer(s["caption"]).input_ids)
        assert cached["prompt_mask"].sum() == n_tokens and cached["prompt_mask"][:n_tokens].all()
        with safe_open(str(wan_cache / s["file"]), "pt") as f:
            meta = f.metadata()
        assert meta["caption"] == rows[s["index"]]["text"] and meta["bucket"] == s["bucket"]
    empty = load_file(wan_cache / "empty_prompt.safetensors")
    ref = pipe.encode_prompt("", do_classifier_free_guidance=False, max_sequence_length=512)[0][0]
    torch.testing.assert_close(empty["prompt_embeds"], ref, rtol=1e-5, atol=1e-5)


def _cache_tensors(cache: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(p) for p in sorted((cache / "samples").iterdir())}


def test_interrupted_prepare_resumes_to_the_same_cache(media, wan, wan_cache, tmp_path):
    s = _settings("wan", wan, media[0], tmp_path / "c", buckets=[f"{F}x{H}x{W}", f"1x{H}x{W}"], max_bad_fraction=0.6)
    partial = prepare(s, stop_after=2, log=_quiet)
    assert partial["interrupted"] and partial["new"] == 2
    assert len(list((tmp_path / "c" / "samples").iterdir())) == 2 and not (tmp_path / "c" / "manifest.json").exists()
    with pytest.raises(FileNotFoundError, match="did not finish"):
        CachedLatentDataset(tmp_path / "c")
    m = prepare(s, log=_quiet)
    assert m["counts"]["reused"] == 2 and m["counts"]["new"] == 3
    resumed, full = _cache_tensors(tmp_path / "c"), _cache_tensors(wan_cache)
    assert resumed.keys() == full.keys()
    for name in full:
        for k in full[name]:
            assert torch.equal(resumed[name][k], full[name][k]), (name, k)
    assert m["samples"] == read_manifest(wan_cache)["samples"]
    # a resumed run with other settings is refused instead of mixing two caches
    with pytest.raises(PrepareError, match="other settings"):
        prepare(_settings("wan", wan, media[0], tmp_path / "c", {"fps": 8.0}), log=_quiet)


@pytest.mark.slow
def test_prepare_cli_on_two_processes_matches_one(tmp_path, wan):
    """`python -m train.prepare` on 2 gloo ranks (as torchrun starts them: the harness's warm ranks, env://
    rendezvous; items sharded by rank) = an in-process run."""
    make_media_set(tmp_path / "m", num_videos=3, frames=F, height=H, width=W, fps=FPS, metadata="csv")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{family: wan, pretrained_path: {wan}, dtype: float32}}\n"
        f"data: {{source: {tmp_path / 'm'}, height: {H}, width: {W}, num_frames: {F}, max_text_tokens: 16}}\n"
        "logging: {progress_bar: false}\n"
    )
    argv = ["-m", "train.prepare", "--recipe", str(recipe), "--set", f"data.cache_dir={tmp_path / 'c2'}"]
    rc, stdout, stderr = WARM.run(argv, 2, timeout=300)
    assert rc == 0, stderr[-3000:]
    assert "3 ok (3 new, 0 reused), 0 bad" in stdout and f"{F}x{H}x{W}: 3" in stdout
    assert read_manifest(tmp_path / "c2")["timing"]["processes"] == 2
    from train.config import load_recipe

    prepare(load_recipe(recipe, [f"data.cache_dir={tmp_path / 'c1'}"]), log=_quiet)
    one, two = _cache_tensors(tmp_path / "c1"), _cache_tensors(tmp_path / "c2")
    assert one.keys() == two.keys() and len(one) == 3
    assert all(torch.equal(one[f][k], two[f][k]) for f in one for k in one[f])
    assert CachedLatentDataset(tmp_path / "c2")[0]["prompt_embeds"].shape == (16, 16)


def test_datasets_source_with_video_bytes(tmp_path, wan):
    import datasets

    rows = make_media_set(tmp_path / "m", num_videos=2, frames=F, height=H, width=W, fps=FPS)
    cells = [{"bytes": (tmp_path / "m" / r["file_name"]).read_bytes(), "path": r["file_name"]} for r in rows]
    ds = datasets.Dataset.from_dict({"video": cells, "caption": [r["text"] for r in rows]})
    (tmp_path / "hf").mkdir()
    ds.cast_column("video", datasets.Video(decode=False)).to_parquet(tmp_path / "hf" / "train.parquet")
    listing = list_source(str(tmp_path / "hf"), caption_column="caption")
    assert len(listing) == 2 and isinstance(listing[0].media, dict) and listing[0].media["bytes"]
    m = prepare(_settings("wan", wan, tmp_path / "hf", tmp_path / "c", {"caption_column": "caption"}))
    assert m["counts"]["ok"] == 2 and m["samples"][1]["caption"] == rows[1]["text"]


# ------------------------------------------------------------------------------------------- dataset and sampler


def test_cached_dataset_items_collate_and_empty_prompt(wan_cache):
    ds = CachedLatentDataset(wan_cache)
    assert len(ds) == 5 and ds.family == "wan" and sorted(set(ds.buckets)) == [f"1x{H}x{W}", f"{F}x{H}x{W}"]
    item = ds[0]
    assert set(item) == {"latents", "prompt_embeds", "prompt_mask"} and item["prompt_mask"].dtype == torch.bool
    video = [i for i, b in enumerate(ds.buckets) if b.startswith(f"{F}x")]
    batch = collate([ds[i] for i in video[:2]])
    assert batch["latents"].shape == (2, 4, 3, 4, 6) and batch["prompt_embeds"].shape == (2, 512, 16)
    with pytest.raises(ValueError, match="mixed buckets"):
        collate([ds[video[0]], ds[ds.buckets.index(f"1x{H}x{W}")]])
    empty = ds.empty_prompt()
    assert (
        set(empty) == {"prompt_embeds", "prompt_mask"} and empty["prompt_embeds"].shape == item["prompt_embeds"].shape
    )


def test_resume_on_a_changed_cache_is_refused_by_size_and_noted_by_content(wan_cache, tmp_path):
    """A checkpoint records the cache's fingerprint (`Batches.state_dict`); resuming on a cache of another size is
    one line (the epoch's order cannot continue), on a re-captioned or re-encoded one of the same size a note, on a
    copy of the same cache elsewhere nothing."""
    import shutil

    from train.data.batches import Batches

    def batches(cache: Path) -> Batches:
        ds = CachedLatentDataset(cache)
        return Batches(ds, BucketBatchSampler(ds.buckets, 1, dp_rank=0, dp_size=1, seed=0), torch.device("cpu"))

    def variant(name: str, edit) -> Path:
        copy = tmp_path / name
        shutil.copytree(wan_cache, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        edit(manifest)
        (copy / "manifest.json").write_text(json.dumps(manifest))
        return copy

    saved = batches(wan_cache).state_dict()
    assert saved["cache"]["samples"] == 5
    assert batches(variant("moved", lambda m: None)).resume_notes(saved, 7) == []
    recaptioned = variant("recaptioned", lambda m: m["samples"][2].update(caption="a new caption"))
    (note,) = batches(recaptioned).resume_notes(saved, 7)
    assert note.startswith("data: the cache changed since step 7 (its captions, same sample count 5)"), note
    fewer = variant("fewer", lambda m: m.update(samples=m["samples"][:4]))
    with pytest.raises(UserError, match=r"step 7 trained on a cache of 5 samples .* now holds 4: its epoch order"):
        batches(fewer).resume_notes(saved, 7)


def test_collate_pads_text_of_unequal_length():
    a = {
        "latents": torch.zeros(2, 3),
        "prompt_embeds": torch.ones(3, 4),
        "prompt_mask": torch.ones(3, dtype=torch.bool),
    }
    b = {
        "latents": torch.zeros(2, 3),
        "prompt_embeds": torch.ones(5, 4),
        "prompt_mask": torch.ones(5, dtype=torch.bool),
    }
    batch = collate([a, b])
    assert batch["prompt_embeds"].shape == (2, 5, 4) and batch["prompt_mask"].tolist()[0] == [1, 1, 1, 0, 0]
    assert batch["prompt_embeds"][0, 3:].abs().sum() == 0


BUCKETS = ["a"] * 11 + ["b"] * 7 + ["c"] * 3


def _take(sampler: BucketBatchSampler, n: int) -> list[list[int]]:
    return list(itertools.islice(iter(sampler), n))


def test_sampler_cp_ranks_agree_dp_groups_differ_one_bucket_per_batch():
    dp_size, per_epoch = 3, None
    groups = []
    for dp_rank in range(dp_size):
        cp_peers = [BucketBatchSampler(BUCKETS, 2, dp_rank=dp_rank, dp_size=dp_size, seed=7) for _ in range(2)]
        per_epoch = len(cp_peers[0])
        seqs = [_take(s, 3 * per_epoch) for s in cp_peers]
        assert seqs[0] == seqs[1]  # the same batches on every rank of a CP group
        groups.append(seqs[0])
    assert per_epoch == (5 + 3 + 1) // dp_size
    for epoch in range(3):
        chunk = [g[epoch * per_epoch : (epoch + 1) * per_epoch] for g in groups]
        flat = [i for g in chunk for b in g for i in b]
        assert len(flat) == len(set(flat))  # DP groups see disjoint samples within an epoch
        for b in (b for g in chunk for b in g):
            assert len({BUCKETS[i] for i in b}) == 1 and len(b) == 2
    assert groups[0][:per_epoch] != groups[0][per_epoch : 2 * per_epoch]  # reshuffled each epoch


def test_sampler_resume_is_exact_and_survives_a_dp_size_change():
    s = BucketBatchSampler(BUCKETS, 2, dp_rank=1, dp_size=2, seed=3)
    it = iter(s)
    for _ in range(len(s) + 2):  # into the second epoch
        next(it)
    state = s.state_dict()
    expected = [next(it) for _ in range(2 * len(s))]
    r = BucketBatchSampler(BUCKETS, 2, dp_rank=1, dp_size=2, seed=3)
    r.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    assert _take(r, 2 * len(s)) == expected
    with pytest.raises(ValueError, match="batch_size"):
        BucketBatchSampler(BUCKETS, 3, dp_rank=1, dp_size=2, seed=3).load_state_dict(state)
    one = BucketBatchSampler(BUCKETS, 2, dp_rank=0, dp_size=1, seed=3)
    one.load_state_dict(state)  # 2 groups x 2 batches into epoch 1 = 4 batches of the 1-group order
    assert (one.epoch, one.index) == (1, 4)


def test_sampler_sizes_and_errors():
    unshuffled = BucketBatchSampler(["x"] * 5, 2, shuffle=False, drop_last=False)
    assert _take(unshuffled, 3) == [[0, 1], [2, 3], [4]]
    equal = [BucketBatchSampler(["x"] * 5, 2, dp_rank=r, dp_size=2, drop_last=False) for r in range(2)]
    assert len(equal[0]) == len(equal[1]) == 2  # 3 batches wrap to 4: no group waits for a missing batch
    with pytest.raises(UserError, match="fewer than the 4 data-parallel groups"):
        BucketBatchSampler(["x"] * 5, 2, dp_rank=0, dp_size=4)


def test_buckets_follow_the_aspect_ratio(tmp_path, wan):
    make_media_set(tmp_path / "m", num_videos=4, frames=F, height=H, width=W, fps=FPS, sizes=[(32, 48), (48, 32)])
    buckets = [f"{F}x32x48", f"{F}x48x32"]
    m = prepare(_settings("wan", wan, tmp_path / "m", tmp_path / "c", buckets=buckets), log=_quiet)
    assert [s["bucket"] for s in m["samples"]] == [buckets[0], buckets[1]] * 2
    ds = CachedLatentDataset(tmp_path / "c")
    for batch in _take(BucketBatchSampler(ds.buckets, 2, seed=0), 4):
        assert collate([ds[i] for i in batch])["latents"].shape[-2:] in ((4, 6), (6, 4))


# ---------------------------------------------------------------------------------------------- other families


def _direct(family: str, pipe, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The pipeline's own encoding of pixels x (3, F, H, W) with the posterior mean (latent_sample: mode)."""
    vae = pipe.vae
    if family == "ltx":
        z = vae.encode(x[None]).latent_dist.mode()
        return {"latents": pipe._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)}
    if family == "flux":
        z = vae.encode(x[None, :, 0]).latent_dist.mode()
        return {"latents": (z - vae.config.shift_factor) * vae.config.scaling_factor}
    if family == "flux2":
        return {"latents": pipe._encode_vae_image(x[None, :, 0], None)}
    if family == "qwenimage":
        z = vae.encode(x[None, :, :1]).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        return {"latents": (z - mean) / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)}
    if family == "chronoedit":
        z = vae.encode(x[None]).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        _, cond = pipe.prepare_latents(x[None, :, 0], 1, vae.config.z_dim, H, W, F, torch.float32, "cpu", None,
                                       torch.zeros(1))  # fmt: skip
        return {"latents": (z - mean) / std, "condition_latents": cond[:, pipe.vae_scale_factor_temporal :]}
    raise KeyError(family)


FAMILY_TEXT = {  # the pipeline's text call, its embeddings first
    "ltx": lambda p, c: p.encode_prompt(c, do_classifier_free_guidance=False, max_sequence_length=16)[0],
    "flux": lambda p, c: p.encode_prompt(c, prompt_2=None, max_sequence_length=16)[0],
    "flux2": lambda p, c: p.encode_prompt(c, max_sequence_length=16)[0],
    "qwenimage": lambda p, c: p.encode_prompt(c, max_sequence_length=16)[0],
    "chronoedit": lambda p, c: p.encode_prompt(c, do_classifier_free_guidance=False, max_sequence_length=512)[0],
}


@pytest.mark.parametrize("family", ["chronoedit", "ltx", "flux", "flux2", "qwenimage"])
def test_prepare_other_families(family, tmp_path_factory):
    import diffusers

    from train.models import get_family

    spec = get_family(family)
    path = build_tiny_pipeline(family, tmp_path_factory.mktemp("pipes") / family)
    root = tmp_path_factory.mktemp(f"media_{family}")
    video = spec.latent_kind == "video"
    frames = {"ltx": 9, "chronoedit": F}.get(family, 1)
    height, width = (32, 64) if family == "ltx" else (H, W)  # LTX: multiples of 32
    rows = make_media_set(root, num_videos=2, num_images=0 if video else 1, frames=F, height=height, width=width)
    data = {"num_frames": frames, "height": height, "width": width}
    if family != "chronoedit":
        data["max_text_tokens"] = 16
    cache = tmp_path_factory.mktemp("cache") / family
    m = prepare(_settings(family, path, root, cache, data, latent_sample="mode"), log=_quiet)
    assert m["counts"]["ok"] == len(rows) and m["family"] == family
    ds = CachedLatentDataset(cache)
    assert set(spec.batch_keys) <= set(ds[0]) and "prompt_mask" in ds[0]
    assert ("pooled_embeds" in ds[0]) == (family == "flux")
    pipe = getattr(diffusers, spec.pipeline_class).from_pretrained(path, transformer=None)
    for i, s in enumerate(m["samples"]):
        clip = load_clip(root / rows[s["index"]]["file_name"], Bucket(frames, height, width), FPS)
        x = clip.permute(1, 0, 2, 3).float() / 127.5 - 1
        with torch.no_grad():
            ref = _direct(family, pipe, x) if family != "chronoedit" else _direct_chrono(pipe, x, height, width)
            text = FAMILY_TEXT[family](pipe, s["caption"])[0]
        for k, v in ref.items():
            torch.testing.assert_close(ds[i][k], v[0], rtol=1e-5, atol=1e-6)
        n = text.shape[0]
        torch.testing.assert_close(ds[i]["prompt_embeds"][:n], text, rtol=1e-5, atol=1e-6)
    batch = collate([ds[i] for i in range(len(ds))])
    assert batch["latents"].shape[0] == len(ds)
    if family == "ltx":
        assert batch["frame_rate"].tolist() == [FPS] * len(ds)


def _direct_chrono(pipe, x, height, width):
    from PIL import Image

    out = _direct("chronoedit", pipe, x)
    first = Image.fromarray(((x[:, 0].permute(1, 2, 0) + 1) * 127.5).round().byte().numpy())
    out["image_embeds"] = pipe.encode_image(first, "cpu")
    return out


def test_prepare_minimax_h3_video_audio_and_text(tmp_path_factory):
    """MiniMax-H3: video latents, the soundtrack's audio latents and Qwen3-VL hidden_states[50] equal what the
    modular pipeline's own components, helpers and blocks compute; a clip without sound is a `no_audio` bad item."""
    from diffusers import MiniMaxH3ModularPipeline
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference
    from diffusers.modular_pipelines.minimax_h3.encoders import (
        MiniMaxH3Ref2VAReferenceEncoderStep,
        encode_vae_condition,
        get_qwen3vl_prompt_embeds,
    )
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames
    from transformers.utils import is_torchvision_available

    from train.models import get_family
    from train.models.minimax_h3.encoder import load_qwen3vl_processor_without_torchvision

    frames, height, width, fps = 22, 32, 64, 24.0  # 17 + 5 frames: two VAE chunks -> 7 latent frames
    path = build_tiny_pipeline("minimax_h3", tmp_path_factory.mktemp("pipes") / "minimax_h3")
    root = tmp_path_factory.mktemp("media_minimax")
    rows = make_media_set(root, num_videos=2, frames=frames, height=height, width=width, fps=fps, audio=True,
                          bad=["no_caption"], seed=5)  # fmt: skip
    write_video(root / "silent.mp4", render_clip("square", "red", "left", frames=frames, height=height, width=width))
    with open(root / "metadata.jsonl", "a") as f:
        f.write(json.dumps({"file_name": "silent.mp4", "text": "a red square moving left"}) + "\n")
    cache = tmp_path_factory.mktemp("cache") / "minimax_h3"
    data = {"num_frames": frames, "height": height, "width": width, "fps": fps, "max_bad_fraction": 0.5}
    m = prepare(_settings("minimax_h3", path, root, cache, data), log=_quiet)
    assert m["counts"]["ok"] == 2 and m["counts"]["bad_by_reason"] == {"no_audio": 1, "no_caption": 1}
    ds = CachedLatentDataset(cache)
    assert set(get_family("minimax_h3").batch_keys) <= set(ds[0]) and m["text"]["max_tokens"] is None
    # One text layout per batch: batches of 2 need equal caption lengths, and caption dropout is refused at startup
    # because the empty caption has no tokens at all.
    spec, lengths = get_family("minimax_h3"), set(ds.text_lengths())
    unpadded = CachedLatentDataset(cache, pad_text=False)
    assert ds.text_lengths() == [unpadded[i]["prompt_embeds"].shape[0] for i in range(len(ds))]
    recipe = lambda bs, p: SimpleNamespace(train=SimpleNamespace(batch_size=bs, caption_dropout=p))  # noqa: E731
    assert ds.empty_prompt_length() == 0 and 0 not in lengths
    check_text_lengths(ds, spec, recipe(1, 0.5))
    with pytest.raises(ValueError, match=r"different token lengths .*set train.batch_size: 1.*caption_dropout: 0"):
        check_text_lengths(ds, spec, recipe(2, 0.1))
    if len(lengths) > 1:
        with pytest.raises(ValueError, match="different token lengths"):
            check_text_lengths(ds, spec, recipe(2, 0.0))
    else:
        check_text_lengths(ds, spec, recipe(2, 0.0))

    pipe = MiniMaxH3ModularPipeline.from_pretrained(str(path), workflow="t2va")  # as the released repo loads
    pipe.load_components(names=["text_encoder", "vae", "audio_vae", "tokenizer"])
    processor = None if is_torchvision_available() else load_qwen3vl_processor_without_torchvision(str(path))
    pipe.load_components(names=["processor"]) if processor is None else pipe.update_components(processor=processor)
    vae, audio_vae, seed = pipe.vae, pipe.audio_vae, json.loads((cache / "prepare_config.json").read_text())["seed"]
    rate, hop = audio_vae.config.sampling_rate, audio_vae.hop_length
    num_latents = audio_latent_num_frames(frames, fps)  # 40 latents/s, the released rate
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    for i, s in enumerate(m["samples"]):
        item, src = ds[i], root / rows[s["index"]]["file_name"]
        assert item["latents"].shape == (24, 7, 2, 4) and item["audio_latents"].shape == (2, 32, num_latents)
        pixels = load_clip(src, Bucket(frames, height, width), fps).permute(1, 0, 2, 3)[None]  # uint8 (1, 3, F, H, W)
        with torch.no_grad():
            # the pipeline's own VAE encode recipe (ImageNet-normalised pixels, sampled posterior, normalised); it
            # rounds conditioning latents to float16, which a training target is not
            ref = encode_vae_condition(vae, pixels, pipe.pixel_mean, pipe.pixel_std, item_seed(seed, s["index"]))
            x = (pixels.float() / 255 - torch.tensor(pipe.pixel_mean).view(1, -1, 1, 1, 1)) / torch.tensor(
                pipe.pixel_std
            ).view(1, -1, 1, 1, 1)
            z = vae.encode(x).latent_dist.sample(torch.Generator().manual_seed(item_seed(seed, s["index"])))
            # the soundtrack through the pipeline's own reference-audio block (channel-major rows)
            wave = load_audio(src, num_latents * hop, rate, max_pad=rate // 24 + hop)
            state = PipelineState()
            state.set("normalized_references", [MiniMaxH3AudioReference(audio=wave, sample_rate=rate)])
            MiniMaxH3Ref2VAReferenceEncoderStep()(pipe, state)
            rows_ref = state.get("audio_condition_latents")[0]
            ids = pipe.tokenizer(s["caption"], add_special_tokens=False)["input_ids"]
            text = get_qwen3vl_prompt_embeds(pipe.text_encoder, pipe.processor, ids, text_encoder_layer=50)[0]
            full = pipe.text_encoder(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[50][0]
        torch.testing.assert_close(item["latents"], ((z - mean) / std)[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["latents"], ref[0], rtol=2e-3, atol=2e-3)
        audio_rows = item["audio_latents"].permute(0, 2, 1).reshape(-1, 32)  # (2, 32, N) -> channel-major rows
        torch.testing.assert_close(audio_rows, rows_ref, rtol=1e-5, atol=1e-5)
        n = len(ids)  # unpadded in the sample file (the dataset pads to the cache's longest caption)
        assert n == len(s["caption"].encode()) == load_file(cache / s["file"])["prompt_embeds"].shape[0]
        assert item["prompt_mask"][:n].all() and not item["prompt_mask"][n:].any()
        torch.testing.assert_close(item["prompt_embeds"][:n], text, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["prompt_embeds"][:n], full, rtol=1e-4, atol=1e-4)
    assert load_file(cache / "empty_prompt.safetensors")["prompt_embeds"].shape == (0, 16)  # "" has no token
    # data.max_text_tokens keeps the first rows of the same encoding (the Qwen3-VL stack is causal)
    cut = tmp_path_factory.mktemp("cache") / "minimax_h3_16"
    short = prepare(_settings("minimax_h3", path, root, cut, {**data, "max_text_tokens": 16}), log=_quiet)
    reach = [s["source"] for s in m["samples"] if len(s["caption"].encode()) >= 16]  # byte tokens: cut at 16
    assert reach and short["text"] == {"max_tokens": 16, "longest": 16, "at_limit": reach}, (short["text"], reach)
    assert m["text"]["at_limit"] == []  # no limit (max_text_tokens null): nothing cut
    first = load_file(cut / short["samples"][0]["file"])
    torch.testing.assert_close(first["prompt_embeds"], ds[0]["prompt_embeds"][:16], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first["audio_latents"], ds[0]["audio_latents"])


def test_a_cache_records_the_columns_its_conditioning_media_came_from(tmp_path) -> None:
    """Another reference or conditioning column is another cache: a resumed prepare that reads other columns is
    refused (the default reference column is not recorded, so caches from before still resume)."""
    from train.config import load_recipe
    from train.prepare import _check_fingerprint, fingerprint

    def recipe(family: str, *sets: str):
        return load_recipe(REPO / f"recipes/tiny/{family}.yaml", ["model.pretrained_path=p", "data.source=s",
                                                                  f"data.cache_dir={tmp_path}", *sets])  # fmt: skip

    animate = recipe("wan_animate")
    assert fingerprint(animate)["condition_columns"] == {"pose_video": "pose_video", "face_video": "face_video"}
    assert "reference_column" not in fingerprint(animate) and "condition_columns" not in fingerprint(recipe("wan"))
    (tmp_path / "prepare_config.json").write_text(json.dumps(fingerprint(animate)))
    _check_fingerprint(tmp_path, animate)  # the same settings resume
    for sets in (["data.condition_columns={pose_video: pose}"], ["data.reference_column=ref"]):
        with pytest.raises(PrepareError, match="other settings"):
            _check_fingerprint(tmp_path, recipe("wan_animate", *sets))
    vace = fingerprint(recipe("wan_vace", "data.reference_column=c"))
    (tmp_path / "prepare_config.json").write_text(json.dumps(vace))
    with pytest.raises(PrepareError, match="reference_column: cache has 'c', now None"):
        _check_fingerprint(tmp_path, recipe("wan_vace"))


def test_cached_files_are_readable_as_the_umask_says(wan_cache) -> None:
    """safetensors writes 0600 whatever the umask; the cache's sample files get what `open()` would give them."""
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    files = sorted(wan_cache.glob("**/*.safetensors"))
    assert files
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, (f, oct(f.stat().st_mode))
