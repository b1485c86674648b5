"""The run report (train/report.py): written by the trainer at the end of a run, from the files the run wrote.

One tiny CP 2 run with wandb offline (4 steps; the session's shared launch, tests/test_finetune.py's CP 2 LoRA run):
its output_dir holds report.md and the charts, the report's numbers are those of metrics.jsonl, memory.json and the
layout, `python -m train.report` rewrites the same report, and the wandb offline run holds the same chart images
under files/media/.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

CHARTS = {"loss", "grad_norm", "lr", "tokens_per_s", "peak_memory"}


# The CP 2 tiny-wan LoRA run with wandb offline (4 steps, a checkpoint after each) that tests/test_finetune.py and
# tests/test_validation.py share: identical overrides, one run per session.
CP2 = ("parallel.cp=2", "logging.wandb_mode=offline", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3")


@pytest.fixture
def run(runs) -> Path:
    done = runs("recipes/tiny/wan.yaml", *CP2, nproc=2)
    assert f"report: {done.out / 'report.md'} (5 charts" in done.stdout
    return done.out


def _rows(md: str) -> dict[str, str]:
    return dict(re.findall(r"^\| (.+?) \| (.+?) \|$", md, flags=re.M))


def test_report_numbers_are_the_runs(run: Path) -> None:
    from train.config import load_recipe
    from train.estimate import estimate

    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    rows = _rows((run / "report.md").read_text())
    last = lines[-1]
    assert last["step"] == 4
    assert math.isclose(float(rows["final loss (step 4)"]), last["loss"], rel_tol=1e-5)
    assert math.isclose(float(rows["first loss (step 1)"]), lines[0]["loss"], rel_tol=1e-5)
    assert math.isclose(float(rows["final grad norm (step 4)"]), last["grad_norm"], rel_tol=1e-5)
    assert rows["steps logged"].startswith("4 (steps 1-4 of max_steps 4")
    assert rows["world size"] == "2" and rows["dp_replicate × dp_shard × cp"] == "1 × 1 × 2"
    assert rows["cp plan"].endswith("cp_plans/wan.yaml")
    tps = sum(m["transformer_tokens_per_s"] for m in lines[1:]) / 3
    assert math.isclose(float(rows["transformer tokens/s, whole job (mean of steps 2-4)"]), tps, rel_tol=1e-5)
    peak = max(m["peak_mem_bytes"] for m in lines)
    assert rows["measured peak, rank 0"].startswith(f"{peak / 2**30:.2f} GiB")

    # The prediction recorded at startup is train.estimate's for this recipe and world size, as printed then.
    memory = json.loads((run / "memory.json").read_text())
    assert memory["world_size"] == 2 and memory["device_type"] == "cpu"
    assert memory["predicted_peak_bytes"] == estimate(load_recipe(run / "recipe.yaml"), 2, "cpu").peak
    assert memory["startup_check"] == f"predicted peak per rank {memory['predicted_peak_bytes'] / 2**20:.1f} MiB"
    assert rows["predicted peak per rank (train.estimate at startup)"] == memory["startup_check"].split()[-2] + " MiB"
    assert rows["exported weights"].startswith(f"`{run / 'lora'}` (lora") and (run / "lora").is_dir()


def test_charts_are_pngs_and_the_cli_rewrites_the_same_report(run: Path) -> None:
    import matplotlib.image as mpimg

    from train import report

    charts = sorted((run / "report").glob("*.png"))
    assert {c.stem for c in charts} == CHARTS
    for c in charts:
        pixels = mpimg.imread(c)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 0  # something is drawn
    md = (run / "report.md").read_text()
    assert all(f"![{c.stem}](report/{c.name})" in md for c in charts)
    assert report.main([str(run)]) == 0
    assert (run / "report.md").read_text() == md


def test_wandb_offline_run_holds_the_charts(run: Path) -> None:
    """With wandb on, the charts are logged as images at the last step: the offline run folder's files/media/ holds
    the same PNG bytes."""
    (wandb_run,) = (run / "wandb").glob("offline-run-*")
    media = sorted((wandb_run / "files" / "media" / "images" / "report").glob("*.png"))
    names = {m.name.split("_4_")[0] for m in media}  # <key>_<step>_<hash>.png
    assert names == CHARTS, media
    for m in media:
        assert m.read_bytes() == (run / "report" / (m.name.split("_4_")[0] + ".png")).read_bytes()


def test_report_failure_is_one_line_not_an_error(tmp_path: Path, capsys) -> None:
    from train.report import main, report_at_end, smooth

    assert report_at_end(tmp_path) == []  # no metrics.jsonl: the trainer's run still succeeds
    assert capsys.readouterr().out.startswith(f"report: not written (UserError: {tmp_path / 'metrics.jsonl'}")
    assert main([str(tmp_path)]) == 2
    capsys.readouterr()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert main([str(tmp_path)]) == 2  # a folder that is not a run's: one line, no traceback
    assert (
        capsys.readouterr().err == f"error: {tmp_path} has no recipe.yaml (a run writes it at its start): is it a "
        "training run's output_dir?\n"
    )
    # The smoothed loss: a debiased EMA (a constant stays constant), skipped (non-finite) steps passed through.
    assert smooth([2.0, 2.0, math.nan, 2.0]) == pytest.approx([2.0, 2.0, math.nan, 2.0], nan_ok=True)


def test_a_torn_last_metrics_line_is_left_out_and_a_damaged_one_named(tmp_path: Path) -> None:
    """A run killed while writing metrics.jsonl leaves its last line torn: the report and `--resume`
    (`MetricsLogger.truncate_after`) leave it out and say so; a damaged line before the last is one line naming it."""
    from train.errors import UserError
    from train.report import read_metrics

    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2)]
    path.write_text("\n".join(good) + '\n{"step": 3, "lo')
    lines, note = read_metrics(path)
    assert [m["step"] for m in lines] == [
        1,
        2,
    ] and note == f"{path}: its last line (3) is torn (a run stopped while writing it): left out"
    path.write_text(f"{good[0]}\nnot json\n{good[1]}\n")
    with pytest.raises(UserError, match=r"metrics.jsonl, line 2: not a metrics line .*restore it, or delete that line"):
        read_metrics(path)
