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
import json
import math

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
    fp32_estimate = est.estimate(full, 16, "cuda")
    fp32 = fp32_estimate.peak / est.GIB
    eight = est.estimate(load_recipe("recipes/qwenimage/20b_full.yaml", ["train.optimizer=adamw_8bit"]), 16, "cuda")
    state = "optimizer state (AdamW)"
    assert eight.components[state] < 0.26 * fp32_estimate.components[state]  # 8-bit codes + scales vs 2 × fp32
    # the moments and AdamW's fp32 temporaries were the step's peak; with 8-bit ones, the end of backward is (every
    # gradient and the activations outside the blocks)
    assert eight.peak / est.GIB < 0.7 * fp32
    said = est.suggest(full, 16, (fp32 + eight.peak / est.GIB) / 2)
    assert said.startswith("fits with --set train.optimizer=adamw_8bit"), said
    lora = load_recipe("recipes/qwenimage/20b_lora.yaml")
    assert "train.optimizer" not in est.suggest(lora, 8, 0.5 * est.estimate(lora, 8, "cuda").peak / est.GIB)


def test_fp8_base_halves_the_frozen_weights_in_the_estimate() -> None:
    """finetune.fp8_base: the meta model's quantized block linears count 1 byte per weight (+ a fp32 scale per row),
    gathered as bytes (FSDP2's param_dtype cast skips them), plus one layer's upcast; Wan 14B is ~99% block linears."""
    from train.config import load_recipe

    bf16, fp8 = (est.estimate(load_recipe("recipes/wan/14b_lora.yaml", sets), 16, "cuda")
                 for sets in ([], ["finetune.fp8_base=true"]))  # fmt: skip
    ratio = fp8.components["parameters"] / bf16.components["parameters"]
    assert 0.5 < ratio < 0.53, ratio
    shape = est.model_shape(load_recipe("recipes/wan/14b_lora.yaml", ["finetune.fp8_base=true"]))
    codes = [s for s, _, floating in shape.select(False, block=0) if not floating]
    saved = sum(math.prod(s) for s in codes) * (2 - 1) - sum(s[0] for s in codes) * 2  # bf16 weights -> codes + scales
    gathered = "FSDP gathered root + blocks"  # 2 blocks in flight, gathered in bf16 but for the codes
    assert bf16.components[gathered] - fp8.components[gathered] == 2 * saved
    assert fp8.components["fp8 weight upcast (one layer)"] == 13824 * 5120 * 2  # the FFN's largest linear, in bf16
    assert fp8.peak < bf16.peak and "fp8 base" in fp8.layout


def test_cpu_offload_moves_the_sharded_state_to_host_memory_on_a_gpu() -> None:
    from train.config import load_recipe

    def full(*sets: str):
        return load_recipe("recipes/qwenimage/20b_full.yaml", sets)

    on, off = est.estimate(full("parallel.cpu_offload=true"), 16, "cuda"), est.estimate(full(), 16, "cuda")
    for k in ("parameters", "gradients", "optimizer state (AdamW)"):
        assert k not in on.components and on.host[k] == off.components[k], k
    assert on.host["optimizer step temporaries"] > 0 and on.peak < 0.4 * off.peak
    cpu_on, cpu_off = est.estimate(full("parallel.cpu_offload=true"), 16, "cpu"), est.estimate(full(), 16, "cpu")
    assert cpu_on.peak == cpu_off.peak and not cpu_on.host  # a CPU-only machine: the state is in host memory anyway


def test_the_ema_costs_one_fp32_copy_of_the_trained_shards() -> None:
    """`ema`: each rank's fp32 average of its trained shards (train/ema.py), alive through the whole step: with fp32
    master weights exactly the size of the gradients, added to the peak; in host memory with CPU offload."""
    from train.config import load_recipe

    def full(*sets: str):
        return load_recipe("recipes/qwenimage/20b_full.yaml", sets)

    on, off = est.estimate(full("ema.decay=0.999"), 16, "cpu"), est.estimate(full(), 16, "cpu")
    assert on.components[est.EMA] == off.components["gradients"] > 0
    assert on.peak - off.peak == pytest.approx(on.components[est.EMA], rel=1e-9)
    offloaded = est.estimate(full("ema.decay=0.999", "parallel.cpu_offload=true"), 16, "cuda")
    assert offloaded.host[est.EMA] == on.components[est.EMA] and est.EMA not in offloaded.components


def test_the_suggestion_tries_fp8_then_cpu_offload_for_lora() -> None:
    from train.config import load_recipe

    lora = load_recipe("recipes/wan/14b_lora.yaml")
    levers = ["finetune.fp8_base=true", "train.offload_activations=true"]  # with checkpointing every block (the recipe)
    fp8 = est.estimate(load_recipe("recipes/wan/14b_lora.yaml", levers), 16, "cuda").peak / est.GIB
    assert est.suggest(lora, 16, fp8 + 0.05).startswith("fits with --set finetune.fp8_base=true")
    said = est.suggest(lora, 16, 6.0)  # below what cp 16, offload and fp8 give: the CPU offload too
    assert "parallel.cpu_offload=true" in said and "finetune.fp8_base=true" in said, said


def test_full_fine_tuning_peak_follows_the_activations_and_gradient_accumulation() -> None:
    """Backward ends holding every gradient and starts holding every block's activations: for full fine-tuning the
    peak moves with the sequence once those exceed the optimizer step's. With grad_accum, FSDP2 accumulates unsharded
    fp32 gradients until the last micro-batch's reduce-scatter."""
    from train.config import load_recipe

    def wan(*sets: str):
        return est.estimate(load_recipe("recipes/wan/1.3b_lora.yaml", ["finetune.method=full", "checkpoint.export=auto",
                            "parallel.cp=4", *sets]), 4, "cuda")  # fmt: skip

    short, long = wan("data.num_frames=17"), wan("data.num_frames=81")  # 7,800 and 32,760 tokens over 4 ranks
    step = sum(short.components[k] for k in ("parameters", "gradients", "optimizer state (AdamW)")) * 1.25  # +temps
    assert short.peak < (step * 1.12 + 1.0 * est.GIB)  # the optimizer step's peak (+ reserve, context, NCCL)
    assert long.peak - short.peak > 0.4 * est.GIB  # the end of backward's, above it
    accum = wan("train.grad_accum=2")
    full = load_recipe("recipes/wan/1.3b_lora.yaml", ["finetune.method=full", "checkpoint.export=auto"])
    trained = sum(math.prod(s) for s, _, _ in est.model_shape(full).select(True))
    assert accum.components["unsharded gradients (grad_accum)"] == 4 * trained
    assert accum.peak > wan().peak


def test_validation_counts_the_pipeline_components_it_loads(tiny_pipeline) -> None:
    """The validation term: the bytes of the VAE and text encoder as the family's encoder loads them (the same
    loading validation does), counted from the pipeline folder's safetensors headers without loading them."""
    from train.config import load_recipe
    from train.models import get_encoder

    folder = tiny_pipeline("wan")
    sets = [f"model.pretrained_path={folder}", "validation={prompts: [{prompt: a cat}], every_n_steps: 2}"]
    recipe = load_recipe("recipes/tiny/wan.yaml", sets)
    encoder = get_encoder("wan")
    encoder.load(str(folder), text_dtype=torch.float32)
    loaded = sum(t.nbytes for n, c in encoder.pipe.components.items()
                 if isinstance(c, torch.nn.Module) and not n.startswith("transformer")
                 for t in [*c.parameters(), *c.buffers()])  # fmt: skip
    e = est.estimate(recipe, 2, "cpu")
    assert e.components["validation: pipeline components"] == loaded > 0
    assert "validation: pipeline components" not in est.estimate(load_recipe("recipes/tiny/wan.yaml"), 2).components


def _manifest_only_cache(path, buckets: dict[str, int]) -> str:
    """A folder holding just a cache manifest with these buckets (bucket -> samples): all the estimate reads."""
    from train.data.dataset import CACHE_FORMAT, CACHE_VERSION

    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"format": CACHE_FORMAT, "version": CACHE_VERSION,
                                                    "buckets": buckets, "samples": []}))  # fmt: skip
    return str(path)


def test_the_startup_check_sizes_the_step_from_the_caches_buckets(tmp_path) -> None:
    """Training from a cache, the step is the size of the cache's largest bucket holding samples (17×64×96: 5 × 4 × 6
    = 120 tokens), not of the recipe's data.num_frames/height/width (1×32×48: 6 tokens): its prediction is the one
    of a recipe whose shape is that bucket (no cache read), larger than the recipe's shape alone gives (what the check
    predicted before, and still does before train.prepare wrote the cache); with a device limit between the two the
    startup check refuses the run the recipe's shape would have let through. A mixture of caches: the largest of
    theirs."""
    from train.config import load_recipe

    def recipe(*sets: str):
        return load_recipe("recipes/tiny/wan.yaml", ["data.synthetic=null", *sets])

    def activations(e: est.Estimate) -> float:
        return e.components["activations (blocks)"] + e.components["backward working set"]

    small = ("data.num_frames=1", "data.height=32", "data.width=48")
    cache = _manifest_only_cache(tmp_path / "cache", {"1x32x48": 3, "17x64x96": 2, "33x128x128": 0})  # none in 33×
    stills = _manifest_only_cache(tmp_path / "stills", {"1x32x48": 4})
    from_cache = est.estimate(recipe(f"data.cache_dir={cache}", *small), 2, "cpu")
    at_bucket = est.estimate(recipe("data.num_frames=17", "data.height=64", "data.width=96"), 2, "cpu")
    recipe_shape = est.estimate(recipe(f"data.cache_dir={tmp_path / 'not_yet'}", *small), 2, "cpu")
    assert est.sample_tokens(recipe(f"data.cache_dir={cache}", *small))[0] == 5 * 4 * 6
    assert activations(from_cache) == activations(at_bucket) > 1.5 * activations(recipe_shape)
    assert from_cache.peak == at_bucket.peak > 1.5 * recipe_shape.peak
    mix = f"data.datasets=[{{cache_dir: {stills}}}, {{cache_dir: {cache}, weight: 0.5}}]"
    assert est.estimate(recipe(mix, *small), 2, "cpu").peak == at_bucket.peak
    only_stills = est.estimate(recipe(f"data.cache_dir={stills}", "data.num_frames=17", "data.height=64",
                                      "data.width=96"), 2, "cpu")  # fmt: skip
    assert only_stills.peak == recipe_shape.peak  # a cache smaller than the recipe says: its own size too

    between = (recipe_shape.peak + at_bucket.peak) / 2 / (1 + est.REFUSE_MARGIN) / est.GIB
    assert between * est.GIB * (1 + est.REFUSE_MARGIN) > recipe_shape.peak  # the recipe's shape would pass
    limit = ("parallel.memory_check=refuse", f"parallel.device_memory_gib={between}")
    cpu = torch.device("cpu")
    assert est.startup_check(recipe(f"data.cache_dir={tmp_path / 'not_yet'}", *small, *limit), 2, cpu)
    with pytest.raises(ValueError, match="predicted peak per rank .* over by more than"):
        est.startup_check(recipe(f"data.cache_dir={cache}", *small, *limit), 2, cpu)
