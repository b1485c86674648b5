"""Sharded start: no rank ever holds the whole model, and what each rank holds is exactly its shard of what the
whole-model path loads.

- In-process (4 gloo ranks, cp 2 × dp_shard 2): `build_model` with `model.sharded_load` true vs false, from a bf16
  pretrained folder and from random init, LoRA and full: every parameter's gathered value is bit-identical, full
  fine-tuning holds fp32 master weights for its local shard only (≈ 1/4 of each parameter), LoRA adapters equal
  `lora_init`.
- In the same group, with the trainer's own step (`train_step`, `build_optimizer`, bf16 autocast): four steps of full
  fine-tuning from the bf16 folder, sharded vs whole, same loss and grad norm (≤ 1e-6 relative).
- Memory, through the real entry point (bench/startup_memory.py launches the trainer, whose default is the sharded
  start) as a user's launch has it (nothing set in the environment; the trainer tunes glibc's malloc itself,
  train/hostmem.py): the real Wan2.1-1.3B config (random bf16 weights, 2.8 GB), 4 ranks, one step: peak RSS per
  rank − the tiny launch's ≤ 0.45 × the bf16 model (0.38 at the test's 2-token step, 0.41 at the bench's default 32
  tokens; 0.95 with glibc's defaults).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import REPO, env, spawn

STEPS = 4


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory) -> Path:
    """The tiny Wan pipeline's transformer saved in bf16, as real checkpoints are."""
    import diffusers

    from train.models import build_tiny_pipeline

    root = tmp_path_factory.mktemp("scale")
    tiny = build_tiny_pipeline("wan", root / "tiny")
    model = diffusers.WanTransformer3DModel.from_pretrained(tiny, subfolder="transformer", torch_dtype=torch.bfloat16)
    model.save_pretrained(root / "bf16" / "transformer", max_shard_size="20KB")  # several files, like real ones
    with torch.no_grad():  # a second checkpoint with the same names and shapes, other weights
        model.proj_out.weight.mul_(1.5)
    model.save_pretrained(root / "other" / "transformer", max_shard_size="20KB")
    return root / "bf16"


def _train(recipe, model, parallel, mesh) -> list[dict]:
    """STEPS optimizer steps of the trainer (train/finetune.py's Trainer and train_step) on this model: the metrics."""
    from train.data.batches import build_dataset, make_batches
    from train.finetune import Trainer, autocast_dtype, build_optimizer, train_step
    from train.modeling import family_spec
    from train.models import cache_reads
    from train.step import Objective

    cpu, spec = torch.device("cpu"), family_spec(recipe.model)
    batches = make_batches(build_dataset(recipe, spec, cache_reads(spec.name)), recipe, mesh.dp_rank, mesh.dims.dp, cpu)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(params, recipe.train)
    trainer = Trainer(recipe.train, spec, model, params, optimizer, scheduler, parallel, batches, mesh, cpu,
                      autocast_dtype(recipe.train.mixed_precision, cpu), Objective.of(recipe, spec))  # fmt: skip
    return [train_step(trainer, step) for step in range(STEPS)]


def _build_both(rank: int, world: int, folder: str) -> dict:
    from torch.distributed.tensor import DTensor

    from train.config import load_recipe
    from train.modeling import build_model, family_spec, lora_init
    from train.parallel import ParallelDims

    mesh = ParallelDims(1, 2, 2).build("cpu")
    out = {"trained": {}}
    for source in ("pretrained", "random"):
        for method in ("lora", "full"):
            sets = [f"finetune.method={method}", "parallel.cp=2"]
            if source == "pretrained":
                sets += [f"model.pretrained_path={folder}", "model.init_config=null", "model.dtype=bfloat16"]
            models, parallels = {}, {}
            for sharded in (True, False):
                recipe = load_recipe(REPO / "recipes/tiny/wan.yaml", [*sets, f"model.sharded_load={sharded}"])
                models[sharded], parallels[sharded] = build_model(recipe, family_spec(recipe.model), mesh,
                                                                  torch.device("cpu"))  # fmt: skip
            whole = dict(models[False].named_parameters())
            lora = lora_init(models[True], seed=recipe.train.seed)
            case = out[(source, method)] = {"mismatch": [], "local_fraction": [], "dtypes": set(), "lora": 0}
            for name, p in models[True].named_parameters():
                assert isinstance(p, DTensor)
                full = p.full_tensor()
                ref = whole[name].full_tensor() if isinstance(whole[name], DTensor) else whole[name]
                if full.dtype != ref.dtype or not torch.equal(full, ref):
                    case["mismatch"].append(name)
                if name in lora:
                    case["lora"] += 1
                    assert torch.equal(full, lora[name]), name
                case["local_fraction"].append(p.to_local().numel() / max(p.numel(), 1))
                if p.requires_grad:
                    case["dtypes"].add(str(p.to_local().dtype))
            if (source, method) == ("pretrained", "full"):  # then train both, from bf16 weights with bf16 autocast
                for sharded in (True, False):
                    bf16 = load_recipe(REPO / "recipes/tiny/wan.yaml", [*sets, "train.mixed_precision=bf16"])
                    out["trained"][sharded] = _train(bf16, models[sharded], parallels[sharded], mesh)
    # One rank reading a different copy of the checkpoint (other weights, same names and shapes) is caught before
    # any shard is filled.
    other = Path(folder).parent / "other"
    recipe = load_recipe(REPO / "recipes/tiny/wan.yaml", ["parallel.cp=2", "model.init_config=null",
                         f"model.pretrained_path={other if rank == 1 else folder}"])  # fmt: skip
    try:
        build_model(recipe, family_spec(recipe.model), mesh, torch.device("cpu"))
        out["different sources"] = "not detected"
    except RuntimeError as e:
        out["different sources"] = str(e)
    return out


@pytest.fixture(scope="module")
def built(bf16_folder: Path) -> list[dict]:
    """Each rank's results of `_build_both`: one 4-rank spawn (cp 2 × dp_shard 2) for both tests."""
    return spawn(_build_both, 4, str(bf16_folder))


@pytest.mark.slow
def test_sharded_start_holds_exactly_each_ranks_shard(built: list[dict]) -> None:
    for rank, out in enumerate(built):
        out = {k: v for k, v in out.items() if k != "trained"}
        assert "ranks hold different sources of the initial weights" in out.pop("different sources"), rank
        for (source, method), case in out.items():
            assert case["mismatch"] == [], (rank, source, method, case["mismatch"][:5])
            assert case["dtypes"] == {"torch.float32"}, (rank, source, method)  # fp32 masters / adapters
            assert (case["lora"] > 0) == (method == "lora")
    # Each rank holds about a quarter of the weights (FSDP2 shards dim 0 over dp_shard × cp = 4; uneven rows allowed).
    total = [sum(out[("pretrained", "full")]["local_fraction"]) / len(out[("pretrained", "full")]["local_fraction"])
             for out in built]  # fmt: skip
    assert all(0.15 < f < 0.35 for f in total), total


@pytest.mark.slow
def test_sharded_start_trains_like_the_whole_model_path(built: list[dict]) -> None:
    """Full fine-tuning from bf16 weights with bf16 autocast, 4 trainer steps at cp 2 × dp_shard 2, sharded start vs
    whole model on every rank: the same loss and grad norm on every rank, and training moved the loss."""
    for rank, out in enumerate(built):
        sharded, whole = out["trained"][True], out["trained"][False]
        assert len(sharded) == len(whole) == STEPS
        for a, b in zip(sharded, whole):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-6 * abs(b[key]), (rank, key, a, b)
        assert sharded[-1]["loss"] != sharded[0]["loss"]


def startup_memory(root: Path) -> dict:
    """bench/startup_memory.py's own run (`--short --sharded-only`) in a process of its own: ~2.5 min of 4-rank
    launches. Not overlapped with other tests (tests/harness.py `Early`): tried from the start of the session, it
    saved ~10 s of ~870 (noise) and made the tests beside it 2-5x slower: two sets of gloo ranks on 2 cores."""
    cmd = [sys.executable, "-m", "bench.startup_memory", "--layers", "30", "--method", "lora", "--nproc", "4",
           "--short", "--sharded-only", "--json", str(root / "result.json")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((root / "result.json").read_text())


@pytest.mark.slow
def test_startup_and_first_step_memory_per_rank(tmp_path: Path) -> None:
    """The target of issue 10: ≤ 0.45 × the bf16 model per rank at 4 ranks (cp 2 × dp_shard 2), LoRA, startup and
    the first step. All 30 blocks: the fraction is ~0.27 + ~3.3 / (blocks + 1) (this rank's quarter plus FSDP's
    blocks in flight), so a shallower model measures more (0.46 at 16 blocks, 0.75 at 6), not the 1.3B's number.
    The step is one sample of 2 video tokens (1 per rank) and 2 text tokens (bench SHORT_SHAPES): on an AVX2 CPU the
    bf16 backward through the frozen linears is a scalar gemm, linear in the tokens, so the bench's default 32 tokens
    cost ~3 min more, for +0.035 (their activations). ~2.5 min on an idle 2-core machine (`startup_memory`): the
    tiny baseline launch while the 2.8 GB folder is written (~45 s), then the measured
    launch (~110 s, ~65 s of it the step: FSDP's all-gathers of the bf16 blocks over gloo and their copies)."""
    r = startup_memory(tmp_path)
    print(f"sharded start: peak per rank − baseline = {r['sharded']:.3f} × bf16 model ({r['model_bytes'] / 2**30:.2f} "
          f"GiB)")  # fmt: skip
    assert r["sharded"] <= 0.45, r
