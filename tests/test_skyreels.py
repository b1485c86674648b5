"""SkyReels-V2 (no diffusers CP plan: cp_plans/skyreels_v2.yaml): per-frame (diffusion-forcing) sigmas, the T2V (B,)
timestep under CP, the tiny recipe under CP 3 vs 1 process through the real entry point, and its LoRA export loaded
by the diffusion-forcing pipeline. Model-level parity of the diffusion-forcing case at CP 2, 3, 4 is in
tests/test_cp_models.py (the family's tiny recipe: per-frame timesteps that differ per frame)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.tiny_models import FamilyCase, build_model, family_case, family_loss, output_tensors, tiny_recipe
from train import objective
from train.data.synthetic_latents import SyntheticLatentDataset
from train.errors import UserError
from train.models import get_family, tiny_config

REPO = Path(__file__).resolve().parents[1]
NAME = "skyreels_v2"


def test_per_frame_sigmas_are_non_decreasing_and_identical_on_peers() -> None:
    spec = get_family(NAME)
    draw = [objective.sample_stream_sigmas(3, spec, frames=5, generator=torch.Generator().manual_seed(7))["latents"]
            for _ in range(2)]  # fmt: skip
    assert draw[0].shape == (3, 1, 5, 1, 1) and torch.equal(draw[0], draw[1])  # CP peers seeded alike agree
    frames = draw[0].reshape(3, 5)
    assert bool((frames[:, 1:] >= frames[:, :-1]).all()) and bool((frames[:, 1:] > frames[:, :-1]).any())
    # independent: the same base draws through the shift, unsorted
    ind = objective.sample_stream_sigmas(3, spec, frames=5, frame_sigmas="independent",
                                         generator=torch.Generator().manual_seed(7))["latents"]  # fmt: skip
    assert torch.equal(ind.reshape(3, 5).sort(dim=1).values, frames)
    shared = objective.sample_stream_sigmas(3, spec, frames=5, frame_sigmas="shared",
                                            generator=torch.Generator().manual_seed(7))["latents"]  # fmt: skip
    assert shared.shape == (3,)
    with pytest.raises(UserError, match="train.frame_sigmas"):
        objective.sample_stream_sigmas(1, get_family("wan"), frames=5, frame_sigmas="independent",
                                       generator=torch.Generator())  # fmt: skip


def test_per_frame_loss_weights_each_frame() -> None:
    pred, target = torch.randn(2, 3, 4, 2, 2), torch.randn(2, 3, 4, 2, 2)
    sigmas = torch.rand(2, 1, 4, 1, 1) * 0.8 + 0.1
    weights = objective.loss_weight(sigmas, "sigma_sqrt")
    expected = ((pred - target).pow(2) * sigmas.pow(-2)).mean()
    assert objective.flow_matching_loss(pred, target, weights).item() == pytest.approx(expected.item(), rel=1e-6)


def test_forward_kwargs_are_the_pipelines() -> None:
    """The diffusion-forcing kwargs are what SkyReelsV2DiffusionForcingPipeline passes (timestep (B, F) per frame,
    enable_diffusion_forcing, fps indices); the T2V ones what SkyReelsV2Pipeline passes (timestep (B,))."""
    case = family_case(NAME, seed=3)
    sigmas = case.sigmas["latents"].reshape(1, -1)
    assert torch.equal(case.kwargs["timestep"], sigmas * 1000)
    assert case.kwargs["enable_diffusion_forcing"] is True and case.kwargs["fps"] == [1]
    t2v = _t2v_case()
    assert t2v.kwargs["timestep"].shape == (2,) and "enable_diffusion_forcing" not in t2v.kwargs


def _t2v_case(seed: int = 1) -> FamilyCase:
    """The tiny recipe's shapes with two samples and one sigma per sample (train.frame_sigmas: shared)."""
    spec, shapes = get_family(NAME), dict(tiny_recipe(NAME).data.synthetic.shapes)
    data = SyntheticLatentDataset(2, shapes, seed=seed, dtype=torch.float32)
    batch = {k: torch.stack([data[i][k] for i in range(2)]) for k in shapes}
    gen = torch.Generator().manual_seed(10_000 + seed)
    sigmas = objective.sample_stream_sigmas(2, spec, frame_sigmas="shared", generator=gen)
    noise = {"latents": objective.sample_noise(batch["latents"].shape, generator=gen)}
    noisy = {"latents": objective.add_noise(batch["latents"], noise["latents"], sigmas["latents"])}
    kwargs = spec.forward_kwargs(batch, noisy, sigmas, model_config=tiny_config(NAME), cp=True)
    return FamilyCase(spec, batch, noise, sigmas, noisy, kwargs)


def _parity(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel
    from train.cp.reduce import GradReduction

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    reduction = GradReduction("allreduce", cp_group=mesh["ulysses"].get_group())
    out = {}
    for label, case in (("t2v", _t2v_case()), ("df", family_case(NAME, seed=2))):
        serial = build_model(NAME, seed=0)
        family_loss(case, output_tensors(NAME, serial(**case.kwargs, return_dict=False)), serial.config).backward()
        model = build_model(NAME, seed=0)
        enable_context_parallel(model, mesh=mesh)
        loss = family_loss(case, output_tensors(NAME, model(**case.kwargs, return_dict=False)), model.config)
        loss.backward()
        reduction.reduce_gradients(model.parameters())
        ref = dict(serial.named_parameters())
        out[label] = max(
            ((p.grad - ref[n].grad).abs().max() / ref[n].grad.abs().max()).item()
            for n, p in model.named_parameters()
            if p.requires_grad
        )
    return out


def test_t2v_and_diffusion_forcing_match_serial_under_cp3() -> None:
    for rank_result in run_distributed(_parity, 3):
        assert rank_result["t2v"] <= 2e-5 and rank_result["df"] <= 2e-5, rank_result


def _train(recipe: Path, out: Path, nproc: int) -> list[dict]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu.yaml",
           "--num_processes", str(nproc), "train/finetune.py", "--recipe", str(recipe), f"--set=output_dir={out}",
           f"--set=parallel.cp={nproc}", "--set=train.max_steps=2", "--set=logging.wandb_mode=disabled",
           "--set=checkpoint.export=lora"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_recipe_cp3_matches_one_process_and_lora_loads(tmp_path: Path) -> None:
    recipe = REPO / "recipes" / "tiny" / f"{NAME}.yaml"
    serial, cp3 = _train(recipe, tmp_path / "cp1", 1), _train(recipe, tmp_path / "cp3", 3)
    assert [m["step"] for m in cp3] == [1, 2]
    for a, b in zip(cp3, serial):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), f"step {a['step']} {key}: {a} vs {b}"

    # The CP run's LoRA export loads into the diffusion-forcing pipeline with its trained values and scale.
    from diffusers import SkyReelsV2DiffusionForcingPipeline
    from safetensors.torch import load_file

    from train.models import build_tiny_pipeline

    pipe = SkyReelsV2DiffusionForcingPipeline.from_pretrained(build_tiny_pipeline(NAME, tmp_path / "pipe"))
    pipe.load_lora_weights(tmp_path / "cp3" / "lora")
    exported = load_file(tmp_path / "cp3" / "lora" / "pytorch_lora_weights.safetensors")
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert len(loaded) == len(exported) > 0
    for name, value in exported.items():  # transformer.blocks.0.attn1.to_q.lora_A.weight → ...lora_A.<adapter>.weight
        module, kind = name.removeprefix("transformer.").rsplit(".lora_", 1)
        match = [p for n, p in loaded.items() if n.startswith(module + ".lora_" + kind.split(".")[0] + ".")]
        assert len(match) == 1 and torch.equal(match[0], value), name
    lora_layer = pipe.transformer.blocks[0].attn1.to_q
    assert lora_layer.scaling[next(iter(lora_layer.scaling))] == 8.0 / 4
