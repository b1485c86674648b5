"""Every discovered family, end to end with its tiny pipeline: media → `train.prepare` (its own VAE / text encoders) →
the trainer under CP 2 from that cache, matching the single-process run step by step (loss, grad_norm within 1e-5).

Clip sizes come from the family's own size rules (its encoder's `geometry`, read from the tiny pipeline's configs):
the smallest valid frame count from 5 up, sides of 32 x 48 rounded up to the spatial multiple; families that denoise
an audio stream get clips with a soundtrack, editing families a reference image per item."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train.config import recipe_from_dict
from train.data.synthetic_media import make_media_set
from train.models import build_tiny_pipeline, family_names, get_encoder, get_family
from train.prepare import prepare

REPO = Path(__file__).resolve().parents[1]
REL_TOL = 1e-5


def _train(recipe: Path, out: Path, nproc: int) -> list[dict]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu.yaml",
           "--num_processes", str(nproc), "train/finetune.py", "--recipe", str(recipe), f"--set=output_dir={out}",
           f"--set=parallel.cp={nproc}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@pytest.mark.parametrize("family", family_names())
def test_family_prepares_and_trains_under_cp2(family: str, tmp_path: Path) -> None:
    spec, encoder = get_family(family), get_encoder(family)
    pipeline = build_tiny_pipeline(family, tmp_path / "pipe")
    geometry = encoder.geometry(str(pipeline))
    video = spec.latent_kind == "video"
    frames = next(f for f in range(5, 100) if f % geometry.frame_period == geometry.frame_offset) if video else 1
    height, width = _round_up(32, geometry.spatial_multiple), _round_up(48, geometry.spatial_multiple)
    sound = "audio_latents" in spec.streams  # MiniMax-H3: clips with a soundtrack
    fps = 24.0  # MiniMax-H3's fixed rate; any rate for the others
    media = tmp_path / "media"
    make_media_set(media, num_videos=3 if video else 1, num_images=0 if video else 2, frames=max(frames, 9),
                   height=height, width=width, fps=fps, audio=sound,
                   references=encoder.needs_reference)  # fmt: skip
    recipe = {
        "model": {"family": family, "pretrained_path": str(pipeline), "dtype": "float32"},
        "data": {"source": str(media), "cache_dir": str(tmp_path / "cache"), "height": height, "width": width,
                 "num_frames": frames, "fps": fps, "max_text_tokens": None if encoder.fixed_text_tokens else 16},
        "train": {"max_steps": 3, "batch_size": 1, "lr": 1e-3, "seed": 0, "mixed_precision": "no"},
        "finetune": {"method": "lora", "lora_rank": 4, "lora_alpha": 4.0},
        "logging": {"wandb_mode": "disabled", "progress_bar": False},
        "checkpoint": {"export": "none"},
    }  # fmt: skip
    manifest = prepare(recipe_from_dict(recipe), log=lambda _: None)
    assert manifest["counts"]["ok"] == 3 and manifest["counts"]["bad"] == 0
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    serial, cp2 = _train(path, tmp_path / "cp1", 1), _train(path, tmp_path / "cp2", 2)
    assert [m["step"] for m in cp2] == [1, 2, 3]
    for a, b in zip(cp2, serial):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= REL_TOL * abs(b[key]), f"{family} step {a['step']} {key}: {a} vs {b}"
