"""One run's state per output_dir (train/rundir.py `claim`): what a run may do with a folder, decided before anything
is written there. In-process, on folders laid out as the trainer writes them (run.json, checkpoints/step_*/ with
trainer.json and COMPLETE, metrics.jsonl, exports). Through the trainer's ranks (the refusal as one line on every rank,
the finished run's files untouched) and the export fault tests: tests/test_finetune.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from train.errors import UserError
from train.rundir import RUN_FILE, claim, inspect


def _run(out: Path, run_id: str | None = "r1", steps: int = 4, checkpoints: tuple[int, ...] = (2, 4),
         exported: bool = True) -> Path:  # fmt: skip
    """A finished run's folder: run.json (unless `run_id` is None: a folder from before runs had ids), metrics
    lines, complete checkpoints recording `run_id`, a LoRA export."""
    out.mkdir(parents=True, exist_ok=True)
    if run_id is not None:
        (out / RUN_FILE).write_text(json.dumps({"id": run_id, "started": "2026-11-30T10:00:00+00:00"}))
    lines = [json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, steps + 1)]
    (out / "metrics.jsonl").write_text("".join(lines))
    for step in checkpoints:
        ckpt = out / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        state = {"step": step} if run_id is None else {"run_id": run_id, "step": step}
        (ckpt / "trainer.json").write_text(json.dumps(state))
        (ckpt / "COMPLETE").touch()
    if exported:
        (out / "lora").mkdir()
        (out / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
    return out


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_an_empty_folder_starts_a_fresh_run_with_an_identity(tmp_path: Path) -> None:
    got = claim(tmp_path, "no", False, "tiny")
    assert got["resume"] is False and got["note"] is None
    assert json.loads((tmp_path / RUN_FILE).read_text()) == got["run"] and got["run"]["name"] == "tiny"
    (tmp_path / "new").mkdir()
    assert claim(tmp_path / "new", "auto", False, None)["resume"] is False  # nothing to resume: fresh
    # a run that ended before it logged, saved or exported anything leaves nothing a fresh run could overwrite
    (tmp_path / "layout.json").write_text("{}")
    assert claim(tmp_path, "no", False, None)["run"]["id"] != got["run"]["id"]


def test_a_fresh_run_never_overwrites_another_runs_state(tmp_path: Path) -> None:
    out = _run(tmp_path / "done")
    before = _files(out)
    with pytest.raises(UserError) as e:
        claim(out, "no", False, None)
    said = str(e.value)
    assert "holds run r1 (started 2026-11-30T10:00:00+00:00): 2 checkpoint(s), newest step_000004" in said, said
    assert "4 logged step(s) in metrics.jsonl, exported lora/" in said and "--resume" in said, said
    assert "--archive-previous" in said and _files(out) == before  # nothing touched
    # metrics alone (a run killed before its first checkpoint), or an export alone, are state too
    for kind in ("metrics", "export"):
        part = _run(tmp_path / kind, checkpoints=(), exported=kind == "export", steps=3 if kind == "metrics" else 0)
        with pytest.raises(UserError, match="choose another output_dir"):
            claim(part, "no", False, None)


def test_resume_with_nothing_to_resume_stops_and_says_why(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"--resume: nothing to resume in .* \(no complete checkpoint; it holds no run"):
        claim(tmp_path / "empty", "required", False, None)
    finished = _run(tmp_path / "finished", checkpoints=())  # checkpoint.every_n_steps 0: metrics and an export
    before = _files(finished)
    with pytest.raises(UserError, match=r"nothing to resume .*it holds run r1 .*: 4 logged step\(s\)"):
        claim(finished, "required", False, None)
    # the recipe's checkpoint.resume (requeued jobs) starts fresh only where nothing would be lost
    with pytest.raises(UserError, match="holds run r1"):
        claim(finished, "auto", False, None)
    assert _files(finished) == before


def test_resume_continues_the_recorded_run_and_only_its_checkpoints(tmp_path: Path) -> None:
    out = _run(tmp_path / "run")
    got = claim(out, "required", False, None)
    assert got["resume"] is True and got["run"]["id"] == "r1"
    assert claim(out, "auto", False, None)["resume"] is True
    foreign = out / "checkpoints" / "step_000006"  # copied in from another run's folder
    foreign.mkdir()
    (foreign / "trainer.json").write_text(json.dumps({"run_id": "r2", "step": 6}))
    (foreign / "COMPLETE").touch()
    with pytest.raises(UserError, match=r"holds checkpoints of another run \(step_000006: not run r1's"):
        claim(out, "required", False, None)


def test_archive_previous_moves_the_old_run_aside(tmp_path: Path) -> None:
    out = _run(tmp_path / "run")
    (out / ".lock").write_text("{}")  # the lock of the run now starting stays
    before = _files(out)
    got = claim(out, "no", True, None)
    assert got["resume"] is False and got["note"].startswith("archived the previous run's files into ")
    archived = out / "archive" / "r1"
    assert _files(archived) == {k: v for k, v in before.items() if k != ".lock"}
    assert not inspect(out).has_state and (out / ".lock").exists() and got["run"]["id"] != "r1"


def test_a_folder_from_before_runs_had_identities_is_adopted_on_resume(tmp_path: Path) -> None:
    out = _run(tmp_path / "legacy", run_id=None)
    with pytest.raises(UserError, match="a run with no run.json"):
        claim(out, "no", False, None)
    got = claim(out, "required", False, None)
    assert got["resume"] and got["run"]["adopted"] and "adopted" in got["note"]
    assert claim(out, "required", False, None)["run"]["id"] == got["run"]["id"]  # its old checkpoints stay loadable
