"""One run's state per output_dir, by construction.

A run's identity is `<output_dir>/run.json` (an id, when and where it started, the recipe's name): written when a run
starts fresh, kept when it resumes; every checkpoint records the id in its trainer.json. At startup, `claim` (rank 0,
under the output_dir's lock: `runtime.lock_output_dir`) decides, before anything is written there:

- a fresh run into a folder holding a run's state (checkpoints, logged steps, exported weights, validation samples)
  is refused with one line naming what is there, unless `--archive-previous` first moves that run's files into
  `<output_dir>/archive/<its id>/`;
- `--resume` continues the run recorded there, from its newest checkpoint; with no checkpoint to resume from it is
  refused. The recipe's `checkpoint.resume: true` (for requeued jobs) resumes when there is a checkpoint and starts
  fresh otherwise, under the rule above;
- a checkpoint another run wrote (another id in its trainer.json) is never loaded: the resume is refused, naming it.

A folder written before runs had an identity (no run.json, checkpoints without an id) is one run: resuming it adopts
it (run.json is written, its checkpoints stay loadable).
"""

from __future__ import annotations

import json
import shutil
import socket
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from train.checkpoint import TRAINER_STATE, checkpoint_root, complete_checkpoints
from train.errors import UserError

RUN_FILE = "run.json"
ARCHIVE = "archive"
# A run's state: what a fresh run would overwrite, truncate or mix with its own.
EXPORTS = ("transformer", "lora", "transformer_ema", "lora_ema")
# Everything a run writes into its output_dir (moved together by --archive-previous; the lock stays).
RUN_FILES = ("checkpoints", "metrics.jsonl", *EXPORTS, "samples", "wandb", "report", "report.md", "layout.json",
             "recipe.yaml", "memory.json", "stopped.json", RUN_FILE)  # fmt: skip
Resume = Literal["no", "auto", "required"]


@dataclass
class Held:
    """What an output_dir holds of a run."""

    run: dict | None
    checkpoints: list[Path] = field(default_factory=list)  # step_* folders, complete or not
    complete: list[Path] = field(default_factory=list)
    steps_logged: int = 0
    exports: list[str] = field(default_factory=list)
    samples: bool = False

    @property
    def has_state(self) -> bool:
        return bool(self.checkpoints or self.steps_logged or self.exports or self.samples)

    def describe(self) -> str:
        run = self.run or {}
        who = f"run {run['id']} (started {run.get('started', '?')})" if "id" in run else "a run with no run.json"
        held = []
        if self.checkpoints:
            newest = self.complete[-1].name if self.complete else "none complete"
            held.append(f"{len(self.checkpoints)} checkpoint(s), newest {newest}")
        if self.steps_logged:
            held.append(f"{self.steps_logged} logged step(s) in metrics.jsonl")
        held += [f"exported {name}/" for name in self.exports]
        if self.samples:
            held.append("validation samples")
        return f"{who}: {', '.join(held)}"


def _logged_steps(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text(errors="replace").splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def inspect(out_dir: Path) -> Held:
    try:
        run = json.loads((out_dir / RUN_FILE).read_text())
    except FileNotFoundError:
        run = None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{out_dir / RUN_FILE}: not readable ({e}); the file is damaged: restore it, or move the "
                        "output_dir's run away and start fresh") from None  # fmt: skip
    root = checkpoint_root(out_dir)
    return Held(
        run=run,
        checkpoints=sorted(root.glob("step_*")) if root.is_dir() else [],
        complete=complete_checkpoints(out_dir),
        steps_logged=_logged_steps(out_dir / "metrics.jsonl"),
        exports=[name for name in EXPORTS if (out_dir / name).is_dir() and any((out_dir / name).iterdir())],
        samples=(out_dir / "samples").is_dir() and any((out_dir / "samples").iterdir()),
    )


def _run_id_of(checkpoint: Path) -> str | None:
    """The id in a checkpoint's trainer.json; None for one written before runs had ids, or unreadable (restore()
    verifies it and falls back with its own message)."""
    try:
        return json.loads((checkpoint / TRAINER_STATE).read_text()).get("run_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None


def _new_run(out_dir: Path, name: str | None, **extra: bool) -> dict:
    run = {"id": uuid.uuid4().hex[:12], "started": datetime.now(UTC).isoformat(timespec="seconds"),
           "host": socket.gethostname(), "name": name, **extra}  # fmt: skip
    (out_dir / f"{RUN_FILE}.tmp").write_text(json.dumps(run, indent=1))
    (out_dir / f"{RUN_FILE}.tmp").rename(out_dir / RUN_FILE)
    return run


def archive(out_dir: Path, held: Held) -> Path:
    """Move the run's files into `<out_dir>/archive/<id or time>/` (renames: no copy)."""
    key = (held.run or {}).get("id") or datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    target = out_dir / ARCHIVE / key
    if target.exists():
        target = target.with_name(f"{key}-{uuid.uuid4().hex[:6]}")
    target.mkdir(parents=True)
    for name in RUN_FILES:
        if (out_dir / name).exists() or (out_dir / name).is_symlink():
            shutil.move(str(out_dir / name), str(target / name))
    return target


def claim(out_dir: Path, resume: Resume, archive_previous: bool, name: str | None) -> dict:
    """Rank 0, under the output_dir's lock: {"run": this run's identity, "resume": whether to restore its newest
    checkpoint, "note": a line to print or None}, or a UserError (see the module docstring)."""
    held, note = inspect(out_dir), None
    if resume != "no" and held.complete:
        run = held.run
        if run is None:  # written before runs had an identity: adopted as the one run it is
            if any(_run_id_of(c) is not None for c in held.complete):
                raise UserError(f"{out_dir} has checkpoints of an identified run but no {RUN_FILE} (moved or "
                                "deleted?): restore it, or start a fresh run in another output_dir")  # fmt: skip
            run = _new_run(out_dir, name, adopted=True)
            note = f"resume: adopted {out_dir}'s checkpoints (written before runs had an identity) as run {run['id']}"
        ids = {None, run["id"]} if run.get("adopted") else {run["id"]}
        foreign = [c.name for c in held.complete if _run_id_of(c) not in ids and (c / TRAINER_STATE).exists()]
        if foreign:
            raise UserError(f"{checkpoint_root(out_dir)} holds checkpoints of another run ({', '.join(foreign)}: not "
                            f"run {run['id']}'s, recorded in {RUN_FILE}): move them away to resume, or start a fresh "
                            "run in another output_dir")  # fmt: skip
        return {"run": run, "resume": True, "note": note}
    if resume == "required":
        why = f"it holds {held.describe()}" if held.has_state else "it holds no run"
        raise UserError(f"--resume: nothing to resume in {out_dir} (no complete checkpoint; {why}); drop --resume to "
                        "start a fresh run, or point output_dir at the run to continue")  # fmt: skip
    if held.has_state:
        if not archive_previous:
            how = "resume it (--resume), " if held.complete else ""
            raise UserError(f"output_dir {out_dir} holds {held.describe()}; {how}choose another output_dir, or pass "
                            "--archive-previous to move that run into output_dir/archive/ first")  # fmt: skip
        note = f"archived the previous run's files into {archive(out_dir, held)}"
    return {"run": _new_run(out_dir, name), "resume": False, "note": note}
