"""Every discovered family end to end with its tiny pipeline, one trainer run each; and HunyuanVideo exact through
the trainer under every CP layout.

Per family: media → `train.prepare` (the family's own VAE / text encoders, tiny) → ONE trainer run under CP
(train/finetune.py's ranks, tests/harness.py `train`; LoRA, 2 steps, batch 2) from that cache, whose
(a) step-1 loss and grad_norm equal the serial oracle's (tests/harness.py `first_step`: the same recipe's first
    optimizer step in this process, with the trainer's own pieces and no CP / FSDP / launcher) within 1e-5 relative,
(b) step-2 loss differs from step 1's (the run went on),
(c) LoRA export reloads into the family's diffusers pipeline with the trained values and scale (`check_lora_reload`).
The runs are CP 2 (`LAUNCH`); CP 3, 4 and ring 2 × Ulysses 2 run through the trainer in the HunyuanVideo exact
test. Captions of different token lengths (so batches carry real padded text masks), caption dropout for
HunyuanVideo and MiniMax-H3 (checked: step 1 drops a caption and keeps one), MiniMax-H3 at batch 1 with 2
micro-batches (it packs one text length per batch). Wan 2.2 A14B trains its low-noise expert (`model.subfolder:
transformer_2`) and its LoRA reloads with `load_into_transformer_2=True`; its step-1 loss is transformer_2's, not what
the same step gives from `transformer`'s weights. HunyuanVideo's and HunyuanVideo 1.5's LoRA adapts the text
refiner's attention too.

HunyuanVideo exact (issue 19's headline): from its prepared cache (real captions of different lengths, the empty
caption at caption dropout 0.5), a full fine-tune at batch 2 for 2 steps (AdamW eps 1e-4: see `EXACT`), launched
serially and under CP 2, 3, 4 and ring 2 × Ulysses 2 (whose layout.json states the ring 2 × Ulysses 2 mesh and SUM
over the 4 CP ranks): per step the loss and grad_norm equal the serial run's, every exported transformer tensor the
serial export's (1e-5 relative each), and step 1's loss and grad_norm the fp64 serial oracle's (1e-5).

Clip sizes come from the family's own size rules (its encoder's `geometry`, read from the tiny pipeline's configs):
the smallest valid frame count from 5 up, sides of 32 x 48 (`SIDES` where that is too few tokens for the run's CP
degree) rounded up to the spatial multiple; families that denoise an audio stream get clips with a soundtrack, editing
families a reference image per item, families with named conditioning media (Wan Animate's pose and face videos) a
clip of each per item.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import REL_TOL, check_lora_reload, first_step
from train.config import recipe_from_dict
from train.data.synthetic_media import make_media_set
from train.models import family_names, get_encoder, get_family
from train.prepare import prepare

# Caption dropout draws from each step's generator (train.seed 1 here): at 0.5, step 1 of a batch of 2 drops one
# caption and keeps the other; at 0.3, MiniMax-H3's first micro-batch keeps its caption and its second drops it.
# `_check_dropout` asserts it, so a change of the draws fails loudly instead of testing less.
DROPOUT = "train.caption_dropout=0.5"
CP2 = (2, ("parallel.cp=2",))
# family -> (processes, overrides) of its one run; every other family: CP 2, the cheapest (a 4-rank run costs
# 2.5 × a 2-rank one on 2 cores). The trainer at CP 3, 4 and ring 2 × Ulysses 2 is the HunyuanVideo exact test's;
# every family at every layout, model level, is tests/test_cp_models.py's.
LAUNCH: dict[str, tuple[int, tuple[str, ...]]] = {
    "hunyuan_video": (2, ("parallel.cp=2", DROPOUT)),
    "minimax_h3": (2, ("parallel.cp=2", "train.batch_size=1", "train.grad_accum=2", "train.caption_dropout=0.3")),
    "wan22": (2, ("parallel.cp=2", "model.subfolder=transformer_2")),
    # issue 22's families: trainer-level CP 3 vs the one-process oracle (Chroma: padded text, the joint mask; Wan 2.2
    # I2V A14B: its high-noise expert, the default model.subfolder)
    "chroma": (3, ("parallel.cp=3",)),
    "wan22_i2v": (3, ("parallel.cp=3",)),
    # no text mask, one text length per batch: batch 1 × 2 micro-batches (as MiniMax-H3), at CP 3
    "kandinsky5": (3, ("parallel.cp=3", "train.batch_size=1", "train.grad_accum=2")),
    # its image-to-video variant: the clean first latent frame (no noise, no loss), at CP 3
    "kandinsky5_i2v": (3, ("parallel.cp=3", "train.batch_size=1", "train.grad_accum=2")),
    # Cosmos Predict 2.5: per-frame timestep, clean conditioning frames, its attn1 processor swap
    "cosmos": (3, ("parallel.cp=3",)),
    # Wan VACE: the control stream split beside the tokens (its hand plan), through the trainer at CP 3
    "wan_vace": (3, ("parallel.cp=3",)),
    # Z-Image: per-sample lists of latents and caption features, the model's unified sequence split at layers.0
    "zimage": (3, ("parallel.cp=3",)),
    # HunyuanImage 2.1: padded Qwen and ByT5 text packed by forward(), the joint key mask, its refiner replicated
    "hunyuanimage": (3, ("parallel.cp=3",)),
    # Qwen-Image 2.1: the block-causal joint [text | image] sequence (its CP processor), text trimmed per batch
    "qwenimage21": (3, ("parallel.cp=3",)),
    # Wan Animate: the reference frame, pose latents and the face video (motion encoder, face adapters per frame)
    "wan_animate": (3, ("parallel.cp=3",)),
    # Qwen-Image-Edit-Plus: the control image's tokens after the target's, zero_cond_t's modulate_index split with them
    "qwenimage_edit_plus": (3, ("parallel.cp=3",)),
    # Krea 2: the fixed-length text block padded in its middle, the joint key mask split like the keys, the text
    # fusion replicated and the output layer after the gather (replicated_tail)
    "krea2": (3, ("parallel.cp=3",)),
    # LTX-2: clips with a soundtrack, video and audio streams both split, at CP 3
    "ltx2": (3, ("parallel.cp=3",)),
}
# clip sides (before rounding up to the spatial multiple) where 32 x 48 gives fewer image tokens than the run's CP
# degree: HunyuanImage's x32 VAE makes 32 x 64 one latent row of 2 tokens; 64 x 96 gives 2 x 3
SIDES = {"hunyuanimage": (64, 96)}
# modules the LoRA must adapt besides the blocks: the text refiner's attention
ADAPTED = {"hunyuan_video": "transformer.context_embedder.", "hunyuan_video15": "transformer.context_embedder.",
           "hunyuanimage": "transformer.context_embedder."}  # fmt: skip
# HunyuanVideo exact. AdamW moves a weight by ~lr * g / (|g| + eps) per step: about lr * sign(g) while |g| >> eps,
# whatever |g|, so a weight whose gradient is near eps moves by an amount fp32 rounding of g decides. Measured at CP 2
# (losses and grad norms within 1e-7 of serial), the largest weight error, in the timestep embedder's linear_1 (an
# element whose gradient is 5e-7 in a tensor whose largest is 8e-3): 3.8e-5 with eps 1e-8 (the default), 8.3e-6 with
# 1e-6, 4e-7 with 1e-4. With eps 1e-4 the update is proportional to a gradient below 1e-4: rounding stays rounding.
EXACT = ("finetune.method=full", "checkpoint.export=full", DROPOUT, "train.eps=1e-4")
EXACT_LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {
    "serial": (1, ()),
    "CP 2": (2, ("parallel.cp=2",)),
    "CP 3": (3, ("parallel.cp=3",)),
    "CP 4": (4, ("parallel.cp=4",)),
    "ring 2 x Ulysses 2": (4, ("parallel.cp=4", "parallel.cp_ring=2")),
}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _vary_captions(media: Path) -> None:
    """Item 1's caption drops its background, item 2's shortens it ("... on a black background" -> "... on black"):
    every caption still says what its item shows, and their token lengths differ (padded text masks in each batch)."""
    path = media / "metadata.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["text"] = rows[1]["text"].split(" on a ")[0]
    rows[2]["text"] = rows[2]["text"].replace(" on a ", " on ").removesuffix(" background")
    assert len({len(r["text"].split()) for r in rows}) == len(rows) == 3, rows
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _prepare(family: str, pipeline: Path, root: Path) -> Path:
    """The family's tiny media set cached by `train.prepare`; returns the training recipe (LoRA, 2 steps, batch 2)."""
    spec, encoder = get_family(family), get_encoder(family)
    geometry = encoder.geometry(str(pipeline))
    video = spec.latent_kind == "video"
    frames = next(f for f in range(5, 100) if f % geometry.frame_period == geometry.frame_offset) if video else 1
    height, width = (_round_up(side, geometry.spatial_multiple) for side in SIDES.get(family, (32, 48)))
    sound = "audio_latents" in spec.streams  # MiniMax-H3, LTX-2: clips with a soundtrack
    fps = 24.0  # MiniMax-H3's fixed rate; any rate for the others
    media = root / "media"
    make_media_set(media, num_videos=3 if video else 1, num_images=0 if video else 2, frames=max(frames, 9),
                   height=height, width=width, fps=fps, audio=sound,
                   references=encoder.needs_reference, conditions=encoder.condition_media)  # fmt: skip
    _vary_captions(media)
    recipe = {
        "model": {"family": family, "pretrained_path": str(pipeline), "dtype": "float32"},
        "data": {"source": str(media), "cache_dir": str(root / "cache"), "height": height, "width": width,
                 "num_frames": frames, "fps": fps, "max_text_tokens": None if encoder.fixed_text_tokens else 16},
        "train": {"max_steps": 2, "batch_size": 2, "lr": 1e-3, "seed": 1, "mixed_precision": "no"},
        "finetune": {"method": "lora", "lora_rank": 4, "lora_alpha": 8.0},
        "checkpoint": {"export": "lora"},
    }  # fmt: skip
    manifest = prepare(recipe_from_dict(recipe), log=lambda _: None)
    assert manifest["counts"]["ok"] == 3 and manifest["counts"]["bad"] == 0, manifest["counts"]
    path = root / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def prepared(tiny_pipeline, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`prepared(family)`: the recipe of the family's prepared cache, built once per module."""
    root = tmp_path_factory.mktemp("prepared")
    return functools.cache(lambda family: _prepare(family, tiny_pipeline(family), root / family))


def _check_first_step(run_steps: list[dict], oracle: dict[str, float], what: str) -> None:
    for key in ("loss", "grad_norm"):
        rel = _rel(run_steps[0][key], oracle[key])
        print(f"\n{what}: step 1 {key} relative error vs the one-process oracle {rel:.2e}")
        assert rel <= REL_TOL, f"{what}: step 1 {key} {run_steps[0][key]} vs the oracle's {oracle[key]} ({rel:.2e})"


def _check_dropout(recipe: Path, overrides: tuple[str, ...], oracle: dict[str, float]) -> None:
    """With caption dropout, step 1 dropped some captions and kept others: the same draws (the same generator) with
    a probability that drops none, or all, give other losses."""
    if any(o.startswith("train.caption_dropout=") for o in overrides):
        for p in ("1e-12", "1"):
            other = first_step(recipe, *overrides, f"train.caption_dropout={p}")
            assert _rel(other["loss"], oracle["loss"]) > 10 * REL_TOL, (f"dropout {p} gives the same loss", oracle)


def _with_transformer_as_transformer_2(pipeline: Path, root: Path) -> Path:
    """A view of a Wan 2.2 A14B pipeline folder whose `transformer_2` is its `transformer` (symlinks, nothing
    copied)."""
    root.mkdir()
    for entry in pipeline.iterdir():
        (root / entry.name).symlink_to(pipeline / ("transformer" if entry.name == "transformer_2" else entry.name))
    return root


@pytest.mark.parametrize("family", family_names())
def test_family_prepares_trains_under_cp_and_its_lora_reloads(
    family: str, prepared, runs, tiny_pipeline, tmp_path: Path
) -> None:
    """One launch under the family's CP layout (`LAUNCH`): step 1 is the serial oracle's, step 2 another, and the
    LoRA export reloads into the family's pipeline (see the module docstring)."""
    recipe = prepared(family)
    nproc, overrides = LAUNCH.get(family, CP2)
    run = runs(recipe, *overrides, nproc=nproc)
    steps = run.metrics
    assert [m["step"] for m in steps] == [1, 2]
    oracle = first_step(recipe, *overrides)
    _check_first_step(steps, oracle, f"{family} {overrides}")
    assert steps[1]["loss"] != steps[0]["loss"], steps
    _check_dropout(recipe, overrides, oracle)

    if family == "wan22":
        # the low-noise expert: its LoRA goes into transformer_2, and the high-noise expert stays as it is
        pipe = check_lora_reload(family, tiny_pipeline(family), run.out / "lora", load_into_transformer_2=True)
        assert not any(".lora_" in n for n, _ in pipe.transformer.named_parameters())
        # the run started from transformer_2's weights: from transformer's, the same first step gives another loss
        other = _with_transformer_as_transformer_2(tiny_pipeline(family), tmp_path / "swapped")
        swapped = first_step(recipe, *overrides, f"model.pretrained_path={other}")
        assert _rel(swapped["loss"], steps[0]["loss"]) > 10 * REL_TOL, (swapped, steps[0])
    else:
        check_lora_reload(family, tiny_pipeline(family), run.out / "lora")
    if family in ADAPTED:
        exported = load_file(run.out / "lora" / "pytorch_lora_weights.safetensors")
        assert any(n.startswith(ADAPTED[family]) for n in exported), sorted(exported)[:5]


def _weights(run_out: Path) -> dict[str, torch.Tensor]:
    """The full export's tensors (every shard of `<output_dir>/transformer/`)."""
    files = sorted((run_out / "transformer").glob("*.safetensors"))
    assert files, run_out
    return {k: v for f in files for k, v in load_file(f).items()}


def test_hunyuan_video_full_finetune_is_exact_under_every_cp_layout(prepared, runs, tiny_pipeline) -> None:
    """The trainer's full fine-tune of HunyuanVideo from a real prepared cache (batch 2, padded text masks of
    different lengths, caption dropout 0.5) under CP 2, 3, 4 and ring 2 x Ulysses 2: per step the loss and grad_norm
    of the serial launch, every exported tensor the serial export's (1e-5 relative: max |cp - serial| / max |serial|);
    step 1's loss and grad_norm the fp64 serial oracle's."""
    recipe = prepared("hunyuan_video")
    exact = first_step(recipe, *EXACT, dtype=torch.float64)
    _check_dropout(recipe, EXACT, exact)
    launched = {name: runs(recipe, *EXACT, *overrides, nproc=n) for name, (n, overrides) in EXACT_LAYOUTS.items()}
    serial = launched["serial"]
    serial_steps, serial_weights = serial.metrics, _weights(serial.out)
    assert [m["step"] for m in serial_steps] == [1, 2]
    start = load_file(next((tiny_pipeline("hunyuan_video") / "transformer").glob("*.safetensors")))
    assert serial_weights.keys() == start.keys()
    assert any(not torch.equal(serial_weights[k], start[k]) for k in start)  # the full fine-tune moved weights

    layout = json.loads((launched["ring 2 x Ulysses 2"].out / "layout.json").read_text())
    assert "(ring 2 × ulysses 2)" in layout["mesh"] and "SUM over cp=4" in layout["gradient_reduction"], layout
    rows = []
    for name, run in launched.items():
        steps, weights = run.metrics, _weights(run.out)
        assert [m["step"] for m in steps] == [1, 2], (name, steps)
        assert weights.keys() == serial_weights.keys(), name
        worst = max(
            ((weights[k].double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30)).item()
            for k, w in serial_weights.items()
        )
        for a, b in zip(steps, serial_steps, strict=True):  # the export holds the weights after the last step
            rows.append((name, a["step"], _rel(a["loss"], b["loss"]), _rel(a["grad_norm"], b["grad_norm"]),
                         worst if a is steps[-1] else None))  # fmt: skip
        rows.append((f"{name} vs fp64 oracle", 1, _rel(steps[0]["loss"], exact["loss"]),
                     _rel(steps[0]["grad_norm"], exact["grad_norm"]), None))  # fmt: skip
    print("\nHunyuanVideo full fine-tune through the trainer vs the serial launch (and step 1 vs the fp64 oracle)")
    print(f"{'layout':<34} {'step':>4} {'loss rel err':>13} {'grad_norm rel err':>18} {'max weight rel err':>19}")
    for name, step, loss, norm, weight in rows:
        print(f"{name:<34} {step:>4} {loss:13.2e} {norm:18.2e} {'' if weight is None else f'{weight:.2e}':>19}")
    failures = [r for r in rows if max(r[2], r[3], r[4] or 0.0) > REL_TOL]
    assert not failures, failures
