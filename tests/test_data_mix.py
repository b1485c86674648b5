"""Several datasets in one run (data.datasets: weights, repeats, caption dropout each) and token-budget batches
(train.batch_tokens), from the sampler up to one trainer run.

Sampler-level checks count what an epoch holds against the arithmetic of the settings (no helper of the code under
test builds the expectation); dataset-level checks use two real caches that `train.prepare` writes with the tiny Wan
pipeline: `clips` (3 clips of 17 frames: 5 latent frames × 2 × 3 patches = 30 tokens; 2 images: 6 tokens) and
`stills` (4 images). The trainer run mixes them at CP 2 with a token budget, and resumes from step 2 exactly.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import json
import random
import shutil
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.harness import REPO, train
from train.config import RecipeError, check_inputs, load_recipe, recipe_from_dict, recipe_to_dict
from train.data.batches import bucket_tokens, build_dataset, check_text_lengths, make_batches
from train.data.dataset import BucketBatchSampler, CachedLatentDataset, MixedDataset, Share, carry, collate
from train.data.synthetic_media import make_media_set
from train.errors import UserError
from train.models import get_family
from train.prepare import prepare
from train.resume import plan_resume

TINY = "recipes/tiny/wan.yaml"
CLIP, IMAGE = "17x32x48", "1x32x48"
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------------------- sampler


def test_weights_and_repeats_give_each_dataset_its_share_carried_over_epochs() -> None:
    """A (6 samples, weight 2) and B (40, weight 1) share the 46 samples the weighted datasets hold: 46 × 2/3 = 30.67
    and 15.33 per epoch, so by the end of epoch e (e = 1, 2, 3) A has drawn 30.67 e rounded down or up and B the rest:
    (31, 15) or (30, 16), then (61, 31) or (62, 30), then exactly (92, 46); C (5 samples, repeats 3) adds 15 every
    epoch. Each dataset's draws are split over its buckets by size the same way (A: 4 x + 2 y: its x samples 2/3 of its
    draws). Within an epoch a dataset's samples of a bucket are drawn as evenly as can be (counts differ by at most 1),
    and B draws another part of itself each epoch. Counted from the batches."""
    buckets = ["x"] * 4 + ["y"] * 2 + ["x"] * 30 + ["y"] * 10 + ["x"] * 5
    shares = [Share(6, weight=2.0), Share(40, weight=1.0), Share(5, repeats=3)]
    s = BucketBatchSampler(buckets, 1, seed=4, shares=shares)
    # per epoch on average: x = 30.67 × 4/6 + 15.33 × 30/40 + 15 = 46.94, y = 30.67 × 2/6 + 15.33 × 10/40 = 14.06
    assert s.plan() == [30.67, 15.33, 15] and s.counts == {"x": 46.94, "y": 14.06}
    allowed = {1: {(31, 15), (30, 16)}, 2: {(61, 31), (62, 30)}, 3: {(92, 46)}}
    total = collections.Counter()
    seen_b = []
    for epoch in range(3):
        batches = s.epoch_batches(epoch)
        assert len(batches) == 46 + 15  # the same number of samples every epoch (batches of 1)
        counts = collections.Counter(i for b in batches for i in b)
        total.update(counts)
        a, b = sum(total[i] for i in range(6)), sum(total[i] for i in range(6, 46))
        assert (a, b) in allowed[epoch + 1], (epoch, a, b)
        a_x = sum(total[i] for i in range(4))  # A's x samples: 2/3 of A's draws so far, rounded down or up
        assert abs(a_x - a * 4 / 6) < 1, (epoch, a_x, a)
        for stratum in (range(4), range(4, 6), range(6, 36), range(36, 46)):
            assert max(counts[i] for i in stratum) - min(counts[i] for i in stratum) <= 1
        assert [counts[i] for i in range(46, 51)] == [3] * 5
        seen_b.append(frozenset(i for i in range(6, 46) if counts[i]))
    assert len(set(seen_b)) == 3  # another part of B each epoch


def test_carry_keeps_every_part_within_one_of_its_share_as_the_total_grows() -> None:
    """`carry` over 400 random mixtures (2-6 parts, weights from 0.01 up, totals growing by a fixed or a random step
    each epoch, as a dataset's draws split over its buckets grow): at every total the counts sum to it, none
    shrinks, and each is within 1 of total × weight / Σ weights (exact fractions here)."""
    rng = random.Random(0)
    for _ in range(400):
        weights = [rng.choice([0.01, 0.1, 0.5, 1.0, 3.0, rng.random() + 0.001]) for _ in range(rng.randint(2, 6))]
        p = [Fraction(w) / sum(Fraction(v) for v in weights) for w in weights]
        step, fixed = rng.randint(1, 40), rng.random() < 0.5
        counts, total = [0] * len(p), 0
        for _ in range(100):
            total += step if fixed else rng.randint(0, 2 * step)
            now = carry(p, counts, total)
            assert sum(now) == total and all(a >= b for a, b in zip(now, counts)), (weights, counts, now)
            assert all(abs(c - total * q) < 1 for c, q in zip(now, p)), (weights, total, now)
            counts = now


def _drawn_at_epoch_ends(sampler: BucketBatchSampler, epochs: int, ends: list[int]) -> list[list[int]]:
    """Per epoch (iterating the sampler, as the trainer does): the samples drawn so far of each dataset, whose
    indices end before `ends`."""
    out, drawn, it = [], [0] * len(ends), iter(sampler)
    for _ in range(epochs):
        for _ in range(sampler.batches_per_epoch(sampler.epoch)):
            for i in next(it):
                drawn[bisect.bisect_right(ends, i)] += 1
        out.append(list(drawn))
    return out


def test_a_small_weight_gets_its_share_over_a_run() -> None:
    """Weights 0.01 : 1 over 16 + 16 samples in batches of 2: the small dataset's exact share of an epoch's 32 samples
    is 32 × 0.01 / 1.01 = 0.32 of a sample. Rounded alike every epoch it never got one (0 of 80 after 40 steps); carried
    over epochs, by the end of every epoch e its draws are 0.32 e rounded down or up: 1 of every ~3 epochs, 95 or 96 of
    the 9600 samples of 300 epochs (0.99 %), the other dataset the rest; the 16 batches of each epoch stay 16."""
    s = BucketBatchSampler(["x"] * 32, 2, seed=3, shares=[Share(16, weight=0.01), Share(16, weight=1.0)])
    share = Fraction(32) * Fraction(0.01) / (Fraction(0.01) + Fraction(1.0))  # exact, per epoch
    drawn = _drawn_at_epoch_ends(s, 300, [16, 32])
    for e, (small, big) in enumerate(drawn, 1):
        assert abs(small - e * share) < 1 and small + big == 32 * e, (e, small, big)
    assert drawn[2][0] >= 0 and drawn[3][0] >= 1  # 0.95 by epoch 3, 1.27 by epoch 4: its first sample by then
    assert drawn[-1][0] in (95, 96) and s.batches_per_epoch(299) == 16


def test_weights_over_datasets_of_different_buckets_hold_at_every_epoch_end() -> None:
    """Three weighted datasets (0.05, 1 and 3 over 16, 12 and 8 samples in buckets x and y, some in both) and one
    repeated twice, batches of 1, 2 data-parallel groups: at the end of every one of 200 epochs each weighted dataset
    has drawn its exact share of the 36 weighted samples per epoch times the epochs, within one sample; the
    repeated one exactly 2 × 5 per epoch. The datasets' buckets differ, so an epoch's batches may differ from the
    next's; both groups get as many in every epoch."""
    buckets = ["x"] * 12 + ["y"] * 4 + ["y"] * 12 + ["x"] * 3 + ["y"] * 5 + ["x"] * 5
    weights = [0.05, 1.0, 3.0]
    shares = [Share(16, weight=weights[0]), Share(12, weight=weights[1]), Share(8, weight=weights[2]), Share(5, 2)]
    groups = [BucketBatchSampler(buckets, 1, r, 2, seed=5, shares=shares) for r in range(2)]
    exact = [Fraction(36) * Fraction(w) / sum(Fraction(v) for v in weights) for w in weights]
    drawn = [_drawn_at_epoch_ends(g, 200, [16, 28, 36, 41]) for g in groups]
    for e in range(200):
        assert groups[0].batches_per_epoch(e) == groups[1].batches_per_epoch(e)
        ours = [a + b for a, b in zip(drawn[0][e], drawn[1][e])]
        assert all(abs(ours[k] - (e + 1) * exact[k]) < 1 for k in range(3)), (e, ours)
        assert ours[3] == 10 * (e + 1)
        both = [i for g in groups for b in g.epoch_batches(e) for i in b]
        assert len(both) == 36 + 10  # the groups' batches together: all the epoch's samples
    # the small dataset's draws split over its buckets by size (12 x, 4 y): its y samples too, in time
    small = collections.Counter(buckets[i] for e in range(200) for g in groups for b in g.epoch_batches(e) for i in b
                                if i < 16)  # fmt: skip
    assert small["x"] + small["y"] in (int(200 * exact[0]), int(200 * exact[0]) + 1) and small["y"] >= 1


def test_a_carried_mixture_resumes_exactly_mid_run() -> None:
    """Weights 0.01 : 1 : 0.3 over datasets of different buckets, batches of 2, 2 data-parallel groups: the state
    saved mid-way through epoch 7 continues, in a new sampler, with the identical batches for 5 more epochs, and
    an epoch's batches are the same whether the sampler came there by iterating or was asked for it at once."""
    buckets = ["x"] * 10 + ["y"] * 6 + ["x"] * 16 + ["y"] * 9
    shares = [Share(16, weight=0.01), Share(16, weight=1.0), Share(9, weight=0.3)]

    def new() -> BucketBatchSampler:
        return BucketBatchSampler(buckets, 2, dp_rank=1, dp_size=2, seed=11, shares=shares)

    s = new()
    it = iter(s)
    while s.epoch < 7 or s.index < 3:
        next(it)
    state = json.loads(json.dumps(s.state_dict()))  # as a checkpoint stores it
    assert (state["epoch"], state["index"]) == (7, 3)
    expected = [next(it) for _ in range(sum(s.batches_per_epoch(e) for e in range(7, 12)) - 3)]
    r = new()
    r.load_state_dict(state)
    assert list(itertools.islice(iter(r), len(expected))) == expected
    assert new().epoch_batches(9) == s.epoch_batches(9)


def test_repeats_one_is_every_sample_once_per_epoch_across_dp_groups_and_cp_peers_agree() -> None:
    """Two datasets, repeats 1, 8 + 4 samples in two buckets, batches of 2 over 2 data-parallel groups: each epoch
    every sample once in all; the groups disjoint; two CP peers (same dp_rank) get the same batches."""
    buckets = ["a"] * 8 + ["b"] * 4
    shares = [Share(8), Share(4)]
    for epoch in range(3):
        groups = [BucketBatchSampler(buckets, 2, r, 2, seed=1, shares=shares).epoch_batches(epoch) for r in range(2)]
        flat = [i for g in groups for b in g for i in b]
        assert sorted(flat) == list(range(12))
        assert all(len({buckets[i] for i in b}) == 1 for g in groups for b in g)
    peers = [BucketBatchSampler(buckets, 2, 1, 2, seed=1, shares=shares) for _ in range(2)]
    assert list(itertools.islice(iter(peers[0]), 9)) == list(itertools.islice(iter(peers[1]), 9))
    # the whole job's micro-batch (what samples/<name> counts): both groups' batches at the position just handed out
    other = BucketBatchSampler(buckets, 2, 0, 2, seed=1, shares=shares)
    assert peers[0].job_batch() == list(itertools.islice(iter(other), 9))[-1] + peers[0].epoch_batches(2)[2]


def test_mixture_resumes_exactly_mid_epoch_and_refuses_another_mixture() -> None:
    buckets = ["x"] * 5 + ["y"] * 3 + ["x"] * 9
    shares = [Share(8, weight=3.0), Share(9, weight=1.0)]
    s = BucketBatchSampler(buckets, 2, dp_rank=0, dp_size=1, seed=9, shares=shares)
    it = iter(s)
    for _ in range(len(s) + 3):  # into the second epoch, mid-way
        next(it)
    state = json.loads(json.dumps(s.state_dict()))  # as a checkpoint stores it
    expected = [next(it) for _ in range(2 * len(s))]
    r = BucketBatchSampler(buckets, 2, dp_rank=0, dp_size=1, seed=9, shares=shares)
    r.load_state_dict(state)
    assert list(itertools.islice(iter(r), 2 * len(s))) == expected
    other = BucketBatchSampler(buckets, 2, seed=9, shares=[Share(8, weight=2.0), Share(9, weight=1.0)])
    with pytest.raises(ValueError, match="mixture: saved"):
        other.load_state_dict(state)


def test_exclude_keeps_held_out_indices_out_of_every_epoch() -> None:
    """Indices of the combined index space (here the second dataset's 9 and 12) are never drawn; the rest once."""
    buckets = ["x"] * 6 + ["y"] * 8
    held = frozenset({9, 12})
    s = BucketBatchSampler(buckets, 1, seed=2, shares=[Share(6), Share(8)], exclude=held)
    assert len(s) == 12
    for epoch in range(2):
        assert sorted(i for b in s.epoch_batches(epoch) for i in b) == sorted(set(range(14)) - held)


def test_per_bucket_batch_sizes_cut_each_bucket_and_split_over_dp() -> None:
    buckets = ["img"] * 13 + ["clip"] * 5
    s = [BucketBatchSampler(buckets, {"img": 4, "clip": 1}, r, 2, seed=0) for r in range(2)]
    assert len(s[0]) == len(s[1]) == (13 // 4 + 5) // 2  # 3 image batches + 5 clips = 8 -> 4 per group
    batches = [b for g in s for b in g.epoch_batches(0)]
    assert sorted(len(b) for b in batches) == [1] * 5 + [4] * 3
    assert all(len(b) == (4 if buckets[b[0]] == "img" else 1) for b in batches)
    assert len({i for b in batches for i in b}) == 17  # disjoint: one image left over (drop_last)


# -------------------------------------------------------------------------------------------------- recipe keys


def test_recipe_keys_and_their_one_line_errors() -> None:
    sets = ["data.synthetic=null", "data.datasets=[{cache_dir: /c/clips, weight: 2.0}, {cache_dir: /c/stills}]"]
    r = load_recipe(REPO / TINY, sets)
    assert r.data.dataset_names() == ["clips", "stills"] and r.data.cache_dirs() == ["/c/clips", "/c/stills"]
    with pytest.raises(UserError, match=r"^data.datasets and data.cache_dir are both set.*data.cache_dir=null"):
        check_inputs(load_recipe(REPO / TINY, [*sets, "data.cache_dir=/c/x"]), 2)
    with pytest.raises(RecipeError, match=r"train.batch_tokens: .* batch_size is 2: set train.batch_size: 1"):
        load_recipe(REPO / TINY, ["train.batch_tokens=64"])  # the recipe's batch_size is 2
    with pytest.raises(RecipeError) as e:
        load_recipe(REPO / TINY, ["data.datasets=[{cache_dir: /a/x, weight: 1.0, repeats: 2}, {cache_dir: /b/x, "
                                  "wieght: 1.0}]"])  # fmt: skip
    assert "data.datasets[0].weight: is set, and so is repeats (2)" in str(e.value)
    assert "data.datasets[1].wieght: unknown key (did you mean 'weight'?)" in str(e.value)
    with pytest.raises(RecipeError, match=r"data.datasets\[1\].name: 'x' is also data.datasets\[0\]'s name"):
        load_recipe(REPO / TINY, ["data.datasets=[{cache_dir: /a/x}, {cache_dir: /b/x}]"])


def test_resume_refuses_another_mixture_and_applies_a_new_caption_dropout() -> None:
    base = ["data.synthetic=null", "train.batch_size=1", "train.batch_tokens=64"]
    mix = "data.datasets=[{{cache_dir: /c/a, weight: {w}, caption_dropout: {p}}}, {{cache_dir: /c/b}}]"

    def recipe(w: float, p: float, *more: str) -> dict:
        return recipe_to_dict(load_recipe(REPO / TINY, [*base, mix.format(w=w, p=p), *more]))

    layout = {"dp_replicate": 1, "dp_shard": 1, "cp": 2}
    plan = lambda saved, new: plan_resume(saved, new, reset_lr_schedule=False, saved_layout=layout,  # noqa: E731
                                          layout=layout, checkpoint="ckpt")  # fmt: skip
    assert plan(recipe(2.0, 0.1), recipe(2.0, 0.3)).applied == ["data.datasets.0.caption_dropout: 0.1 -> 0.3"]
    for changed in (recipe(3.0, 0.1), recipe(2.0, 0.1, "train.batch_tokens=32")):
        with pytest.raises(UserError, match=r"data.datasets.0.weight: 2.0 -> 3.0|train.batch_tokens: 64 -> 32"):
            plan(recipe(2.0, 0.1), changed)


# ----------------------------------------------------------------------------------------------- real caches


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tiny_pipeline) -> dict[str, Path]:
    """`clips`: 3 clips of 17 frames and 2 images; `stills`: 4 images (another seed: other pictures)."""
    root, pipe = tmp_path_factory.mktemp("mix"), tiny_pipeline("wan")
    out = {}
    for name, videos, images, buckets, seed in (("clips", 3, 2, [CLIP, IMAGE], 1), ("stills", 0, 4, [IMAGE], 2)):
        make_media_set(root / f"{name}_media", num_videos=videos, num_images=images, frames=17, height=32, width=48,
                       fps=16.0, seed=seed)  # fmt: skip
        data = {"source": str(root / f"{name}_media"), "cache_dir": str(root / name), "buckets": buckets,
                "fps": 16.0, "max_text_tokens": 16}  # fmt: skip
        model = {"family": "wan", "pretrained_path": str(pipe), "dtype": "float32"}
        recipe = recipe_from_dict({"model": model, "data": data, "logging": {"progress_bar": False}})
        prepare(recipe, log=lambda _: None)
        out[name] = root / name
    return out


def _mix_recipe(caches: dict[str, Path], *more: str):
    mix = (f"data.datasets=[{{cache_dir: {caches['clips']}, weight: 2.0, caption_dropout: 0.0}}, "
           f"{{cache_dir: {caches['stills']}, repeats: 2, caption_dropout: 1.0}}]")  # fmt: skip
    return load_recipe(REPO / TINY, ["data.synthetic=null", "train.batch_size=1", mix, *more])


def test_a_missing_cache_names_its_entry(caches, tmp_path) -> None:
    recipe = _mix_recipe(caches, f"data.datasets=[{{cache_dir: {caches['clips']}}}, {{cache_dir: {tmp_path / 'no'}}}]")
    with pytest.raises(UserError, match=r"^data.datasets\[1\] \(no\): data.cache_dir .*/no does not exist"):
        build_dataset(recipe, get_family("wan"))


def test_mixed_batches_name_dataset_and_file_and_drop_captions_per_dataset(caches) -> None:
    """One image batch holding samples of both caches: `stills` (caption dropout 1.0) gets its own empty caption,
    `clips` (0.0) keeps its captions; each sample id names its dataset and file."""
    recipe = _mix_recipe(caches, "train.batch_tokens=60")  # images: 10 per batch (all 2 + 4 × 2 repeats); clips 2
    spec = get_family("wan")
    dataset = build_dataset(recipe, spec)
    assert isinstance(dataset, MixedDataset) and len(dataset) == 9 and dataset.names == ["clips", "stills"]
    batches = make_batches(dataset, recipe, 0, 1, CPU, tokens_of=bucket_tokens(dataset, spec, recipe.model.init_config))
    assert batches.sampler.batch_sizes == {CLIP: 2, IMAGE: 10}
    while True:
        batch, ids = batches.take(torch.Generator().manual_seed(0))
        if batch["latents"].shape[2] == 1:
            break
    indices = [int(i.split()[0][1:]) for i in ids]
    stills_empty = CachedLatentDataset(caches["stills"]).empty_prompt()["prompt_embeds"]
    for row, (i, sid) in enumerate(zip(indices, ids)):
        k, j = dataset.part_of(i)
        file = dataset.parts[k].cache_dir / dataset.parts[k].samples[j]["file"]
        assert sid == f"#{i} ({dataset.names[k]}: {file})" and file.is_file()
        want = stills_empty if k == 1 else dataset[i]["prompt_embeds"]
        assert torch.equal(batch["prompt_embeds"][row], want), (row, sid)
    assert sorted(dataset.part_of(i)[0] for i in indices) == [0, 0] + [1] * 8  # 2 clips images, stills twice


def test_token_budget_sizes_each_bucket_and_text_lengths_are_checked_per_bucket(caches, tmp_path) -> None:
    """Budget 18: a clip (5 × 2 × 3 = 30 tokens) is a batch of its own, images (1 × 2 × 3 = 6) come 3 at a time; the
    batches collate, and a family packing one text length per batch is refused only where a bucket batches several
    captions of different lengths."""
    spec = get_family("wan")
    recipe = load_recipe(REPO / TINY, ["data.synthetic=null", f"data.cache_dir={caches['clips']}",
                                       "train.batch_size=1", "train.batch_tokens=18"])  # fmt: skip
    dataset = build_dataset(recipe, spec)
    tokens_of = bucket_tokens(dataset, spec, recipe.model.init_config)
    assert (tokens_of(CLIP), tokens_of(IMAGE)) == (30, 6)
    groups = [make_batches(dataset, recipe, r, 2, CPU, tokens_of=tokens_of) for r in range(2)]
    assert groups[0].sampler.batch_sizes == {CLIP: 1, IMAGE: 3}
    assert groups[0].describe()["buckets"] == {
        CLIP: {"samples_per_epoch": 3, "batch_size": 1, "tokens_per_sample": 30},
        IMAGE: {"samples_per_epoch": 2, "batch_size": 3, "tokens_per_sample": 6},
    }
    # 3 clip batches, the 2 images short of a batch of 3 (dropped): 3 batches, 1 per group, the third dropped
    assert len(groups[0].sampler) == 1 and all(len(b) == 1 for g in groups for b in g.sampler.epoch_batches(0))
    assert collate([dataset[i] for i in groups[0].sampler.epoch_batches(0)[0]])["latents"].shape == (1, 4, 5, 4, 6)
    # text lengths: the images batch 3 captions, the clips one each
    packed = SimpleNamespace(name="packed", shared_text_length=True)
    manifest = json.loads((caches["clips"] / "manifest.json").read_text())
    for bucket, refused in ((CLIP, False), (IMAGE, True)):
        copy = tmp_path / bucket
        shutil.copytree(caches["clips"], copy)
        for n, sample in enumerate(x for x in manifest["samples"] if x["bucket"] == bucket):
            sample["text_len"] = 3 + n  # captions of different lengths in this bucket only
        (copy / "manifest.json").write_text(json.dumps(manifest))
        ds = CachedLatentDataset(copy)
        if refused:
            with pytest.raises(UserError, match=r"2 different token lengths .*no train.batch_tokens"):
                check_text_lengths(ds, packed, recipe, {CLIP: 1, IMAGE: 3})
        else:
            check_text_lengths(ds, packed, recipe, {CLIP: 1, IMAGE: 3})
        manifest = json.loads((caches["clips"] / "manifest.json").read_text())


def test_estimate_takes_the_budget_of_the_largest_bucket() -> None:
    """Tiny Wan's synthetic samples hold 35 tokens: a budget of 70 predicts the activations of batch 2, a budget
    below one sample those of batch 1 (that sample alone)."""
    from train.estimate import estimate

    def activations(*sets: str) -> float:
        e = estimate(load_recipe(REPO / TINY, list(sets)), 2, "cuda")
        return e.components["activations (blocks)"] + e.components["backward working set"]

    assert activations("train.batch_size=1", "train.batch_tokens=70") == activations("train.batch_size=2")
    assert activations("train.batch_size=1", "train.batch_tokens=20") == activations("train.batch_size=1")


def test_batches_resume_exactly_with_each_datasets_contribution(caches) -> None:
    """`Batches` of a mixture: its state after 3 micro-batches continues with the same samples, and the counts of
    each dataset's samples (the metrics' samples/<name>) go on from the saved ones."""
    recipe = _mix_recipe(caches, "train.batch_tokens=18")
    spec = get_family("wan")
    dataset = build_dataset(recipe, spec)
    tokens_of = bucket_tokens(dataset, spec, recipe.model.init_config)
    a = make_batches(dataset, recipe, 0, 1, CPU, tokens_of=tokens_of)
    taken = [a.take()[1] for _ in range(3)]
    state = json.loads(json.dumps(a.state_dict()))
    after = [(a.take()[1], a.contributions()) for _ in range(5)]
    b = make_batches(dataset, recipe, 0, 1, CPU, tokens_of=tokens_of)
    b.load_state_dict(state)
    assert [(b.take()[1], b.contributions()) for _ in range(5)] == after
    counted = collections.Counter(i.split(" (")[1].split(":")[0] for ids in taken for i in ids)
    assert state["drawn"] == {"clips": counted["clips"], "stills": counted["stills"]}


# ---------------------------------------------------------------------------------------------------- trainer


def test_two_datasets_at_cp2_report_each_contribution_and_resume_exactly(caches, tmp_path) -> None:
    """The trainer on the two caches (clips weight 2, stills repeats 2 with caption dropout 0.5), a budget of 18
    tokens, CP 2, 4 steps with a checkpoint after each: every metrics line's samples/<name> is what the sampler
    handed out until then (counted here from the sample indices), the report lists each bucket's batch size and each
    dataset's share; a copy resumed from step 2 logs steps 3-4 exactly as the uninterrupted run."""
    mix = (f"data.datasets=[{{cache_dir: {caches['clips']}, weight: 2.0}}, "
           f"{{cache_dir: {caches['stills']}, repeats: 2, caption_dropout: 0.5}}]")  # fmt: skip
    sets = ("data.synthetic=null", mix, "train.batch_size=1", "train.batch_tokens=18", "parallel.cp=2",
            "checkpoint.every_n_steps=1", "checkpoint.keep_last=3")  # fmt: skip
    run = train(tmp_path / "mix", TINY, *sets, nproc=2)
    lines = run.metrics
    assert [m["step"] for m in lines] == [1, 2, 3, 4]

    recipe = load_recipe(REPO / TINY, list(sets))
    spec = get_family("wan")
    dataset = build_dataset(recipe, spec)
    serial = make_batches(dataset, recipe, 0, 1, CPU, tokens_of=bucket_tokens(dataset, spec, recipe.model.init_config))
    drawn = collections.Counter()
    for line in lines:
        for i in serial.take()[1]:  # the whole job's micro-batch: one data-parallel group at CP 2
            drawn[dataset.names[dataset.part_of(int(i.split()[0][1:]))[0]]] += 1
        assert {k: v for k, v in line.items() if k.startswith("samples/")} == {
            "samples/clips": drawn["clips"], "samples/stills": drawn["stills"]}, line  # fmt: skip
    assert drawn["clips"] > 0 and drawn["stills"] > 0

    report = (run.out / "report.md").read_text()
    assert f"| bucket {IMAGE} | batch size 3, 6 tokens per sample;" in report
    assert f"| bucket {CLIP} | batch size 1, 30 tokens per sample;" in report
    for name, settings in (("clips", "weight 2, caption dropout 0"), ("stills", "repeats 2, caption dropout 0.5")):
        assert f"| dataset {name} | `{caches[name]}`: " in report and settings in report
        assert f"trained on {drawn[name]} by step 4" in report

    resumed_out = tmp_path / "resumed"
    shutil.copytree(run.out, resumed_out)
    for later in ("step_000003", "step_000004"):
        shutil.rmtree(resumed_out / "checkpoints" / later)
    resumed = train(resumed_out, TINY, *sets, nproc=2, resume=True)
    assert f"resumed from {resumed_out / 'checkpoints' / 'step_000002'} at step 2" in resumed.stdout
    timing = ("transformer_tokens_per_s", "step_time_s", "peak_mem_bytes")
    exact = lambda ms: [{k: v for k, v in m.items() if k not in timing} for m in ms]  # noqa: E731
    assert exact(resumed.metrics) == exact(lines)
