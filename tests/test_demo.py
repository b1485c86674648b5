"""The README demo, end to end on CPU: media → cached latents (the demo recipe's tiny pipeline, Wan) → CP 2 training
whose loss falls. Every step reads recipes/demo.yaml: `python -m train.demo --recipe ...` and `python -m
train.prepare --recipe ...` with launch/demo.sh's arguments (their `main`, in this process), then the trainer on 2
ranks (the harness's warm ranks: the launch path to a run's end is tests/test_launch.py's two nodes) with wandb
offline (as the demo runs it)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from tests.harness import REPO, train

DEMO = REPO / "recipes/demo.yaml"


def _cli(module: str, capsys: pytest.CaptureFixture, *args: str) -> str:
    """`python -m <module> <args>` in this process: the module's `main(argv)`; what it printed."""
    capsys.readouterr()
    importlib.import_module(module).main(list(args))
    return capsys.readouterr().out


def test_demo_media_to_cache_to_cp_training(tmp_path: Path, launcher, capsys: pytest.CaptureFixture) -> None:
    assets, cache = tmp_path / "assets", tmp_path / "cache"
    paths = [f"model.pretrained_path={assets / 'pipeline'}", f"data.source={assets / 'media'}",
             f"data.cache_dir={cache}"]  # fmt: skip
    sets = [f"--set={p}" for p in paths]
    out = _cli("train.demo", capsys, "--recipe", str(DEMO), *sets)  # the family and sizes of the recipe
    assert "tiny wan pipeline" in out and (assets / "pipeline" / "model_index.json").exists()
    out = _cli("train.prepare", capsys, "--recipe", str(DEMO), *sets)
    assert "16 ok" in out and "0 bad" in out
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["family"] == "wan" and len(list((cache / "samples").glob("*.safetensors"))) == 16
    run = train(tmp_path / "run", "recipes/demo.yaml", *paths, "logging.wandb_mode=offline", nproc=2)
    losses = [m["loss"] for m in run.metrics]
    assert len(losses) == 100
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 0.2, f"the demo loss did not fall: first 10 steps {first:.3f}, last 10 {last:.3f}"
    assert (run.out / "transformer" / "config.json").exists()
    # the demo's validation samples (train/validation.py; decoded and compared in tests/test_validation.py) + report
    samples = {p.relative_to(run.out / "samples").as_posix() for p in (run.out / "samples").glob("step_*/*.mp4")}
    assert samples == {f"step_{s}/{i}.mp4" for s in (0, 50, 100) for i in (0, 1)}
    assert (run.out / "report.md").is_file() and len(list((run.out / "report").glob("*.png"))) == 5
    # the offline wandb run holds the same samples and the report's charts as logged media
    (wandb_run,) = (run.out / "wandb").glob("offline-run-*")
    media = wandb_run / "files" / "media"
    assert len(list((media / "videos" / "validation").glob("*.mp4"))) == 6
    assert len(list((media / "images" / "report").glob("*.png"))) == 5
    assert json.loads((run.out / "layout.json").read_text())["gradient_reduction"].startswith("fsdp2: SUM over cp=2")
