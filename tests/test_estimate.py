"""train.estimate: calibration files present and current for every family; predicted vs MEASURED peak per rank on
CPU for a mid-size Wan within ±15%, at CP 1/2/4 × LoRA/full × checkpointing off/on (6 of the 12 combinations: every
CP degree with both methods and both checkpointing settings, every method × checkpointing pair); the CLI and the
startup check.

Measured = the peak of live tensor storage bytes (`LiveBytes`) over the real trainer's model build (sharded start from
a pretrained folder) and one training step, per rank, in one 4-rank gloo spawn that builds a mesh per CP degree (the
FSDP group is always dp_shard × cp = 4 ranks, so parameter shards are equal and activations shrink with cp). The
measurement is deterministic (the same bytes on every run), so the 6 cases lose no precision; the other 6 measured
within the tolerance too when the grid was cut to these (largest: cp 4 full, no checkpointing, kept: +12.6%).
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.harness import spawn
from train import estimate as est
from train.config import recipe_from_dict
from train.models import family_names

# Wan2.1's head dim and ffn ratio at 2 heads, 3 blocks (the calibration instance has other depth and text width):
# 1,024 video tokens (4 × 16 × 16 after the 1×2×2 patch) + 64 text tokens per sample.
MID_CONFIG = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 128, "in_channels": 16,
              "out_channels": 16, "text_dim": 384, "freq_dim": 256, "ffn_dim": 1536, "num_layers": 3,
              "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
              "rope_max_seq_len": 1024}  # fmt: skip
SHAPES = {"latents": [16, 4, 32, 32], "prompt_embeds": [64, 384]}
# A covering set of (cp, method, gradient checkpointing): each pair of the three factors meets in all its level
# combinations; it keeps the two largest errors of the full grid (cp 2 and cp 4 full, no checkpointing).
CASES = [(1, "lora", False), (1, "full", True), (2, "lora", True), (2, "full", False), (4, "lora", True),
         (4, "full", False)]  # fmt: skip
WORLD = 4
TOLERANCE = 0.15


def mid_recipe(folder: str, cp: int, method: str, ckpt: bool) -> dict:
    return {
        "model": {"family": "wan", "pretrained_path": folder, "dtype": "float32"},
        "parallel": {"cp": cp, "dp_shard": -1, "memory_check": "off"},
        "train": {"max_steps": 1, "batch_size": 1, "gradient_checkpointing": ckpt, "mixed_precision": "no",
                  "seed": 0},
        "finetune": {"method": method, "lora_rank": 16},
        "data": {"synthetic": {"num_samples": 8, "shapes": SHAPES}, "shuffle": False},
        "logging": {"wandb_mode": "disabled", "progress_bar": False},
    }  # fmt: skip


def write_mid_folder(path) -> str:
    import diffusers

    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel.from_config(MID_CONFIG)
    model.save_pretrained(path / "transformer")
    return str(path)


def _measure_all(rank: int, world: int, folder: str) -> list[int]:
    """Peak live bytes of build + one step per case, on this rank."""
    import warnings

    from train.data.batches import build_dataset, make_batches
    from train.finetune import Trainer, build_optimizer, train_step
    from train.modeling import build_model, family_spec
    from train.parallel import ParallelDims
    from train.step import Objective

    warnings.filterwarnings("ignore")
    device, peaks = torch.device("cpu"), []
    gc.collect()
    gc.freeze()  # the imports' objects: each `gc.collect` below then scans only what the cases made (~1 s less each)
    for cp, method, ckpt in CASES:
        recipe = recipe_from_dict(mid_recipe(folder, cp, method, ckpt))
        mesh = ParallelDims(*recipe.parallel.resolve(world)).build("cpu")
        spec = family_spec(recipe.model)
        batches = make_batches(build_dataset(recipe, spec), recipe, mesh.dp_rank, mesh.dims.dp, device)
        gc.collect()
        with est.LiveBytes() as live:
            model, parallel = build_model(recipe, spec, mesh, device)
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer, scheduler = build_optimizer(params, recipe.train)
            trainer = Trainer(recipe.train, spec, model, params, optimizer, scheduler, parallel, batches, mesh, device,
                              None, Objective.of(recipe, spec))  # fmt: skip
            train_step(trainer, 0)
            del trainer, model, parallel, params, optimizer, scheduler
        peaks.append(live.peak)
        gc.collect()
        gc.freeze()  # what outlives a case (caches) is not garbage: leave it out of the next cases' collections
    return peaks


@pytest.mark.parametrize("family", family_names())
def test_calibration_present_and_current(family):
    """Every family ships a calibration measured for its current instance (re-run `--calibrate FAMILY` if not)."""
    assert est.calibration_status(family) is None, est.calibration_status(family)


@pytest.mark.slow  # one 4-rank spawn (memory measurements need processes of their own: not a shared group)
def test_predicted_peak_matches_measured_on_cpu(tmp_path):
    """Predicted first-step peak vs the worst rank's measured one, each case within TOLERANCE. ~45 s on an idle
    2-core machine: the spawn and its imports (~15 s), then ~5 s per case."""
    folder = write_mid_folder(tmp_path)
    measured = spawn(_measure_all, WORLD, folder)
    rows, bad = [], []
    for i, (cp, method, ckpt) in enumerate(CASES):
        recipe = recipe_from_dict(mid_recipe(folder, cp, method, ckpt))
        predicted = est.estimate(recipe, WORLD, "cpu").first_step_peak
        worst = max(measured, key=lambda per_rank: abs(per_rank[i] - predicted))[i]
        rows.append(f"cp {cp} {method:4} ckpt {ckpt!s:5}: predicted {predicted / 2**20:7.1f} MiB, measured "
                    f"{worst / 2**20:7.1f} MiB ({predicted / worst - 1:+.1%})")  # fmt: skip
        if abs(predicted / worst - 1) > TOLERANCE:
            bad.append(rows[-1])
    print("\n".join(rows))
    assert not bad, "\n".join(bad)


def test_startup_check_refuses_warns_and_passes(tmp_path):
    folder = write_mid_folder(tmp_path)
    data = mid_recipe(folder, 2, "full", False)
    cpu = torch.device("cpu")
    line = est.startup_check(recipe_from_dict({**data, "parallel": {"cp": 2, "memory_check": "refuse"}}), 4, cpu)
    assert line.startswith("predicted peak per rank") and " of " not in line  # CPU: no device limit unless set
    peak = est.estimate(recipe_from_dict(data), 4, "cpu").peak / est.GIB
    tight = {"cp": 2, "memory_check": "refuse", "device_memory_gib": peak / 2}
    with pytest.raises(ValueError, match="predicted peak per rank .* over by more than"):
        est.startup_check(recipe_from_dict({**data, "parallel": tight}), 4, cpu)
    warned = est.startup_check(recipe_from_dict({**data, "parallel": {**tight, "memory_check": "warn"}}), 4, cpu)
    assert warned.startswith("warning:")
    inside = {**tight, "device_memory_gib": peak / (1 + est.REFUSE_MARGIN / 2)}  # over, but inside the error band
    assert not est.startup_check(recipe_from_dict({**data, "parallel": inside}), 4, cpu).startswith("warning")


def test_gpu_terms_communicators_presets_and_margin(capsys) -> None:
    """On CUDA the estimate adds what no CPU measurement sees (train/estimate.py's constants and their sources): the
    CUDA context, NCCL's buffers per communicator the layout creates, the caching allocator's reserve; `--gpu-memory`
    takes a GPU's name; the verdict names its margin."""
    from train.config import load_recipe

    def layout(*sets: str):
        return load_recipe("recipes/qwenimage/20b_full.yaml", sets)

    gpu, cpu = est.estimate(layout(), 16, "cuda"), est.estimate(layout(), 16, "cpu")
    assert gpu.components["CUDA context + cuBLAS/cuDNN"] == est.CUDA_CONTEXT
    assert gpu.components["NCCL buffers (3 communicators)"] == 3 * est.NCCL_PER_COMMUNICATOR  # world, FSDP, CP
    assert not any("NCCL" in k or "CUDA" in k or "allocator" in k for k in cpu.components)
    tensors = (gpu.peak - est.CUDA_CONTEXT - 3 * est.NCCL_PER_COMMUNICATOR) / (1 + est.ALLOCATOR_RESERVE)
    assert gpu.components["caching allocator reserve (12%)"] == pytest.approx(est.ALLOCATOR_RESERVE * tensors)
    assert est._communicators(layout("parallel.cp=1", "parallel.dp_shard=1"), 1) == 1  # one GPU: the world's only
    ring = layout("parallel.cp=4", "parallel.cp_ring=2", "parallel.dp_replicate=2", "parallel.dp_shard=2")
    assert est._communicators(ring, 16) == 5  # world, FSDP, CP, ring, replicas
    assert (est.parse_gib("h200"), est.parse_gib("RTX4090"), est.parse_gib("80GB")) == (141.0, 24.0, 80e9 / 2**30)
    with pytest.raises(ValueError, match="h100"):
        est.parse_gib("a200")
    est.main(["--recipe", "recipes/qwenimage/20b_full.yaml", "--gpus", "16", "--gpu-memory", "h100"])
    verdict = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("verdict"))
    assert f"{gpu.peak / est.GIB:.1f} of 80.0 GiB per GPU; margin {80 - gpu.peak / est.GIB:.1f} GiB" in verdict


def test_the_suggestion_tries_the_optimizer_levers_for_full_fine_tuning_cheapest_first() -> None:
    """A full fine-tune over the device is told 8-bit moments first (no compute, ~1e-4 loss drift); LoRA never."""
    from train.config import load_recipe

    full = load_recipe("recipes/qwenimage/20b_full.yaml")
    fp32 = est.estimate(full, 16, "cuda").peak / est.GIB
    eight = est.estimate(load_recipe("recipes/qwenimage/20b_full.yaml", ["train.optimizer=adamw_8bit"]), 16, "cuda")
    assert eight.peak / est.GIB < 0.6 * fp32  # the moments were a third of the peak, now 1/4 of that
    said = est.suggest(full, 16, (fp32 + eight.peak / est.GIB) / 2)
    assert said.startswith("fits with --set train.optimizer=adamw_8bit"), said
    lora = load_recipe("recipes/qwenimage/20b_lora.yaml")
    assert "train.optimizer" not in est.suggest(lora, 8, 0.5 * est.estimate(lora, 8, "cuda").peak / est.GIB)
