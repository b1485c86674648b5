"""The trainer through its real entry point: `accelerate launch ... train/finetune.py --recipe ...` on CPU (gloo).

A CP run must be indistinguishable, step by step, from the single-process run of the same recipe and seed:
per-step loss and grad_norm within 1e-5 relative. Each launch costs ~15-25 s on 2 cores, so runs are shared between
tests through a module-level cache. Every family trains through this entry point in tests/test_families_e2e.py
(its tiny pipeline's cache, CP 2 vs serial); every tiny recipe's shapes run through its family spec at CP 2, 3 and 4
in tests/test_cp_models.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
REL_TOL = 1e-5
_RUNS: dict[tuple, tuple[list[dict], Path]] = {}


def launch(out_dir: Path, nproc: int, recipe: str = "recipes/tiny/wan.yaml", *overrides: str, resume: bool = False,
           extra: list[str] | tuple[str, ...] = ()):  # fmt: skip
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu.yaml",
           "--num_processes", str(nproc), "train/finetune.py", "--recipe", recipe,
           "--set", f"output_dir={out_dir}", "--set", "logging.progress_bar=false", *[a for o in overrides
           for a in ("--set", o)]] + (["--resume"] if resume else []) + list(extra)  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"launch failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def run(tmp_root: Path, nproc: int, *overrides: str, recipe: str = "recipes/tiny/wan.yaml") -> list[dict]:
    return run_dir(tmp_root, nproc, *overrides, recipe=recipe)[0]


def run_dir(tmp_root: Path, nproc: int, *overrides: str, recipe: str = "recipes/tiny/wan.yaml"):
    """Launch once per distinct (nproc, recipe, overrides); return (metrics lines, output dir)."""
    key = (nproc, recipe, overrides)
    if key not in _RUNS:
        out = tmp_root / f"run{len(_RUNS)}"
        launch(out, nproc, recipe, *overrides)
        _RUNS[key] = (metrics(out), out)
    return _RUNS[key]


def assert_same_steps(a: list[dict], b: list[dict], what: str, steps: int = 3) -> None:
    assert len(a) >= steps and len(b) >= steps, (a, b)
    for x, y in zip(a[:steps], b[:steps]):
        assert x["step"] == y["step"]
        for key in ("loss", "grad_norm"):
            rel = abs(x[key] - y[key]) / max(abs(y[key]), 1e-12)
            assert rel <= REL_TOL, f"{what}, step {x['step']}: {key} {x[key]} vs {y[key]} (rel {rel:.2e})"


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("finetune")


QUIET = ("logging.wandb_mode=disabled", "train.max_steps=3")


@pytest.mark.parametrize("method", ["lora", "full"])
def test_cp2_and_cp3_match_single_process(tmp_root: Path, method: str) -> None:
    base = (*QUIET, f"finetune.method={method}", "train.gradient_checkpointing=" + str(method == "full").lower())
    serial = run(tmp_root, 1, *base, "parallel.cp=1")
    assert_same_steps(run(tmp_root, 2, *base, "parallel.cp=2"), serial, f"{method} CP 2 vs 1")
    if method == "lora":  # 3 ranks: 7 heads and 35 tokens, neither divisible
        assert_same_steps(run(tmp_root, 3, *base, "parallel.cp=3"), serial, f"{method} CP 3 vs 1")
    assert serial[-1]["loss"] != serial[0]["loss"]  # parameters did move


@pytest.mark.parametrize(
    "levers",
    [
        ("train.gradient_checkpointing=true", "train.checkpoint_every=2"),  # block 0 recomputed, block 1 not
        ("train.offload_activations=true",),
        ("train.compile=true", "train.gradient_checkpointing=true"),  # inductor on CPU; compiled recompute too
    ],
    ids=["ckpt_every_2", "offload", "compile_ckpt"],
)
def test_activation_levers_and_compile_under_cp2_match_single_process(tmp_root: Path, levers: tuple) -> None:
    """Each memory lever and torch.compile (per block, the CP attention a graph break) at CP 2 against the plain
    serial run: the same loss and grad norm."""
    base = (*QUIET, "finetune.method=lora", "train.gradient_checkpointing=false")
    serial = run(tmp_root, 1, *base, "parallel.cp=1")
    assert_same_steps(run(tmp_root, 2, *base, *levers, "parallel.cp=2"), serial, f"{levers} CP 2 vs 1")


def test_startup_refuses_a_recipe_predicted_not_to_fit(tmp_root: Path) -> None:
    """`train.estimate` runs at startup: a prediction clearly over the device memory is a one-line error (exit 2)
    before the model is built; `memory_check: warn` prints it and trains."""
    out = tmp_root / "too_big"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu.yaml",
           "--num_processes", "2", "train/finetune.py", "--recipe", "recipes/tiny/wan.yaml", "--set",
           f"output_dir={out}", "--set", "parallel.device_memory_gib=0.0001", "--set", "train.max_steps=1"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert errors and "predicted peak per rank" in errors[0] and "parallel.memory_check: warn" in errors[0], errors
    assert not (out / "metrics.jsonl").exists()
    warned = run_dir(tmp_root, 2, *QUIET, "parallel.cp=2", "parallel.device_memory_gib=0.0001",
                     "parallel.memory_check=warn")  # fmt: skip
    assert len(warned[0]) == 3


def test_grad_accumulation_cp2_matches_single_process(tmp_root: Path) -> None:
    base = (*QUIET, "train.grad_accum=2", "train.batch_size=1")
    assert_same_steps(run(tmp_root, 2, *base, "parallel.cp=2"), run(tmp_root, 1, *base, "parallel.cp=1"), "accum 2")


def test_dp2_cp2_matches_dp2_cp1(tmp_root: Path) -> None:
    dp_only = run(tmp_root, 2, *QUIET, "parallel.cp=1", "parallel.dp_shard=2")
    dp_cp = run(tmp_root, 4, *QUIET, "parallel.cp=2", "parallel.dp_shard=2")
    assert_same_steps(dp_cp, dp_only, "dp_shard 2 × cp 2 vs dp_shard 2 × cp 1")


def test_resume_is_exact(tmp_root: Path) -> None:
    common = ("logging.wandb_mode=disabled", "parallel.cp=2", "checkpoint.every_n_steps=2", "checkpoint.keep_last=1")
    straight = run(tmp_root, 2, *common, "train.max_steps=4")
    out = tmp_root / "resumed"
    launch(out, 2, "recipes/tiny/wan.yaml", *common, "train.max_steps=2")
    assert [m["step"] for m in metrics(out)] == [1, 2]
    launch(out, 2, "recipes/tiny/wan.yaml", *common, "train.max_steps=4", resume=True)
    resumed = metrics(out)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    timing = ("transformer_tokens_per_s", "step_time_s", "peak_mem_bytes")  # measurements, not results: they may differ
    exact = [{k: v for k, v in m.items() if k not in timing} for m in resumed[2:]]
    assert exact == [{k: v for k, v in m.items() if k not in timing} for m in straight[2:]]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000004"]  # keep_last=1


def test_wandb_offline_bf16_run_and_outputs(tmp_root: Path) -> None:
    """A CP 2 run with wandb offline and `mixed_precision: bf16` (autocast on CPU too): its metrics, layout and LoRA
    export; its loss differs from the fp32 single-process run by bf16 rounding, not more (so autocast did run)."""
    out = tmp_root / "wandb"
    bf16 = "train.mixed_precision=bf16"
    proc = launch(out, 2, "recipes/tiny/wan.yaml", "train.max_steps=2", "logging.wandb_mode=offline", bf16)
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, proc.stdout
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert {"step", "loss", "grad_norm", "lr", "transformer_tokens_per_s", "peak_mem_bytes"} <= set(m)
        assert m["transformer_tokens_per_s"] > 0 and m["peak_mem_bytes"] > 0
        # tokens/s × step time = the step's transformer tokens: 2 clips × (5 × 2/2 × 14/2 = 35 video tokens) = 70
        assert round(m["transformer_tokens_per_s"] * m["step_time_s"]) == 70
    layout = json.loads((out / "layout.json").read_text())
    assert "SUM over cp=2" in layout["gradient_reduction"] and layout["cp_plan"].endswith("wan.yaml")
    assert layout["mixed_precision"] == "bf16: bf16 autocast, fp32 master weights"
    fp32 = run(tmp_root, 1, *QUIET, "finetune.method=lora", "train.gradient_checkpointing=false", "parallel.cp=1")
    rel = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(lines, fp32)]
    assert 1e-5 < max(rel) < 5e-2, rel
    assert (out / "recipe.yaml").exists()

    # The LoRA export loads into a diffusers pipeline of the same architecture, with the trained values and scale.
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    from train.models import build_tiny_pipeline

    pipe = WanPipeline.from_pretrained(build_tiny_pipeline("wan", out / "pipeline"))
    pipe.load_lora_weights(out / "lora")
    exported = load_file(out / "lora" / "pytorch_lora_weights.safetensors")
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert len(loaded) == len(exported) > 0
    for name, value in exported.items():  # transformer.blocks.0.attn1.to_q.lora_A.weight → ...lora_A.<adapter>.weight
        module, kind = name.removeprefix("transformer.").rsplit(".lora_", 1)
        match = [p for n, p in loaded.items() if n.startswith(module + ".lora_" + kind.split(".")[0] + ".")]
        assert len(match) == 1 and torch.equal(match[0], value), name
    lora_layer = pipe.transformer.blocks[0].attn1.to_q
    assert lora_layer.scaling[next(iter(lora_layer.scaling))] == 8.0 / 4  # lora_alpha / rank from the recipe


def _state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("method", ["lora", "full"])
def test_exported_weights_match_single_process(tmp_root: Path, method: str) -> None:
    """The weights a CP 2 run exports equal those of the single-process run (after 3 optimizer steps)."""
    base = (*QUIET, f"finetune.method={method}", "train.gradient_checkpointing=" + str(method == "full").lower())
    _, serial = run_dir(tmp_root, 1, *base, "parallel.cp=1")
    _, cp2 = run_dir(tmp_root, 2, *base, "parallel.cp=2")
    sub = "lora" if method == "lora" else "transformer"
    a, b = _state(cp2 / sub), _state(serial / sub)
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert (a[k] - b[k]).abs().max() <= 1e-5 * b[k].abs().max().clamp_min(1e-3), k
    if method == "full":  # a diffusers folder that reloads, and training moved the weights away from the init
        from diffusers import WanTransformer3DModel

        from train.config import load_recipe

        model = WanTransformer3DModel.from_pretrained(serial / "transformer")
        torch.manual_seed(0)
        init = WanTransformer3DModel.from_config(load_recipe(REPO / "recipes/tiny/wan.yaml").model.init_config)
        moved = [n for n, p in model.named_parameters() if not torch.equal(p, init.state_dict()[n])]
        assert len(moved) >= 0.9 * len(list(model.parameters()))


def test_mixed_precision_resolves_per_device() -> None:
    """`bf16` autocasts on any device (never silently fp32 on CPU); `auto` is bf16 on GPU only; `no` is fp32."""
    from train.finetune import autocast_dtype

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert [autocast_dtype(m, cpu) for m in ("bf16", "auto", "no")] == [torch.bfloat16, None, None]
    assert [autocast_dtype(m, gpu) for m in ("bf16", "auto", "no")] == [torch.bfloat16, torch.bfloat16, None]


def test_flow_shift_is_a_recipe_key() -> None:
    """Wan's flow shift (3.0 at 480p) is the recipe default; `model.flow_shift: 5.0` (720p) shifts every sigma."""
    from train.config import load_recipe
    from train.modeling import family_spec
    from train.objective import sample_stream_sigmas

    default = family_spec(load_recipe(REPO / "recipes/tiny/wan.yaml").model)
    shifted = family_spec(load_recipe(REPO / "recipes/tiny/wan.yaml", ["model.flow_shift=5.0"]).model)
    assert (default.shift.shift, shifted.shift.shift) == (3.0, 5.0)
    a, b = (sample_stream_sigmas(64, s, scheme="uniform", generator=torch.Generator().manual_seed(1))["latents"]
            for s in (default, shifted))  # fmt: skip
    u = a.double() / (3.0 - 2.0 * a.double())  # the same base draw: invert sigma = 3u / (1 + 2u)
    torch.testing.assert_close(b.double(), 5.0 * u / (1 + 4.0 * u), rtol=1e-5, atol=1e-6)
