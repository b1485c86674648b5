"""Several datasets in one run (data.datasets: weights, repeats, caption dropout each) and token-budget batches
(train.batch_tokens), from the sampler up to one trainer run.

Sampler-level checks count what an epoch holds against the arithmetic of the settings (no helper of the code under
test builds the expectation); dataset-level checks use two real caches that `train.prepare` writes with the tiny Wan
pipeline: `clips` (3 clips of 17 frames: 5 latent frames × 2 × 3 patches = 30 tokens; 2 images: 6 tokens) and
`stills` (4 images). The trainer run mixes them at CP 2 with a token budget, and resumes from step 2 exactly.
"""

from __future__ import annotations

import collections
import itertools
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.harness import REPO, train
from train.config import RecipeError, check_inputs, load_recipe, recipe_from_dict, recipe_to_dict
from train.data.batches import bucket_tokens, build_dataset, check_text_lengths, make_batches
from train.data.dataset import BucketBatchSampler, CachedLatentDataset, MixedDataset, Share, collate
from train.data.synthetic_media import make_media_set
from train.errors import UserError
from train.models import get_family
from train.prepare import prepare
from train.resume import plan_resume

TINY = "recipes/tiny/wan.yaml"
CLIP, IMAGE = "17x32x48", "1x32x48"
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------------------- sampler


def test_weights_and_repeats_give_each_dataset_its_share_every_epoch() -> None:
    """A (6 samples, weight 2) and B (40, weight 1) share the 46 samples the weighted datasets hold: 46 × 2/3 = 30.67
    -> 31 and 15.33 -> 15 per epoch; C (5 samples, repeats 3) adds 15. Each dataset's quota is split over its
    buckets by size (A: 4 x + 2 y -> 20.67 : 10.33 -> 21 : 10; B: 30 x + 10 y -> 11.25 : 3.75 -> 11 : 4), so every
    epoch has as many samples of each bucket: A's x samples 5 times and one of them a 6th, A's y samples 5 times, 11
    + 4 different ones of B, C's 3 times each. Counted in each of 3 epochs."""
    buckets = ["x"] * 4 + ["y"] * 2 + ["x"] * 30 + ["y"] * 10 + ["x"] * 5
    shares = [Share(6, weight=2.0), Share(40, weight=1.0), Share(5, repeats=3)]
    s = BucketBatchSampler(buckets, 1, seed=4, shares=shares)
    assert s.plan() == [31, 15, 15] and s.counts == {"x": 21 + 11 + 15, "y": 10 + 4} and len(s) == 61
    seen_b = []
    for epoch in range(3):
        counts = collections.Counter(i for b in s.epoch_batches(epoch) for i in b)
        assert sorted(counts[i] for i in range(4)) == [5, 5, 5, 6] and [counts[4], counts[5]] == [5, 5]
        b_x, b_y = [i for i in range(6, 36) if counts[i]], [i for i in range(36, 46) if counts[i]]
        assert (len(b_x), len(b_y)) == (11, 4) and all(counts[i] == 1 for i in b_x + b_y)
        assert [counts[i] for i in range(46, 51)] == [3] * 5
        seen_b.append(frozenset(b_x + b_y))
    assert len(set(seen_b)) == 3  # another part of B each epoch


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
