"""The README demo, end to end on CPU: media → cached latents (the demo recipe's tiny pipeline, Wan) → CP 2 training
whose loss falls. Every step reads recipes/demo.yaml (`python -m train.demo --recipe ...` included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def test_demo_media_to_cache_to_cp_training(tmp_path: Path) -> None:
    assets, cache, run = tmp_path / "assets", tmp_path / "cache", tmp_path / "run"
    paths = [f"--set=model.pretrained_path={assets / 'pipeline'}", f"--set=data.source={assets / 'media'}",
             f"--set=data.cache_dir={cache}"]  # fmt: skip
    out = _run("-m", "train.demo", "--recipe", "recipes/demo.yaml", *paths)  # the family and sizes of the recipe
    assert "tiny wan pipeline" in out and (assets / "pipeline" / "model_index.json").exists()
    out = _run("-m", "train.prepare", "--recipe", "recipes/demo.yaml", *paths)
    assert "16 ok" in out and "0 bad" in out
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["family"] == "wan" and len(list((cache / "samples").glob("*.safetensors"))) == 16
    # wandb as the demo runs it (offline)
    _run("-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu.yaml", "--num_processes", "2",
         "train/finetune.py", "--recipe", "recipes/demo.yaml", *paths, f"--set=output_dir={run}",
         "--set=logging.progress_bar=false")  # fmt: skip
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 100
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 0.2, f"the demo loss did not fall: first 10 steps {first:.3f}, last 10 {last:.3f}"
    assert (run / "transformer" / "config.json").exists()
    # the demo's validation samples (train/validation.py; decoded and compared in tests/test_validation.py) + report
    samples = {p.relative_to(run / "samples").as_posix() for p in (run / "samples").glob("step_*/*.mp4")}
    assert samples == {f"step_{s}/{i}.mp4" for s in (0, 50, 100) for i in (0, 1)}
    assert (run / "report.md").is_file() and len(list((run / "report").glob("*.png"))) == 5  # report.md + its plots
    # the offline wandb run holds the same samples and the report's charts as logged media
    (wandb_run,) = (run / "wandb").glob("offline-run-*")
    media = wandb_run / "files" / "media"
    assert len(list((media / "videos" / "validation").glob("*.mp4"))) == 6
    assert len(list((media / "images" / "report").glob("*.png"))) == 5
    assert json.loads((run / "layout.json").read_text())["gradient_reduction"].startswith("fsdp2: SUM over cp=2")
