"""fp8 frozen base weights under LoRA (`finetune.fp8_base`, train/fp8.py).

- The rounding, by its properties (not by a second copy of the formula): per row a power-of-two scale whose row
  maximum lands in e4m3's top binade [224, 448]; every element within half an e4m3 ulp of the bf16 value (2^-4
  relative in the normal range, 2^-10 × scale below it); zero rows stay zero; every code a finite e4m3 value.
- `Fp8Linear` computes exactly `nn.Linear` with the rounded weight (fp32, and under bf16 autocast), output and input
  gradient, and saves nothing but its own parameters for backward (no upcast copy of the weight per layer).
- Sharded start at CP 2 on 2 gloo ranks from a bf16 safetensors folder (each rank quantizes the rows it reads): every
  LoRA gradient of the first step equals the serial oracle's (the plain diffusers transformer, whole, in one process,
  its block linears holding the rounded weights, the same adapters) within the CP parity tolerance; the same
  gradients against the bf16 base measure what fp8 costs (stated, bounded); each rank's frozen block weights take
  half the bytes of the bf16 run's, and the codes the ranks hold are those of the whole tensor quantized at once.
- Through the trainer: a CP 2 LoRA run on a pipeline folder with fp8_base exports a LoRA that the family's diffusers
  pipeline loads on its own (unquantized) base.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.harness import check_lora_reload, rank_job, shared_tmpdir
from train import fp8
from train.tools.oracle import rel, run_step

TINY = "recipes/tiny/wan.yaml"
TOL = 2e-5  # relative gradient error of fp32 CP against serial (tests/test_cp_models.py)
# What fp8 rounding of the frozen base costs, the first step's LoRA gradients against the bf16 base's, on this 56-wide
# tiny Wan (narrow dot products: the pessimistic case; the elements are rounded by up to 2^-4): measured 3.3e-2
# relative error of all gradients together (‖fp8 - bf16‖ / ‖bf16‖), the worst tensor's cosine 0.998 (its max
# relative error 8.3e-2, the median tensor's 3.9e-2), the loss 1.4e-4. Bounded at about twice the error.
DRIFT = 0.06
MIN_COSINE = 0.99
LOSS_DRIFT = 3e-3  # the trainer's 4-step loss curve, fp8 vs bf16 base: measured 2.6e-4, bounded at ~10x


def _weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * torch.logspace(-4, 1, 48).unsqueeze(1)  # rows across 5 decades
    w[3] = 0.0
    w[5, :7] = torch.tensor([1e-9, -1e-7, 3e-6, 448.0, -1000.0, 2.0**-20, 0.0])  # subnormal, huge, exact
    return w.to(torch.bfloat16).float()


def test_rounding_is_the_nearest_e4m3_value_on_a_power_of_two_scale() -> None:
    w = _weights()
    codes, scale = fp8.quantize(w)
    assert codes.dtype == torch.uint8 and scale.dtype == torch.float32 and codes.shape == w.shape
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()  # powers of two: exact division, exact in bf16
    amax = w.abs().amax(dim=1)
    live = amax > 0
    assert ((amax[live] / scale[live] >= 224) & (amax[live] / scale[live] <= 448)).all()
    assert (scale[~live] == 1).all()
    assert torch.isfinite(codes.view(fp8.E4M3).float()).all()
    q = fp8.dequantize(codes, scale, torch.float32)
    assert (q[3] == 0).all()
    normal = w.abs() >= 2.0**-6 * scale[:, None]  # e4m3's smallest normal, times the row's scale
    err = (q - w).abs()
    assert (err[normal] <= 2.0**-4 * w.abs()[normal]).all()
    assert (err[~normal] <= 2.0**-10 * scale[:, None].expand_as(w)[~normal]).all()
    assert (torch.sign(q) * torch.sign(w) >= 0).all()
    assert torch.equal(fp8.dequantize(codes, scale, torch.bfloat16).float(), q)  # exact in bf16


@pytest.mark.parametrize("autocast", [False, True])
def test_fp8_linear_is_the_plain_linear_of_the_rounded_weight(autocast: bool) -> None:
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 48).requires_grad_(False)
    plain.weight.copy_(_weights())
    layer = fp8.Fp8Linear.from_linear(plain)
    plain.weight.copy_(layer.dequantized())
    x = torch.randn(2, 5, 96)
    grads, outs, saved = [], [], []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    for module in (layer, plain):
        xi = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = module(xi)
        (out.float() * torch.linspace(-1, 1, 48)).sum().backward()
        outs.append(out)
        grads.append(xi.grad)
        if module is layer:
            held = list(saved)
    assert outs[0].dtype == outs[1].dtype
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    assert {t.data_ptr() for t in held} == {layer.weight.data_ptr(), layer.weight_scale.data_ptr()}


def _recipe(folder: Path, *sets: str):
    from train.config import load_recipe

    return load_recipe(Path(__file__).parents[1] / TINY, [f"model.pretrained_path={folder}", "model.init_config=null",
                       "parallel.memory_check=off", *sets])  # fmt: skip


def _lora_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Non-zero B (peft starts it at 0, which would leave every A gradient 0): seeded, the same in every model."""
    g = torch.Generator().manual_seed(7)
    return {n: 0.1 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters() if ".lora_B." in n}


def _held_bytes(model: torch.nn.Module, names: list[str], attrs: tuple[str, ...]) -> int:
    """The storage this rank holds for those parameters of the layers `names` (FSDP2's padded shards)."""
    return sum(getattr(model.get_submodule(n), a).to_local().untyped_storage().nbytes() for n in names for a in attrs)


@rank_job(2)
def fp8_cp2(rank: int, world: int) -> dict:
    """The first step's LoRA gradients at CP 2 from a sharded fp8 start, the rounded weights and codes, the frozen
    block bytes of fp8 and bf16 starts."""
    import diffusers
    import torch.distributed as dist

    from train.modeling import _set_full, build_model, family_spec
    from train.parallel import ParallelDims
    from train.tools.tiny_models import family_case, tiny_config

    folder = shared_tmpdir()
    if rank == 0:  # the tiny Wan, saved as a bf16 checkpoint
        torch.manual_seed(0)
        diffusers.WanTransformer3DModel.from_config(tiny_config("wan")).to(torch.bfloat16).save_pretrained(
            folder / "transformer"
        )
    dist.barrier()
    cpu, mesh = torch.device("cpu"), ParallelDims(1, 1, world).build("cpu")
    recipe = _recipe(folder, "finetune.fp8_base=true", "model.dtype=float32")
    model, _ = build_model(recipe, family_spec(recipe.model), mesh, cpu)
    _set_full(model, _lora_values(model), broadcast=False)
    step = run_step(model, family_case("wan", seed=1))
    layers = fp8.modules(model)
    out = {"folder": str(folder), "loss": step.loss, "grads": {n: g.full_tensor() for n, g in step.grads.items()},
           "codes": {n: m.weight.full_tensor() for n, m in layers.items()},
           "scales": {n: m.weight_scale.full_tensor() for n, m in layers.items()}}  # fmt: skip
    bf16 = {}
    for base in ("fp8", "bf16"):  # the same layers in a bf16 start, with and without fp8
        sets = (f"finetune.fp8_base={base == 'fp8'}", "model.dtype=bfloat16")
        bf16[base], _ = build_model(_recipe(folder, *sets), family_spec(recipe.model), mesh, cpu)
    out["codes_bytes"] = _held_bytes(bf16["fp8"], list(layers), ("weight",))
    out["scales_bytes"] = _held_bytes(bf16["fp8"], list(layers), ("weight_scale",))
    out["bf16_bytes"] = _held_bytes(bf16["bf16"], list(layers), ("weight",))  # the same names (peft wraps alike)
    return out


@pytest.fixture(scope="module")
def cp2(group) -> list[dict]:
    return group(fp8_cp2, 2)


@pytest.fixture(scope="module")
def serial(cp2: list[dict]) -> dict:
    """The oracle: the plain transformer whole (no fp8 module, no CP, no FSDP) from the same folder, its block linears
    set to the weights the codes stand for, the same adapters; and the same with the bf16 weights as they are."""
    from train.modeling import family_spec, whole_model
    from train.tools.tiny_models import family_case

    folder, out = Path(cp2[0]["folder"]), {}
    recipe = _recipe(folder, "model.dtype=float32")
    for base in ("rounded", "bf16"):
        model = whole_model(recipe, family_spec(recipe.model))
        with torch.no_grad():
            for name, value in _lora_values(model).items():
                model.get_parameter(name).copy_(value)
            if base == "rounded":
                for name, codes in cp2[0]["codes"].items():
                    layer = model.get_submodule(name)
                    assert type(layer) is torch.nn.Linear, name  # the oracle's own layer, not an Fp8Linear
                    layer.weight.copy_(fp8.dequantize(codes, cp2[0]["scales"][name], torch.float32))
        out[base] = run_step(model, family_case("wan", seed=1))
        out[f"{base}_weights"] = {n: model.get_submodule(n).weight.detach().clone() for n in cp2[0]["codes"]}
    return out


def test_sharded_fp8_start_holds_the_whole_tensor_rounding(cp2: list[dict], serial: dict) -> None:
    """The codes the ranks hold (each quantized its own rows while reading its slice) are those of the whole bf16
    tensor quantized at once, and every quantized layer is a block linear: the bulk of the weights."""
    assert len(cp2[0]["codes"]) == 20  # 2 blocks × (self-attention q/k/v/out, cross-attention q/k/v/out, 2 FFN)
    for name, codes in cp2[0]["codes"].items():
        whole, scale = fp8.quantize(serial["bf16_weights"][name])
        assert torch.equal(codes, whole) and torch.equal(cp2[0]["scales"][name], scale), name


def test_lora_gradients_at_cp2_equal_the_serial_rounded_base(cp2: list[dict], serial: dict) -> None:
    ref = serial["rounded"]
    for rank in cp2:
        assert abs(rank["loss"] - ref.loss) <= 1e-6 * abs(ref.loss)
        assert rank["grads"].keys() == ref.grads.keys() and len(ref.grads) == 2 * 8 * 2  # A, B × 8 targets × 2 blocks
        errors = {n: rel(g, ref.grads[n]) for n, g in rank["grads"].items()}
        assert max(errors.values()) <= TOL, max(errors.items(), key=lambda kv: kv[1])


def test_fp8_against_the_bf16_base_drifts_within_the_stated_bound(serial: dict) -> None:
    rounded, bf16 = serial["rounded"], serial["bf16"]
    names = sorted(bf16.grads)
    a, b = (torch.cat([g.grads[n].flatten() for n in names]) for g in (rounded, bf16))
    drift = ((a - b).norm() / b.norm()).item()
    cosine = min(torch.cosine_similarity(rounded.grads[n].flatten(), bf16.grads[n].flatten(), dim=0) for n in names)
    worst = max(rel(rounded.grads[n], bf16.grads[n]) for n in names)
    loss = abs(rounded.loss - bf16.loss) / abs(bf16.loss)
    print(f"fp8 base vs bf16 base, first-step LoRA gradients: relative error {drift:.2e} (worst tensor {worst:.2e}, "
          f"lowest cosine {cosine:.4f}); loss {loss:.2e}")  # fmt: skip
    assert 0 < drift <= DRIFT and cosine >= MIN_COSINE and loss <= DRIFT / 10


def test_frozen_linear_weights_take_half_the_bytes(cp2: list[dict]) -> None:
    """Per rank, the quantized layers' codes take exactly half the bytes their bf16 weights take in a bf16 start (the
    same padded shards), plus one fp32 scale per row: 4 / in_features of a bf16 row's bytes (0.3% at Wan 1.3B's
    1536; more on this 56-wide model)."""
    for rank in cp2:
        ratio = (rank["codes_bytes"] + rank["scales_bytes"]) / rank["bf16_bytes"]
        print(f"quantized layers per rank: codes {rank['codes_bytes']} B + scales {rank['scales_bytes']} B vs bf16 "
              f"{rank['bf16_bytes']} B ({ratio:.3f})")  # fmt: skip
        assert 2 * rank["codes_bytes"] == rank["bf16_bytes"] and rank["scales_bytes"] <= rank["bf16_bytes"] / 16


def test_trainer_fp8_lora_trains_near_the_bf16_base_and_exports_what_the_pipeline_loads(runs, tiny_pipeline) -> None:
    """Through the trainer (CP 2, sharded start from the tiny pipeline folder, 4 steps): the loss curve against the
    same run on the unquantized base within LOSS_DRIFT, and the exported LoRA loads in WanPipeline on that base."""
    pipeline = tiny_pipeline("wan")
    sets = (f"model.pretrained_path={pipeline}", "model.init_config=null", "parallel.cp=2")
    run, base = runs(TINY, *sets, "finetune.fp8_base=true", nproc=2), runs(TINY, *sets, nproc=2)
    assert run.rc == 0 and base.rc == 0, (run.log + base.log)[-3000:]
    losses, ref = [m["loss"] for m in run.metrics], [m["loss"] for m in base.metrics]
    drift = max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
    print(f"fp8 base vs its bf16 base through the trainer, 4 steps: max relative loss difference {drift:.1e}")
    assert len(losses) == 4 and 0 < drift <= LOSS_DRIFT, (losses, ref)
    layout = json.loads((run.out / "layout.json").read_text())
    assert "float8" in layout["weights"], layout
    check_lora_reload("wan", pipeline, run.out / "lora", rank=4, alpha=8.0)
