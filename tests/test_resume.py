"""Resume is exact or refused: the checkpoint's recipe against the resuming one (train/resume.py), unit cases and
through the real entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_finetune import REPO, launch, metrics
from train.config import load_recipe, recipe_to_dict
from train.errors import UserError
from train.resume import APPLY, SAME, SCHEDULE, plan_resume, rule

LAYOUT = {"dp_replicate": 1, "dp_shard": 1, "cp": 2}


def _recipe(*sets: str) -> dict:
    return recipe_to_dict(load_recipe(REPO / "recipes/tiny/wan.yaml", list(sets)))


def _plan(saved: dict, new: dict, reset: bool = False, layout: dict = LAYOUT):
    return plan_resume(saved, new, reset_lr_schedule=reset, saved_layout=LAYOUT, layout=layout, checkpoint="ckpt")


def test_every_recipe_field_has_a_rule() -> None:
    leaves = {"model.init_config": SAME, "model.attention_backend": APPLY, "finetune.lora_rank": SAME,
              "train.batch_size": SAME, "train.lr": SCHEDULE, "train.max_steps": APPLY, "parallel.cp": APPLY,
              "data.synthetic.shapes": SAME, "logging.every_n_steps": APPLY,
              "checkpoint.every_n_steps": APPLY}  # fmt: skip
    assert {k: rule(k) for k in leaves} == leaves


def test_changes_that_cannot_apply_are_refused_naming_each_field() -> None:
    saved = _recipe()
    with pytest.raises(UserError) as e:
        _plan(saved, _recipe("model.init_config.num_layers=1", "finetune.lora_rank=8", "train.batch_size=1"))
    msg = str(e.value)
    assert "\n" not in msg
    for field in ("model.init_config", "finetune.lora_rank: 4 -> 8", "train.batch_size: 2 -> 1"):
        assert field in msg, (field, msg)


def test_schedule_changes_need_the_flag_and_restart_the_schedule() -> None:
    saved = _recipe()
    with pytest.raises(UserError, match="--reset-lr-schedule"):
        _plan(saved, _recipe("train.lr=0.01"))
    plan = _plan(saved, _recipe("train.lr=0.01"), reset=True)
    assert plan.reset_schedule and any("train.lr: 0.001 -> 0.01" in a for a in plan.applied)
    # max_steps: applies with a constant schedule, is a schedule change when the schedule decays over it
    assert _plan(saved, _recipe("train.max_steps=8")).applied == ["train.max_steps: 4 -> 8"]
    decaying = _recipe("train.lr_schedule=cosine")
    with pytest.raises(UserError, match="train.max_steps"):
        _plan(decaying, _recipe("train.lr_schedule=cosine", "train.max_steps=8"))


def test_applied_changes_and_layout_notes() -> None:
    saved = _recipe()
    plan = _plan(saved, _recipe("logging.every_n_steps=2", "train.gradient_checkpointing=true", "parallel.cp=1"),
                 layout={"dp_replicate": 1, "dp_shard": 2, "cp": 1})  # fmt: skip
    assert not plan.reset_schedule
    assert {a.split(":")[0] for a in plan.applied} == {"logging.every_n_steps", "train.gradient_checkpointing",
                                                       "parallel.cp"}  # fmt: skip
    assert len(plan.notes) == 1 and "data-parallel size 1 -> 2" in plan.notes[0]
    assert "same samples and order" in _plan(saved, saved, layout={**LAYOUT, "cp": 1}).notes[0]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> Path:
    """A 1-process run stopped after 2 of 4 steps with a checkpoint at step 2 (copied per test)."""
    out = tmp_path_factory.mktemp("resume") / "base"
    launch(out, 1, "recipes/tiny/wan.yaml", *COMMON, "train.max_steps=2")
    return out


COMMON = ("logging.wandb_mode=disabled", "parallel.cp=1", "checkpoint.every_n_steps=2", "checkpoint.keep_last=1")


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_resume_refuses_a_changed_model_in_one_line(two_steps: Path, tmp_path: Path) -> None:
    """A LoRA checkpoint resumed onto a model with fewer layers used to drop adapters silently (exit 0)."""
    out = _copy(two_steps, tmp_path / "fewer")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu.yaml",
           "--num_processes", "1", "train/finetune.py", "--recipe", "recipes/tiny/wan.yaml", "--resume",
           *[a for o in (*COMMON, f"output_dir={out}", "train.max_steps=4", "model.init_config.num_layers=1",
                         "train.lr=0.01") for a in ("--set", o)]]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode != 0, proc.stderr[-2000:]  # the rank exits 2; the launcher reports it as a failure
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "model.init_config" in errors[0] and "train.lr" in errors[0], errors
    assert [m["step"] for m in metrics(out)] == [1, 2]


def test_resume_with_a_new_lr_and_reset_schedule(two_steps: Path, tmp_path: Path) -> None:
    """The new lr applies from the resume step (it was silently ignored); other applied changes are printed."""
    out = _copy(two_steps, tmp_path / "lr")
    proc = launch(out, 1, "recipes/tiny/wan.yaml", *COMMON, "train.max_steps=4", "train.lr=0.01",
                  "logging.every_n_steps=1", resume=True, extra=["--reset-lr-schedule"])  # fmt: skip
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert [m["lr"] for m in lines] == [0.001, 0.001, 0.01, 0.01]
    assert "resume: train.lr: 0.001 -> 0.01 (schedule restarted at the resume step)" in proc.stdout
