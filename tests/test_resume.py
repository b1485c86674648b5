"""Resume is exact or refused: the checkpoint's recipe against the resuming one (train/resume.py), unit cases and
a resume with a new lr through the real entry point. The refusal through the entry point (one line naming each field,
exit code 2, the run untouched) is tests/test_bad_inputs.py's `resume_changed_model_and_lr`; exact resume at the same
and at another CP degree is tests/test_finetune.py's `test_resume_from_step_2_matches_the_uninterrupted_run`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.harness import REPO, train
from train.config import load_recipe, recipe_to_dict
from train.errors import UserError
from train.resume import APPLY, SAME, SCHEDULE, plan_resume, rule

TINY = "recipes/tiny/wan.yaml"
LAYOUT = {"dp_replicate": 1, "dp_shard": 1, "cp": 2}


def _recipe(*sets: str) -> dict:
    return recipe_to_dict(load_recipe(REPO / TINY, list(sets)))


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


# The serial tiny-wan LoRA run (4 steps, a checkpoint after each, the last 3 kept) that tests/test_finetune.py and
# tests/test_bad_inputs.py share: identical overrides, one run per session.
SERIAL = ("parallel.cp=1", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3")


def test_resume_with_a_new_lr_and_reset_schedule(runs, tmp_path: Path) -> None:
    """A copy of the serial run with only its step-2 checkpoint resumes with a new lr and `--reset-lr-schedule`: the
    new lr applies from the resume step (it was silently ignored); the applied change is printed."""
    out = tmp_path / "lr"
    shutil.copytree(runs(TINY, *SERIAL).out, out)
    for later in ("step_000003", "step_000004"):
        shutil.rmtree(out / "checkpoints" / later)
    run = train(out, TINY, *SERIAL, "train.lr=0.01", "logging.every_n_steps=1", resume=True,
                extra=["--reset-lr-schedule"])  # fmt: skip
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4]
    assert [m["lr"] for m in run.metrics] == [0.001, 0.001, 0.01, 0.01]
    assert "resume: train.lr: 0.001 -> 0.01 (schedule restarted at the resume step)" in run.stdout


@pytest.mark.parametrize(
    "before, after, refused",
    [
        ({"fraction": 0.25}, {"cache_dir": "/held"}, True),  # the held-out samples would train
        ({"cache_dir": "/held"}, {"fraction": 0.25}, True),  # trained samples would be "held out"
        (None, {"fraction": 0.1}, True),  # a split appears: its samples leave training
        ({"fraction": 0.25}, None, True),  # the split is dropped: its samples train
        ({"fraction": 0.25}, {"fraction": 0.5}, True),
        (None, {"cache_dir": "/held"}, False),  # a cache of its own: training unchanged
        ({"cache_dir": "/held"}, {"cache_dir": "/other"}, False),
        ({"fraction": 0.25}, {"fraction": 0.25, "max_samples": 1, "every_n_steps": 7}, False),  # evaluation only
    ],
)
def test_a_resume_that_changes_the_held_out_split_is_refused(before, after, refused: bool) -> None:
    """The held-out split is part of what trains: a resume that changes it (or adds or drops it) is refused in one
    line naming it; adding or changing a held-out cache of its own, or evaluation knobs, applies."""

    def recipe(held):
        sets = [] if held is None else [f"validation_loss={held}"]
        return recipe_to_dict(load_recipe(REPO / "recipes/tiny/wan.yaml", sets))

    layout = {"dp_replicate": 1, "dp_shard": 1, "cp": 1}
    args = dict(reset_lr_schedule=False, saved_layout=layout, layout=layout, checkpoint="step_000004")
    if not refused:
        plan_resume(recipe(before), recipe(after), **args)
        return
    with pytest.raises(UserError) as e:
        plan_resume(recipe(before), recipe(after), **args)
    assert "the held-out split: " in str(e.value) and "\n" not in str(e.value), e.value
