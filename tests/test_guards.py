"""The trainer's numerical guards and its graceful stop, through the real entry point (2 processes, CP 2, gloo).

One tiny Wan cache (the session's tiny pipeline, `train.prepare`) and copies of it with one sample damaged:
- a NaN in one sample's latents: the dataset warns once naming the file and hands it on; every step that reads it has
  a non-finite loss and is skipped (no update), reported in metrics.jsonl; the run ends with exit code 0 and finite
  exported weights.
- a diverging lr (100, the largest the schema takes; no clipping): `train.max_bad_steps` non-finite steps in a row
  stop the run (rank exit code 2) with one line naming the step and each step's samples; under data parallelism,
  only the bad group's sample. A run whose last step is skipped exports the last applied step and exits 2.
- SIGTERM to one rank, then (after `--resume`) to the launcher (`python -m train.launch`): every rank finishes the
  step, writes a checkpoint and exits, and so does the launcher, with 0; resuming to the end gives the uninterrupted
  run's losses and grad norms (within 1e-6) and its skipped steps.

Launches (~6-15 s each) go through the harness's command line (`train`, `launch_command` for the signalled ones); the
uninterrupted NaN run is shared between its test and the SIGTERM test (a module fixture); every wait is on an event
(a step in metrics.jsonl, the launcher's exit).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import REPO, WARM, env, launch_command, train, wait_until
from train.config import recipe_from_dict
from train.data.dataset import read_manifest
from train.data.synthetic_media import make_media_set
from train.models import get_encoder
from train.prepare import prepare

# 5 epochs of the 4 samples (the damaged one read 5 times); room for both signals to land mid-run: each stops the run
# ~1-2 steps (~0.1 s each) after the step it follows (2, then 2 more after the resume), well before the end
STEPS = 20
TOL = 1e-6
F, H, W = 5, 32, 48  # Wan: 4k + 1 frames, sides multiples of 16


def _plant(path: Path, value: float) -> None:
    """Overwrite the first element of the sample's latents in place: the file keeps its size and header."""
    with open(path, "r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(length))["latents"]
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[entry["dtype"]]
        f.seek(8 + length + entry["data_offsets"][0])
        f.write(torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes())


def _copy_with(cache: Path, dest: Path, value: float) -> tuple[Path, str]:
    """A copy of `cache` whose second sample holds `value`; returns (the copy, that sample's file)."""
    subprocess.run(["cp", "-r", str(cache), str(dest)], check=True)
    file = read_manifest(dest)["samples"][1]["file"]
    _plant(dest / file, value)
    return dest, file


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_pipeline) -> dict:
    root = tmp_path_factory.mktemp("guards")
    pipe = tiny_pipeline("wan")
    media = root / "media"
    make_media_set(media, num_videos=4, num_images=0, frames=9, height=H, width=W, fps=16.0)
    data = {"source": str(media), "cache_dir": str(root / "cache"), "height": H, "width": W, "num_frames": F,
            "fps": 16.0, "max_text_tokens": None if get_encoder("wan").fixed_text_tokens else 16}  # fmt: skip
    recipe = {
        "model": {"family": "wan", "pretrained_path": str(pipe), "dtype": "float32"},
        "data": data,
        "parallel": {"cp": 2},
        "train": {"max_steps": STEPS, "batch_size": 1, "lr": 1e-3, "seed": 0, "mixed_precision": "no"},
        "finetune": {"method": "full"},
        "logging": {"wandb_mode": "disabled", "progress_bar": False, "every_n_steps": 1},
        "checkpoint": {"every_n_steps": 0, "export": "auto"},
    }
    assert prepare(recipe_from_dict(recipe), log=lambda _: None)["counts"]["ok"] == 4
    nan, nan_file = _copy_with(root / "cache", root / "cache_nan", math.nan)
    path = root / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return {"root": root, "recipe": path, "caches": {"clean": root / "cache", "nan": nan},
            "files": {"nan": nan_file}}  # fmt: skip


def _start(setup: dict, out: Path, cache: str, *overrides: str, resume: bool = False, warm: bool = False):
    """The run in the background, its output in a log file: the test polls metrics.jsonl meanwhile. Through
    `python -m train.launch` (the harness's command line), or `warm`: on the harness's warm ranks (`WARM.begin`),
    where nothing of the launcher's own is under test."""
    cmd = launch_command(out, setup["recipe"], f"data.cache_dir={setup['caches'][cache]}", *overrides, nproc=2,
                         resume=resume)  # fmt: skip
    log = out.with_suffix(".log")
    if warm:
        return WARM.begin(cmd[cmd.index("train/finetune.py") :], 2, log), log
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env())
    return proc, log


def _launch(setup: dict, name: str, cache: str, *overrides: str) -> tuple[int, str, Path]:
    out = setup["root"] / name
    run = train(out, setup["recipe"], f"data.cache_dir={setup['caches'][cache]}", *overrides, nproc=2, check=False)
    return run.rc, run.log, out


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _last_step(out: Path) -> int:
    """The last step in metrics.jsonl while a run writes it (0 before its first complete line)."""
    try:
        return _metrics(out)[-1]["step"]
    except (IndexError, ValueError):  # no line yet, or one half written
        return 0


def _errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error")]


@pytest.fixture(scope="module")
def nan_run(setup) -> tuple[int, str, Path]:
    return _launch(setup, "nan", "nan")


def test_a_nan_in_one_cached_sample_is_skipped_and_the_run_ends_finite(setup, nan_run, launcher) -> None:
    code, log, out = nan_run
    assert code == 0, log[-4000:]
    # the dataset names the file once per rank that reads it, and hands the sample on (counted in the whole log: the
    # two ranks' lines share one pipe and were seen written into one line)
    warned = re.findall(rf"warning: \S*{re.escape(setup['files']['nan'])} holds NaN", log)
    assert len(warned) == 2, log[-4000:]
    lines = _metrics(out)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    skipped = [m for m in lines if m["skipped"]]
    # 4 samples, batch 1, one data-parallel group: the damaged one is read once per 4-step epoch
    assert len(skipped) == STEPS // 4 and lines[-1]["bad_steps"] == len(skipped)
    assert all(not math.isfinite(m["loss"]) for m in skipped)
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in lines if not m["skipped"])
    kept = [m["loss"] for m in lines if not m["skipped"]]
    assert len(set(kept)) > 1  # the healthy steps did train
    weights = {}
    for shard in sorted((out / "transformer").glob("*.safetensors")):
        weights.update(load_file(shard))
    assert weights and all(bool(torch.isfinite(t).all()) for t in weights.values())


def test_a_run_that_ends_on_a_skipped_step_exits_2_naming_it(setup, nan_run, launcher) -> None:
    """The NaN cache's run cut at its first skipped step (the same batches: the order depends on the seed, not on
    max_steps): it exports the last applied step's weights, then fails (exit 2) with one line naming the skipped
    step and its sample, rather than exiting 0 on a non-finite last loss."""
    bad = next(m["step"] for m in _metrics(nan_run[2]) if m["skipped"])
    code, log, out = _launch(setup, "ends_bad", "nan", f"train.max_steps={bad}")
    errors = _errors(log)
    assert code == 2 and len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert (
        f"the run's last 1 step had a non-finite loss or gradient norm and was skipped (the export holds step "
        f"{bad - 1}'s weights, the last applied)" in errors[0]
    ), errors[0]
    assert f"({setup['files']['nan']})" in errors[0] and (out / "transformer" / "config.json").exists()


def test_a_diverging_run_stops_after_max_bad_steps_naming_steps_and_samples(setup, launcher) -> None:
    code, log, out = _launch(setup, "diverge", "clean", "train.lr=100", "train.max_grad_norm=null")
    assert code == 2 and "Traceback" not in log, log[-3000:]  # the ranks' user-error code (train.launch passes it on)
    errors = _errors(log)
    assert len(errors) == 1, log[-3000:]
    lines = _metrics(out)
    last = lines[-1]["step"]
    assert [m["skipped"] for m in lines[-3:]] == [True] * 3 and not any(m["skipped"] for m in lines[:-3])
    assert [m["bad_steps"] for m in lines[-3:]] == [1, 2, 3]
    assert f"stopped at step {last}: 3 steps in a row" in errors[0]
    names = read_manifest(setup["caches"]["clean"])["samples"]
    for step in (last - 2, last - 1, last):  # each step's sample: its dataset index and its cache file
        named = re.search(rf"step {step} \([^)]*\): #(\d+) \(([^)]+)\)", errors[0])
        assert named and names[int(named[1])]["file"] == named[2], errors[0]
    assert not (out / "transformer").exists() and not (out / "checkpoints").exists()


def test_under_data_parallel_the_error_names_the_bad_sample_alone(setup, launcher) -> None:
    """dp_shard 2: the two groups read different samples; the step that reads the NaN one is bad on every rank (the
    loss is averaged over all ranks), and the error names that sample only, not the other group's."""
    code, log, out = _launch(setup, "dp2", "nan", "parallel.cp=1", "parallel.dp_shard=2", "train.max_bad_steps=1")
    errors = _errors(log)
    assert code == 2 and len(errors) == 1, log[-3000:]
    step = _metrics(out)[-1]["step"]
    named = re.search(rf"stopped at step {step}: 1 step in a row .* step {step} \([^)]*\): (#\d+ \([^)]+\))\. ",
                      errors[0])  # fmt: skip
    assert named and named[1].endswith(f"({setup['files']['nan']})"), errors[0]


def _signal_mid_run(proc, out: Path, after_step: int, target: str) -> tuple[int, float]:
    """Wait until metrics.jsonl reaches `after_step`, send SIGTERM to `target` ("launcher" or "rank1"), wait for the
    launcher to exit; returns its exit code and the seconds from the signal to the exit."""
    wait_until(lambda: _last_step(out) >= after_step, f"step {after_step}", 300, alive=lambda: proc.poll() is None)
    pid = proc.pids[1] if target == "rank1" else proc.pid  # rank 1 of a warm run, or the launcher
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGTERM)
    code = proc.wait(timeout=300)
    return code, time.perf_counter() - t0


def _stopped_at(log: str) -> tuple[int, Path]:
    found = re.findall(r"^stopped by SIGTERM after step (\d+); checkpoint: (\S+); resume with --resume$", log, re.M)
    assert len(found) == 1, log[-3000:]
    step, path = int(found[0][0]), Path(found[0][1])
    assert path.name == f"step_{step:06d}" and (path / "COMPLETE").exists()
    return step, path


def test_sigterm_checkpoints_and_resume_matches_the_uninterrupted_run(setup, nan_run, launcher) -> None:
    """SIGTERM to one rank only (the ranks agree on the stop: exit 0; on the harness's warm ranks), then after a
    resume to the launcher (`python -m train.launch`: torchrun forwards it); a second resume runs to the end: the
    losses (and skips) of the uninterrupted run, step by step."""
    out = setup["root"] / "sigterm"
    proc, log = _start(setup, out, "nan", warm=True)  # the ranks' agreement: a rank's own signal handling
    code, one_rank_s = _signal_mid_run(proc, out, 2, "rank1")
    first, _ = _stopped_at(log.read_text())
    assert code == 0, log.read_text()[-3000:]
    assert first < STEPS and not (out / "transformer").exists()

    proc, log = _start(setup, out, "nan", resume=True)
    code, launcher_s = _signal_mid_run(proc, out, first + 2, "launcher")
    text = log.read_text()
    second, _ = _stopped_at(text)
    assert f"resumed from {out / 'checkpoints' / f'step_{first:06d}'} at step {first}" in text
    assert first < second < STEPS
    # train.launch (the launch scripts' entry) exits 0: the trainer stopped cleanly (plain accelerate launch would
    # exit 1 with torchrun's SignalException although every rank finished its step, checkpointed and exited 0)
    assert code == 0 and "Traceback" not in text and not _errors(text), text[-3000:]

    # the rest of the run: no signal, nothing of the launcher's own to prove (the harness's warm ranks)
    train(out, setup["recipe"], f"data.cache_dir={setup['caches']['nan']}", nproc=2, resume=True)
    resumed, reference = _metrics(out), _metrics(nan_run[2])
    assert [m["step"] for m in resumed] == [m["step"] for m in reference] == list(range(1, STEPS + 1))
    for a, b in zip(resumed, reference):
        assert a["skipped"] == b["skipped"], (a, b)
        if not b["skipped"]:
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= TOL * max(1.0, abs(b[key])), (key, a, b)
    print(f"SIGTERM → checkpoint → exit: one rank signalled {one_rank_s:.2f} s (stopped after step {first}), "
          f"launcher signalled {launcher_s:.2f} s (after step {second})")  # fmt: skip


def test_stop_request_records_sigint_and_sigterm(tmp_path) -> None:
    """In this process, on a 1-rank group: no signal → no stop; Ctrl-C (SIGINT) → "SIGINT", the process lives on;
    SIGTERM as well → "SIGTERM" (the larger signal number wins the MAX, as it does across ranks)."""
    import torch.distributed as dist

    from train.finetune import StopRequest

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        stop = StopRequest(torch.device("cpu"))
        assert stop.agreed() is None and stop.agreed_signal is None
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed() == "SIGINT"
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() == stop.agreed_signal == "SIGTERM"
    finally:
        dist.destroy_process_group()
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_nan_in_the_pretrained_weights_is_named_at_startup(tiny_pipeline, tmp_path: Path) -> None:
    """A pretrained folder with a NaN in one tensor, loaded through the trainer's path (`whole_model`, then
    `check_finite_start`, the end of `build_model`): one line naming the tensor and the folder, before any step
    could turn it into non-finite losses blamed on the samples."""
    import shutil

    from safetensors.torch import save_file

    from train.config import load_recipe
    from train.errors import UserError
    from train.modeling import check_finite_start, family_spec, whole_model

    folder = tmp_path / "wan"
    shutil.copytree(tiny_pipeline("wan"), folder)
    weights = next((folder / "transformer").glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("ffn.net.0.proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    recipe = load_recipe(REPO / "recipes/tiny/wan.yaml", [f"model.pretrained_path={folder}", "model.init_config=null"])
    model = whole_model(recipe, family_spec(recipe.model))
    with pytest.raises(UserError) as e:
        check_finite_start(model, recipe.model)
    assert f"NaN/Inf in 1 tensor(s) ({name}) loaded from {folder}" in str(e.value), e.value
