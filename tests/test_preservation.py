"""Output-preserving regularisation in the one training step (train/step.py): differential output preservation
(`train.preservation`) and a mixture's per-dataset loss weight (`data.datasets[].loss_weight`, prior preservation).

The reference is built here from the plain diffusers transformer and nothing of the code under test: the step's
pipeline-form kwargs (the serial oracle's, train/tools/oracle.py) with Wan's `encoder_hidden_states` swapped for the
preservation prompt's embeddings, the base's prediction under diffusers' own `disable_adapters()` (peft), the
flow-matching and preservation terms written out by hand. The tiny Wan model (7 heads, 35 video tokens: CP 2 divides
neither) runs it serially and under CP 2; a prepared cache and one CP 2 trainer run check the prepare → trainer path,
the metrics and the report.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.harness import REPO, first_step, rank_job, train
from train.config import FinetuneConfig, RecipeError, load_recipe, recipe_from_dict
from train.data.dataset import PRESERVATION, SAMPLE_WEIGHT, CachedLatentDataset
from train.data.synthetic_media import render_clip, write_image
from train.errors import UserError
from train.models import get_family
from train.step import Objective, check_preservation, micro_batch_loss
from train.step import prepare as step_inputs

TINY = "recipes/tiny/wan.yaml"
WEIGHT = 0.7  # the DOP weight the CP case runs with
SAMPLE_WEIGHTS = (1.0, 0.4)  # the two samples' dataset loss weights (a subject and a class sample)


def _lora_model(b_std: float):
    """The tiny Wan transformer with a rank-4 LoRA on the family's targets, seeded: A drawn from N(0, 0.3²), B from
    N(0, b_std²) (0: peft's zero start)."""
    from train.modeling import apply_finetune
    from train.tools.tiny_models import build_model

    model = build_model("wan", seed=0)
    apply_finetune(model, FinetuneConfig(lora_rank=4, lora_alpha=8.0), get_family("wan"), "fp32")
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:  # (peft draws A from the global RNG)
                p.copy_(torch.randn(p.shape, generator=gen) * (b_std if ".lora_B." in name else 0.3))
    return model


def _batch() -> dict[str, torch.Tensor]:
    """Two synthetic samples; their preservation prompt: another seed's text; each its dataset's loss weight."""
    from train.tools.probe import family_batch

    batch = dict(family_batch("wan", 1, torch.float32, 2))
    batch[PRESERVATION + "prompt_embeds"] = family_batch("wan", 2, torch.float32, 2)["prompt_embeds"]
    batch[SAMPLE_WEIGHT] = torch.tensor(SAMPLE_WEIGHTS)
    return batch


def _reference(model, batch: dict, weight: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, preservation term) by hand: the plain model on the step's pipeline-form kwargs; per sample the mean
    squared error against noise - x0 times its loss weight, the batch mean; plus `weight` × the mean squared error
    of the adapted prediction on the preservation prompt against the base's (diffusers' disable_adapters)."""
    inputs = step_inputs(get_family("wan"), batch, Objective(), torch.Generator().manual_seed(seed),
                         model_config=model.config)  # fmt: skip
    pred = model(**inputs.kwargs, return_dict=False)[0]
    target = inputs.noise["latents"] - inputs.x0["latents"]
    main = (((pred - target) ** 2).flatten(1).mean(1) * batch[SAMPLE_WEIGHT]).mean()
    kwargs = {**inputs.kwargs, "encoder_hidden_states": batch[PRESERVATION + "prompt_embeds"]}
    with torch.no_grad():
        model.disable_adapters()
        base = model(**kwargs, return_dict=False)[0]
        model.enable_adapters()
    term = ((model(**kwargs, return_dict=False)[0] - base) ** 2).mean()
    return main + weight * term, term


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _rel(a: dict, b: dict) -> float:
    return max(float((a[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in b.items())


def _cp_preservation(rank: int, world: int) -> dict:
    """The step with DOP and dataset weights: the hand reference, the step serially and under CP (every gradient
    SUM-reduced over the group); the term's weight at 0, 1 and 2 under CP; the zero-start adapter."""
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import GradReduction, enable_context_parallel

    spec, batch, seed = get_family("wan"), _batch(), 3
    ref_model = _lora_model(0.3)
    ref_loss, ref_term = _reference(ref_model, batch, WEIGHT, seed)
    ref_loss.backward()
    ref = _grads(ref_model)

    serial = _lora_model(0.3)
    parts: dict[str, torch.Tensor] = {}
    serial_loss = micro_batch_loss(serial, spec, batch, Objective(preservation=WEIGHT),
                                   torch.Generator().manual_seed(seed), None, parts)  # fmt: skip
    serial_loss.backward()
    serial_grads, serial_term = _grads(serial), parts["preservation_loss"]

    def cp_step(model, weight: float) -> tuple[float, float, dict]:
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
        state = enable_context_parallel(model, mesh=mesh)
        model.zero_grad(set_to_none=True)
        got: dict[str, torch.Tensor] = {}
        loss = micro_batch_loss(model, spec, batch, Objective(preservation=weight),
                                torch.Generator().manual_seed(seed), None, got)  # fmt: skip
        loss.backward()
        GradReduction("allreduce", cp_group=state.cp_group).reduce_gradients(model.parameters())
        return loss.item(), float(got.get("preservation_loss", torch.tensor(0.0))), _grads(model)

    cp_loss, cp_term, cp_grads = cp_step(_lora_model(0.3), WEIGHT)
    scaled = {w: cp_step(_lora_model(0.3), w) for w in (0.0, 1.0, 2.0)}
    zero_loss, zero_term, _ = cp_step(_lora_model(0.0), WEIGHT)
    plain_loss, _, _ = cp_step(_lora_model(0.0), 0.0)
    second = {n: scaled[2.0][2][n] - 2 * scaled[1.0][2][n] + scaled[0.0][2][n] for n in ref}  # linear in the weight
    return {
        "ref_term": ref_term.item(),
        "serial": {"loss": abs(serial_loss.item() - ref_loss.item()) / ref_loss.item(),
                   "term": abs(serial_term.item() - ref_term.item()) / ref_term.item(),
                   "grad": _rel(serial_grads, ref)},
        "cp": {"loss": abs(cp_loss - ref_loss.item()) / ref_loss.item(),
               "term": abs(cp_term - ref_term.item()) / ref_term.item(), "grad": _rel(cp_grads, ref)},
        "scaled": {w: (loss, term) for w, (loss, term, _) in scaled.items()},
        "second_difference": max(float(d.abs().max()) for d in second.values()),
        "grad_scale": max(float(g.abs().max()) for g in ref.values()),
        "zero": {"term": zero_term, "loss": zero_loss, "plain_loss": plain_loss},
    }  # fmt: skip


rank_job(2)(_cp_preservation)


def test_cp2_step_with_preservation_equals_the_hand_reference(group) -> None:
    """Loss, DOP term and every LoRA gradient of the serial step and of CP 2 against the hand reference (float32:
    loss and term rel 1e-6, gradients rel 2e-5, as tests/test_loss_mask.py's CP case); about 4 s of the group."""
    for r in group(_cp_preservation, 2):
        assert r["ref_term"] > 1e-3, r  # live: B != 0 moves the adapted prediction off the base's
        for side in ("serial", "cp"):
            assert r[side]["loss"] < 1e-6 and r[side]["term"] < 1e-6 and r[side]["grad"] < 2e-5, (side, r)


def test_the_weight_scales_the_term_and_a_zero_adapter_preserves_exactly(group) -> None:
    """Under CP 2: loss(w) = loss(0) + w × term for w = 1, 2 (rel 1e-6), the gradients linear in w (their second
    difference below 1e-5 of the largest gradient); with B = 0 (peft's start) the term is exactly 0 and the loss the
    plain step's bit for bit."""
    for r in group(_cp_preservation, 2):
        s = r["scaled"]
        term = s[1.0][1]
        assert term > 1e-3 and s[2.0][1] == pytest.approx(term, rel=1e-6), s
        for w in (1.0, 2.0):
            assert s[w][0] == pytest.approx(s[0.0][0] + w * term, rel=1e-6), (w, s)
        assert r["second_difference"] < 1e-5 * r["grad_scale"], r
        assert r["zero"]["term"] == 0.0 and r["zero"]["loss"] == r["zero"]["plain_loss"], r["zero"]


# ------------------------------------------------------------------------------------------- recipe and prepare


def test_recipe_keys_and_their_one_line_errors() -> None:
    pres = "train.preservation={trigger: sks, class_word: dog, weight: 0.5}"
    r = load_recipe(REPO / TINY, [pres])
    assert (r.train.preservation.trigger, r.train.preservation.class_word, r.train.preservation.weight) == (
        "sks", "dog", 0.5)  # fmt: skip
    assert Objective.of(r, get_family("wan")).preservation == 0.5
    assert Objective.of(load_recipe(REPO / TINY), get_family("wan")).preservation == 0.0
    with pytest.raises(RecipeError, match=r"train.preservation: keeps the base model's output .* method: lora"):
        load_recipe(REPO / TINY, [pres, "finetune.method=full"])
    with pytest.raises(RecipeError, match=r"train.preservation.class_word"):
        load_recipe(REPO / TINY, ["train.preservation={trigger: sks}"])
    with pytest.raises(RecipeError, match=r"data.datasets\[0\].loss_weight: must be > 0"):
        load_recipe(REPO / TINY, ["data.datasets=[{cache_dir: x, loss_weight: 0}]"])
    with pytest.raises(UserError, match=r"synthetic data has none"):  # the tiny recipe's synthetic data
        check_preservation(object(), r)
    unmasked = dataclasses.replace(get_family("wan"), shared_text_length=True)  # as Kandinsky 5's, MiniMax-H3's
    with pytest.raises(UserError, match=r"packs one text layout per batch .* train.batch_size: 1"):
        check_preservation(object(), r, unmasked)  # the tiny recipe's batch_size 2


CAPTIONS = ("a photo of sks", "a photo of square", "sks and sks, a photo")


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tiny_pipeline) -> dict[str, Path]:
    """`subject` (3 images, captions with the trigger) and `klass` (2 images of the class), both prepared with
    train.preservation (trigger sks, class word square) by the tiny Wan pipeline."""
    root, out = tmp_path_factory.mktemp("preservation"), {}
    for name, captions, color in (("subject", CAPTIONS, "red"), ("klass", ("a square", "a photo of square"), "blue")):
        media = root / f"{name}_media"
        media.mkdir()
        rows = []
        for i, caption in enumerate(captions):
            write_image(media / f"{i}.png", render_clip("square", color, None, frames=1, height=32, width=48)[0])
            rows.append({"file_name": f"{i}.png", "text": caption})
        (media / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        recipe = recipe_from_dict({
            "model": {"family": "wan", "pretrained_path": str(tiny_pipeline("wan")), "dtype": "float32"},
            "data": {"source": str(media), "cache_dir": str(root / name), "height": 32, "width": 48,
                     "max_text_tokens": 16},
            "train": {"preservation": {"trigger": "sks", "class_word": "square"}},
            "logging": {"progress_bar": False},
        })  # fmt: skip
        from train.prepare import prepare

        prepare(recipe, log=lambda _: None)
        out[name] = root / name
    return out


def test_prepare_caches_each_samples_preservation_prompt(caches) -> None:
    """Item 0's preservation prompt is item 1's caption ("a photo of square"): its cached preservation text equals
    item 1's caption text bit for bit (the caption path the family tests check against WanPipeline.encode_prompt);
    every trigger is replaced (item 2); the manifest records how the prompts were made."""
    from safetensors import safe_open

    ds = CachedLatentDataset(caches["subject"])
    items = [ds[i] for i in range(3)]
    for key in ("prompt_embeds", "prompt_mask"):
        assert torch.equal(items[0][PRESERVATION + key], items[1][key]), key
        assert torch.equal(items[1][PRESERVATION + key], items[1][key]), key  # no trigger: its own caption
    assert not torch.equal(items[2][PRESERVATION + "prompt_embeds"], items[2]["prompt_embeds"])
    with safe_open(caches["subject"] / ds.samples[2]["file"], "pt") as f:
        assert f.metadata()["preservation_caption"] == "square and square, a photo"
    assert ds.manifest["settings"]["preservation"] == {"trigger": "sks", "class_word": "square"}
    other = load_recipe(REPO / TINY, ["train.preservation={trigger: sks, class_word: dog}"])
    with pytest.raises(UserError, match=r"made with .*'class_word': 'square'.* says .*'dog'"):
        check_preservation(ds, other)


def test_a_cache_without_preservation_prompts_is_refused(tmp_path, tiny_pipeline) -> None:
    from train.data.synthetic_media import make_media_set
    from train.prepare import prepare

    make_media_set(tmp_path / "media", num_videos=0, num_images=1, frames=1, height=32, width=48, seed=3)
    recipe = recipe_from_dict({
        "model": {"family": "wan", "pretrained_path": str(tiny_pipeline("wan")), "dtype": "float32"},
        "data": {"source": str(tmp_path / "media"), "cache_dir": str(tmp_path / "plain"), "height": 32, "width": 48},
        "logging": {"progress_bar": False}})  # fmt: skip
    prepare(recipe, log=lambda _: None)
    r = load_recipe(REPO / TINY, ["train.preservation={trigger: sks, class_word: dog}"])
    with pytest.raises(UserError, match=r"holds no preservation prompts .* run python -m train.prepare"):
        check_preservation(CachedLatentDataset(tmp_path / "plain"), r)


# ---------------------------------------------------------------------------------------------------- trainer


@pytest.mark.slow
def test_trainer_at_cp2_with_both_preservations(caches, tmp_path) -> None:
    """The trainer at CP 2 (FSDP2 over the 2 ranks) on the subject cache mixed with the class cache at loss weight
    0.5, DOP weight 0.5, 2 steps, from someone else's LoRA (a musubi file: B != 0, so the term and its gradients are
    live at step 1): step 1's loss and gradient norm equal the serial first step (the trainer's own pieces without
    CP, FSDP or launcher; rel 1e-5); the term is in metrics.jsonl and the report (chart and rows); the class
    samples' weight is live (the first batch holds one: the serial step without it differs). About 20 s."""
    from tests.harness import musubi_wan_lora
    from train.tools.tiny_models import build_model

    raw = yaml.safe_load((REPO / TINY).read_text())
    raw["finetune"] = {"method": "lora"}  # init_lora brings its rank and alpha
    recipe = tmp_path / "wan_dop.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    lora = musubi_wan_lora(tmp_path / "init.safetensors", build_model("wan"), 4, 4.0)
    mix = (f"data.datasets=[{{cache_dir: {caches['subject']}, name: subject}}, "
           f"{{cache_dir: {caches['klass']}, name: klass, loss_weight: 0.5}}]")  # fmt: skip
    sets = ("data.synthetic=null", mix, "train.batch_size=2", "train.max_steps=2", f"finetune.init_lora={lora}",
            "train.preservation={trigger: sks, class_word: square, weight: 0.5}", "parallel.cp=2")  # fmt: skip
    run = train(tmp_path / "run", recipe, *sets, nproc=2)
    lines = run.metrics
    assert [m["step"] for m in lines] == [1, 2]
    serial = first_step(recipe, *sets)
    assert lines[0]["loss"] == pytest.approx(serial["loss"], rel=1e-5), (lines[0], serial)
    assert lines[0]["grad_norm"] == pytest.approx(serial["grad_norm"], rel=1e-5), (lines[0], serial)
    assert all(m["preservation_loss"] > 1e-4 for m in lines), lines
    unweighted = first_step(recipe, sets[0], mix.replace(", loss_weight: 0.5", ""), *sets[2:])
    assert unweighted["loss"] != pytest.approx(serial["loss"], rel=1e-3)
    # the report the run wrote at its end (an init_lora run's saved recipe.yaml reads back)
    report = (run.out / "report.md").read_text()
    assert (run.out / "report" / "preservation_loss.png").is_file()
    assert "differential output preservation: 'sks' → 'square', weight 0.5" in report
    assert "preservation term (step 1 → 2, weight 0.5)" in report and "loss weight 0.5" in report


def _saved_bytes(weight: float) -> int:
    """Bytes of the distinct storages the step's graph saves for backward (parameters excluded), with the DOP term at
    `weight` (0: the plain step)."""
    model, batch = _lora_model(0.3), _batch()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = micro_batch_loss(model, get_family("wan"), batch, Objective(preservation=weight),
                                torch.Generator().manual_seed(3))  # fmt: skip
    loss.backward()
    return sum(seen.values())


def test_estimate_counts_the_preservation_forwards() -> None:
    """What train.estimate adds is what the step holds: the DOP step saves 2.0x the plain step's activations
    (measured on the tiny model: the base's forward saves nothing, within 5%), and the estimate adds one more copy of
    the blocks' and outside activations, 2 x the all-to-all passes + 1, and (2 x 3 + 1) / 3 the compute (no
    checkpointing: forward 1 + backward 2 a pass). Under 2 s."""
    from train.estimate import estimate

    ratio = _saved_bytes(WEIGHT) / _saved_bytes(0.0)
    assert 1.95 < ratio < 2.05, ratio
    plain = estimate(load_recipe(REPO / TINY), 2, "cuda")
    dop = estimate(load_recipe(REPO / TINY, ["train.preservation={trigger: sks, class_word: dog}"]), 2, "cuda")
    c = plain.components
    assert dop.components["activations (preservation forward)"] == pytest.approx(
        c["activations (blocks)"] + c["activations (outside blocks)"], rel=1e-12)  # fmt: skip
    assert dop.all_to_all == pytest.approx(plain.all_to_all * 5 / 2, rel=1e-12)
    assert dop.compute == pytest.approx(7 / 3) and plain.compute == 1.0
    assert dop.peak > plain.peak and "compute (train.preservation)" in dop.table(80.0)
