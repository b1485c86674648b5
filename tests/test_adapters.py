"""LoKr, LoHa and DoRA (`finetune.adapter`, `finetune.dora`: peft's adapters) under CP, FSDP2 and the fp8 base.

* start: the seeded init zeros exactly the factors peft zeros (the adapted model starts as the base); DoRA's
  magnitudes equal peft's (the base weights' row norms), on an fp8 base too, where the start's loss equals the
  fp8 base's (a wrong norm would scale every adapted layer).
* model level: a tiny Wan with each kind, every adapter tensor moved off its init (gradients non-trivial), under CP
  (Ulysses 2 and 3, ring 2) vs the serial oracle (train/tools/oracle.py): loss and EVERY trainable gradient.
* export: each kind from an FSDP2-sharded model, loaded as a user loads it into a fresh tiny transformer, computes
  the trained model's output: DoRA through `WanPipeline.load_lora_weights`, LoKr through diffusers' LoKr loader
  (`transformer.load_lora_adapter`), every kind merged into a `from_pretrained` folder (LoHa's only format).
* trainer: CP 2 + FSDP2 runs of each kind (DoRA on the fp8 base) match the serial reference of their first step
  (tests/harness.py `first_step`); the DoRA run resumes exactly; the estimate counts each kind's parameters.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import diffusers
import pytest
import torch

from tests.harness import REL_TOL, first_step, rank_job, shared_tmpdir, train
from train.config import FinetuneConfig, RecipeError, load_recipe
from train.modeling import ZERO_AT_START, adapter_factor, apply_finetune, lora_init, set_dora_magnitudes
from train.models import get_family
from train.tools.oracle import compare, forward, output_tensors, run_step
from train.tools.tiny_models import build_model, family_case

KINDS = {"dora": {"adapter": "lora", "dora": True}, "lokr": {"adapter": "lokr"}, "loha": {"adapter": "loha"}}
RANK, ALPHA = 4, 8.0
TOL = 2e-5  # fp32 CP: relative, max |cp - serial| / max |serial| per gradient
LAYOUTS = {2: ((1, 2), (2, 1)), 3: ((1, 3),)}  # (ring, ulysses)
TINY = "recipes/tiny/wan.yaml"
TINY_PATH = Path(__file__).resolve().parents[1] / TINY


def _adapted(kind: str, fp8_base: bool = False, moved: bool = True) -> torch.nn.Module:
    """The tiny Wan (fp32) with `kind`'s adapters at the seeded init (`lora_init`; DoRA's magnitudes at peft's norms),
    each tensor then moved by a seeded amount (the same on every rank and call): factors off zero, DoRA's magnitudes
    off the norms. `moved=False`: peft's own init, untouched."""
    model = build_model("wan", seed=0, dtype=torch.float32)
    cfg = FinetuneConfig(method="lora", lora_rank=RANK, lora_alpha=ALPHA, fp8_base=fp8_base, **KINDS[kind])
    names = apply_finetune(model, cfg, get_family("wan"), "fp32")
    if not moved:
        return model  # peft's own init (its draws from the global generator)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, v in lora_init(model, seed=0).items():  # seeded: the same on every rank
            model.get_parameter(n).copy_(v)
        for n in names:
            p = model.get_parameter(n)
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_start_is_peft_s(kind: str) -> None:
    model = _adapted(kind, moved=False)
    peft = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ours = lora_init(model, seed=0)
    assert {n for n, v in peft.items() if not v.any()} == {n for n, v in ours.items() if not v.any()}
    assert {adapter_factor(n) for n, v in ours.items() if not v.any()} <= set(ZERO_AT_START)
    assert all(v.any() for n, v in ours.items() if adapter_factor(n) not in ZERO_AT_START)
    magnitudes = {n for n in peft if adapter_factor(n) == "lora_magnitude_vector"}
    assert set(peft) == set(ours) | magnitudes and bool(magnitudes) == (kind == "dora")
    with torch.no_grad():
        for n in magnitudes:
            model.get_parameter(n).zero_()
    set_dora_magnitudes(model)
    for n in magnitudes:
        torch.testing.assert_close(model.get_parameter(n), peft[n], rtol=0, atol=0)


def test_dora_on_the_fp8_base_starts_at_the_fp8_base() -> None:
    """DoRA reads the base weight's norm through `Fp8Linear.dequantize`: its start (B = 0) is the fp8 base exactly;
    a norm of the raw codes would rescale every adapted layer."""
    inputs = family_case("wan", seed=1, dtype=torch.float32, batch_size=2)
    base = run_step(_adapted("lokr", fp8_base=True, moved=False), inputs)  # LoKr's start adds exactly zero
    dora = _adapted("dora", fp8_base=True, moved=False)
    with torch.no_grad():
        for n, v in lora_init(dora, seed=0).items():
            dora.get_parameter(n).copy_(v)
    set_dora_magnitudes(dora)
    assert run_step(dora, inputs).loss == base.loss


def _parity(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import GradReduction, enable_context_parallel

    inputs = family_case("wan", seed=1, dtype=torch.float32, batch_size=2)
    results = {}
    for layout in LAYOUTS[world]:
        mesh = init_device_mesh("cpu", layout, mesh_dim_names=("ring", "ulysses"))
        for kind in KINDS:
            serial = run_step(_adapted(kind), inputs)
            model = _adapted(kind)
            state = enable_context_parallel(model, mesh=mesh)
            cp = run_step(model, inputs, reduce=GradReduction("allreduce", cp_group=state.cp_group).reduce_gradients)
            results[layout, kind] = compare(cp, serial)
    return results


rank_job(*LAYOUTS)(_parity)


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_every_kind_matches_the_serial_step_under_cp(group, world: int) -> None:
    for rank, results in enumerate(group(_parity, world)):
        for (layout, kind), e in results.items():
            if rank == 0:
                print(f"cp {layout} {kind}: loss rel {e.loss:.2e}, grad rel {e.grad:.2e} ({e.worst}), "
                      f"{len(e.grads)} trainable tensors")  # fmt: skip
            assert e.loss <= TOL and e.grad <= TOL, (rank, layout, kind, e.loss, e.worst, e.grad)
            assert any(adapter_factor(n) for n in e.grads) and all(adapter_factor(n) for n in e.grads)


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from train.parallel import repeated_blocks

    mesh = init_device_mesh("cpu", (2,))
    for block in repeated_blocks(model):
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _loaded_lora(kind: str, folder: Path) -> torch.nn.Module:
    """A fresh tiny transformer with the exported file loaded as a user loads it."""
    transformer = build_model("wan", seed=0, dtype=torch.float32)
    cls = diffusers.WanPipeline
    params = inspect.signature(cls.__init__).parameters
    pipe = cls(**{n: None for n, p in params.items() if n != "self" and p.default is inspect._empty}
               | {"transformer": transformer})  # fmt: skip
    if kind == "lokr":  # the pipelines' load_lora_weights refuses `.lokr_` keys in diffusers 0.42.1
        pipe.transformer.load_lora_adapter(str(folder), prefix="transformer",
                                           weight_name="pytorch_lora_weights.safetensors")  # fmt: skip
    else:
        pipe.load_lora_weights(folder)
    return pipe.transformer


@rank_job(2)
def _exports(rank: int, world: int) -> dict:
    from train.export import export_full, export_lora

    out, results = shared_tmpdir(), {}
    inputs = family_case("wan", seed=1, dtype=torch.float32, batch_size=2)
    for kind in KINDS:
        model = _shard(_adapted(kind))
        lora = export_lora(model, "WanPipeline", out / kind)[0] if kind != "loha" else None
        full = export_full(model, out / kind, max_shard_size=50_000).path
        if rank != 0:
            continue
        with torch.no_grad():
            trained = output_tensors(forward(_adapted(kind).eval(), inputs))[0]
            loaded = {"full": diffusers.WanTransformer3DModel.from_pretrained(full)}
            if lora is not None:
                loaded["lora"] = _loaded_lora(kind, lora)
            results[kind] = {k: {"diff": float((output_tensors(forward(m.eval(), inputs))[0] - trained).abs().max()),
                                 "config": type(next(iter(getattr(m, "peft_config", {None: None}).values()))).__name__}
                             for k, m in loaded.items()}  # fmt: skip
    shutil.rmtree(out, ignore_errors=True) if rank == 0 else None
    return results


@pytest.mark.slow
def test_every_kind_exports_in_a_format_that_loads_to_the_trained_output(group) -> None:
    results = group(_exports, 2)[0]
    print(results)
    assert set(results) == set(KINDS) and set(results["loha"]) == {"full"}
    for kind, formats in results.items():
        for fmt, r in formats.items():
            assert r["diff"] <= 1e-5, (kind, fmt, r)
    assert results["dora"]["lora"]["config"] == "LoraConfig" and results["lokr"]["lora"]["config"] == "LoKrConfig"


# ------------------------------------------------------------------------------------------------------ the trainer

STEP1 = ("parallel.cp=2", "logging.wandb_mode=disabled", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3")
TRAINER = {"dora_fp8": ("finetune.dora=true", "finetune.fp8_base=true", "train.max_steps=3"),
           "lokr": ("finetune.adapter=lokr", "train.max_steps=1"),
           "loha": ("finetune.adapter=loha", "train.max_steps=1")}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TRAINER))
def test_the_trainer_at_cp2_matches_the_serial_first_step(runs, case: str) -> None:
    run = runs(TINY, *STEP1, *TRAINER[case], nproc=2)
    ref = first_step(TINY, *STEP1, *TRAINER[case])
    got = run.metrics[0]
    rel = {k: abs(got[k] - ref[k]) / abs(ref[k]) for k in ("loss", "grad_norm")}
    print(f"{case}: trainer CP 2 vs serial first step: {rel}")
    assert all(v <= REL_TOL for v in rel.values()), (case, got, ref)
    exported = run.out / ("transformer" if case == "loha" else "lora")  # LoHa: merged (no loader reads LoHa files)
    assert exported.is_dir(), sorted(p.name for p in run.out.iterdir())


@pytest.mark.slow
def test_a_dora_run_on_the_fp8_base_resumes_exactly(runs, tmp_path: Path) -> None:
    src = runs(TINY, *STEP1, *TRAINER["dora_fp8"], nproc=2)
    out = tmp_path / "resumed"
    shutil.copytree(src.out, out)
    shutil.rmtree(out / "checkpoints" / "step_000003")
    resumed = train(out, TINY, *STEP1, *TRAINER["dora_fp8"], nproc=2, resume=True)
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2" in resumed.stdout
    timing = ("transformer_tokens_per_s", "step_time_s", "peak_mem_bytes")
    strip = lambda ms: [{k: v for k, v in m.items() if k not in timing} for m in ms]  # noqa: E731
    assert strip(resumed.metrics) == strip(src.metrics) and len(src.metrics) == 3


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_estimate_counts_each_kind_s_adapters(kind: str) -> None:
    from train import estimate as est
    from train.modeling import family_spec, whole_model

    sets = [f"finetune.{k}={str(v).lower()}" for k, v in KINDS[kind].items()]
    recipe = load_recipe(TINY_PATH, sets)
    real = sum(p.numel() for p in whole_model(recipe, family_spec(recipe.model)).parameters() if p.requires_grad)
    assert est.model_shape(recipe).numel(trainable=True) == real > 0


@pytest.mark.parametrize(
    "sets, said",
    [(["finetune.adapter=lokr", "finetune.dora=true"], "finetune.dora"),
     (["finetune.adapter=loha", "checkpoint.export=lora"], "no diffusers loader reads a LoHa file"),
     (["finetune.adapter=loha", "finetune.fp8_base=true"], "finetune.fp8_base"),
     (["finetune.adapter=lokr", "checkpoint.export_format=original"], "hold plain LoRA only"),
     (["finetune.dora=true", "finetune.init_lora=x.safetensors"], "finetune.init_lora")],
)  # fmt: skip
def test_kinds_a_run_cannot_combine_are_refused_by_the_recipe(sets: list[str], said: str) -> None:
    with pytest.raises(RecipeError) as e:
        load_recipe(TINY_PATH, sets)
    assert any(said in line for line in str(e.value).splitlines()), str(e.value)
