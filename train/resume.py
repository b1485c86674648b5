"""Resume is exact or refused: the recipe a checkpoint was trained with against the one resuming it, field by field.

Every recipe field falls in one class (a table, by dotted-path prefix; the longest prefix wins):

- `same`: must not change — the model and what is trained (shapes, adapters, weights), the data and the batch layout
  (samples per step, order, seed). A change cannot continue the same run; it is refused, naming each field.
- `schedule`: the learning-rate schedule (lr, schedule, warmup, and max_steps when the schedule decays). The restored
  optimizer and scheduler would silently keep the old values; a change needs `--reset-lr-schedule`, which starts the
  new schedule (warmup included) at the resume step over the remaining steps.
- `apply`: takes effect from the next step, exactly as if the run had been launched with it (logging, checkpoint
  cadence, memory levers, parallel layout, optimizer hyper-parameters other than lr, the objective's knobs); printed.

A changed data-parallel size is allowed (resuming on another number of processes works) and said: the global batch
(batch_size × dp) and the sample order change from the resume step.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import UserError

SAME, SCHEDULE, APPLY = "same", "schedule", "apply"
RULES: dict[str, str] = {
    "model": SAME,
    "model.attention_backend": APPLY,  # the same attention, another kernel
    "model.sharded_load": APPLY,
    "model.cp_plan": APPLY,
    "finetune": SAME,
    "data": SAME,
    "data.num_workers": APPLY,
    "data.max_bad_fraction": APPLY,  # train.prepare only
    "data.text_encoder_dtype": APPLY,  # train.prepare only
    "data.datasets.*.caption_dropout": APPLY,  # (`*`: any list item) drawn per step, as train.caption_dropout
    "train": APPLY,
    "train.batch_size": SAME,
    "train.batch_tokens": SAME,
    "train.grad_accum": SAME,
    "train.seed": SAME,
    "train.optimizer": SAME,  # another optimizer's state (quantized or not) cannot be restored into this one's
    "train.master_weights": SAME,
    "train.lr": SCHEDULE,
    "train.lr_schedule": SCHEDULE,
    "train.warmup_steps": SCHEDULE,
    "parallel": APPLY,
    "logging": APPLY,
    "checkpoint": APPLY,
    "validation": APPLY,  # samples only: no training state
    "ema": SAME,  # its average is in the checkpoint: it cannot start, stop or change its rule mid-run
    "ema.validation": APPLY,
    "validation_loss": APPLY,  # evaluation only
    "validation_loss.fraction": APPLY,  # which samples train: compared as the split (`held_out_split`) instead
    "output_dir": APPLY,
    "name": APPLY,
}


def rule(path: str) -> str:
    """The class of a dotted recipe path: its longest prefix in RULES (unlisted sections: same, to be safe); a list
    item's index matches `*`."""
    parts = ["*" if p.isdigit() else p for p in path.split(".")]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RULES:
            return RULES[".".join(parts[:n])]
    return SAME


def _leaves(d: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(d, Mapping) and not (prefix.endswith("init_config") or prefix.endswith("shapes")):
        for k, v in d.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(d, list) and d and all(isinstance(x, Mapping) for x in d):  # data.datasets: a rule per field
        for i, x in enumerate(d):
            yield from _leaves(x, f"{prefix}.{i}")
    else:
        yield prefix, d


def _changes(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    a, b = dict(_leaves(saved)), dict(_leaves(new))
    return [(k, a.get(k, "<unset>"), b.get(k, "<unset>")) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


def held_out_split(recipe: Mapping[str, Any]) -> str | None:
    """The part of the training cache held out of training (train/heldout.py `split`), as words: None when nothing
    is (no validation_loss, or a cache of its own). With train.seed (compared as `same`) it decides which samples
    train."""
    held = recipe.get("validation_loss")
    if held is None or held.get("cache_dir") is not None:
        return None
    return f"validation_loss.fraction {held.get('fraction')} of the training cache"


@dataclass
class ResumePlan:
    """What resuming with a new recipe does: `applied` lines to print, `reset_schedule` when the lr schedule restarts,
    `notes` on the layout."""

    applied: list[str] = field(default_factory=list)
    reset_schedule: bool = False
    notes: list[str] = field(default_factory=list)


def plan_resume(
    saved: Mapping[str, Any], new: Mapping[str, Any], *, reset_lr_schedule: bool, saved_layout: Mapping[str, int],
    layout: Mapping[str, int], checkpoint: str,
) -> ResumePlan:  # fmt: skip
    """Compare the checkpoint's recipe with the resuming one; raise UserError listing every change that cannot apply
    exactly. Pure: the same answer on every rank, before any collective."""
    plan, refused, schedule = ResumePlan(), [], []
    decays = new.get("train", {}).get("lr_schedule", "constant") != "constant"
    for path, old, value in _changes(saved, new):
        kind = rule(path)
        if path == "train.max_steps" and decays:
            kind = SCHEDULE  # linear/cosine decay is stretched over max_steps: the lr curve would change
        change = f"{path}: {old!r} -> {value!r}"
        if kind == SAME:
            refused.append(change)
        elif kind == SCHEDULE:
            schedule.append(change)
        else:
            plan.applied.append(change)
    if (was := held_out_split(saved)) != (now := held_out_split(new)):
        refused.append(f"the held-out split: {was or 'none'} -> {now or 'none'} (it decides which samples train: "
                       "samples held out would be trained on, or trained ones held out; a validation_loss.cache_dir "
                       "of its own can be added or changed at resume)")  # fmt: skip
    if schedule and not reset_lr_schedule:
        refused += [f"{c} (the restored optimizer/scheduler would keep the old schedule; pass --reset-lr-schedule to "
                    "restart it from the resume step)" for c in schedule]  # fmt: skip
    if refused:
        raise UserError(f"cannot resume {checkpoint} with this recipe: {'; '.join(refused)}. Resume with the recipe "
                        "it was trained with (its copy is in the checkpoint), or start a new run in another "
                        "output_dir")  # fmt: skip
    if schedule:
        plan.reset_schedule = True
        plan.applied += [f"{c} (schedule restarted at the resume step)" for c in schedule]
    dp = layout["dp_replicate"] * layout["dp_shard"]
    saved_dp = saved_layout["dp_replicate"] * saved_layout["dp_shard"]
    if dp != saved_dp:
        plan.notes.append(f"data-parallel size {saved_dp} -> {dp}: from the resume step each optimizer step takes "
                          f"{dp} × batch_size samples instead of {saved_dp} × and the sample order differs from the "
                          "uninterrupted run's")  # fmt: skip
    elif layout["cp"] != saved_layout["cp"]:
        plan.notes.append(f"cp {saved_layout['cp']} -> {layout['cp']}: same samples and order (CP only splits them)")
    return plan
