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


# --- damaged inputs: one line from the CLI, never a failed run from the trainer's report ---------------------------


def _step(step: int) -> dict:
    return {"step": step, "loss": 1.0 / step, "grad_norm": 0.5, "lr": 1e-3, "transformer_tokens_per_s": 100.0,
            "step_time_s": 0.1, "peak_mem_bytes": 2**20, "skipped": False, "bad_steps": 0}  # fmt: skip


def _fake_run(out: Path, steps: int = 3) -> Path:
    """An output_dir as the trainer leaves it, for the report: recipe.yaml and metrics.jsonl (the rest optional)."""
    from tests.harness import REPO
    from train.config import load_recipe, save_recipe

    out.mkdir(parents=True, exist_ok=True)
    save_recipe(load_recipe(REPO / "recipes/tiny/wan.yaml", [f"output_dir={out}"]), out / "recipe.yaml")
    (out / "metrics.jsonl").write_text("".join(json.dumps(_step(s)) + "\n" for s in range(1, steps + 1)))
    return out


DAMAGED_LINES = [  # (line 2 of metrics.jsonl, what the error says about it)
    ('{"step": "x", "loss": 1}', 'not a metrics line ("step" is "x", not a step number)'),
    ("[1, 2]", "not a metrics line (a JSON list, not an object)"),
    ('{"loss": 1.0}', 'not a metrics line (no "step" key)'),
    ('{"step": 2}', 'not a metrics line (neither "loss" nor "val_loss")'),
    ('{"step": 2, "loss": 1.0}', "not a metrics line (no 'grad_norm', 'lr', 'transformer_tokens_per_s'"),
    ('{"step": 2, "loss": "low", "grad_norm": 1}', 'not a metrics line ("loss" is "low", not a number)'),
]


@pytest.mark.parametrize("line,said", DAMAGED_LINES, ids=["step_str", "list", "no_step", "no_loss", "no_keys", "str"])
def test_a_damaged_metrics_line_is_one_line_and_the_end_report_says_so(tmp_path: Path, capsys, line, said) -> None:
    """The CLI: one `error:` line naming the file and line and the fix, exit 2. The trainer's report_at_end: no
    exception, and the previous report.md (and its charts) replaced by one that says why (not left stale)."""
    from train.report import main, report_at_end

    out = _fake_run(tmp_path / "run")
    assert main([str(out)]) == 0 and len(list((out / "report").glob("*.png"))) == 5
    capsys.readouterr()
    good = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([good[0], line, good[2]]) + "\n")
    assert main([str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {out / 'metrics.jsonl'}, line 2: {said}"), err
    assert err.rstrip().endswith("the file was edited or damaged: restore it, or delete that line")

    assert report_at_end(out) == []  # never raises: the run's exit code is not the report's
    printed = capsys.readouterr().out
    assert printed.startswith(f"report: not written (UserError: {out / 'metrics.jsonl'}, line 2: {said}")
    assert printed.rstrip().endswith(f"{out / 'report.md'} says why; retry with `python -m train.report {out}`")
    md = (out / "report.md").read_text()
    assert md.startswith("# Run report: not written") and "line 2" in md and f"python -m train.report {out}" in md
    assert not list((out / "report").glob("*.png"))  # the previous report's charts went with it


def test_damaged_last_line_is_not_taken_for_a_torn_one(tmp_path: Path) -> None:
    """A whole JSON value of the wrong shape on the last line is damage, not a write cut short: named, not dropped."""
    from train.errors import UserError
    from train.report import read_metrics

    out = _fake_run(tmp_path)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": null}\n')
    with pytest.raises(UserError, match=r'line 4: not a metrics line \("step" is null, not a step number\)'):
        read_metrics(out / "metrics.jsonl")


def test_metrics_file_a_folder_or_damaged_json_files_are_one_line(tmp_path: Path, capsys) -> None:
    import subprocess
    import sys
    import time

    from tests.harness import REPO
    from train.report import main, report_at_end

    out = _fake_run(tmp_path / "run")
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").mkdir()
    (out / "report.md").write_text("# an older run's report\n")
    t0 = time.perf_counter()  # through the real entry point once: no traceback, exit 2, one line
    proc = subprocess.run([sys.executable, "-m", "train.report", str(out)], cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr == (f"error: {out / 'metrics.jsonl'} is a folder, not the run's metrics file (one JSON line "
                           "per logged step): move it away, or restore the file\n")  # fmt: skip
    assert seconds < 60, seconds
    assert report_at_end(out) == [] and "a folder" in (out / "report.md").read_text()  # the stale one replaced
    capsys.readouterr()

    (out / "metrics.jsonl").rmdir()
    _fake_run(out)
    (out / "memory.json").write_text('{"world_size": ')
    assert main([str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out / 'memory.json'} cannot be read (JSONDecodeError: ") and err.count("\n") == 1
    (out / "memory.json").unlink()
    (out / "layout.json").write_text("[]")
    assert main([str(out)]) == 2
    assert "layout.json holds a JSON list, not an object: restore it, or delete it" in capsys.readouterr().err
    (out / "layout.json").unlink()
    (out / "recipe.yaml").write_bytes(b"\xff\xfe")  # not text: load_recipe's UnicodeDecodeError
    assert main([str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {out / 'recipe.yaml'} cannot be read (UnicodeDecodeError: ")


def test_a_report_that_cannot_be_written_leaves_no_stale_one(tmp_path: Path, monkeypatch, capsys) -> None:
    """When even the short report cannot be written (a full disk), the previous report.md is removed."""
    import errno

    from train import report

    out = _fake_run(tmp_path)
    (out / "report.md").write_text("# an older run's report\n")

    def full(path: Path, text: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "_write_atomic", full)
    assert report.report_at_end(out) == []
    assert not (out / "report.md").exists()
    assert "No space left on device); the previous report.md removed; retry with" in capsys.readouterr().out


# --- wandb online at startup (train/tracking.py): one line within seconds, before any process group -----------------


@pytest.fixture
def no_login(tmp_path: Path, monkeypatch) -> Path:
    """A user without a wandb login: an empty HOME, no WANDB_API_KEY, no NETRC, wandb's default server."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_BASE_URL", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    return home


def _online(**sets: str):
    from tests.harness import REPO
    from train.config import load_recipe

    return load_recipe(REPO / "recipes/tiny/wan.yaml", ["logging.wandb_mode=online", *sets])


def test_wandb_online_without_a_login_or_server_is_one_line(no_login: Path, monkeypatch) -> None:
    import socket
    import time

    from tests.harness import REPO
    from train.config import load_recipe
    from train.errors import UserError
    from train.tracking import check_tracking

    for mode in ("offline", "disabled"):  # nothing to check: no network, no login needed
        check_tracking(load_recipe(REPO / "recipes/tiny/wan.yaml", [f"logging.wandb_mode={mode}"]))
    t0 = time.perf_counter()
    with pytest.raises(UserError) as e:
        check_tracking(_online())
    assert str(e.value) == (
        f"logging.wandb_mode is online but no wandb login was found (no WANDB_API_KEY, no entry for api.wandb.ai in "
        f"{no_login / '.netrc'}): run `wandb login` or set WANDB_API_KEY, or set logging.wandb_mode: offline (upload "
        "later with `wandb sync <output_dir>/wandb/offline-run-*`)"
    )
    monkeypatch.setenv("WANDB_API_KEY", "")  # empty: none
    with pytest.raises(UserError, match="no wandb login was found"):
        check_tracking(_online())

    # A key, but the server refuses (nothing listens on port 9): said within the connect timeout.
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    with pytest.raises(UserError) as e:
        check_tracking(_online())
    assert str(e.value).startswith(
        "logging.wandb_mode is online but the wandb server http://127.0.0.1:9 (WANDB_BASE_URL) cannot be reached: "
        "127.0.0.1:9: connection refused; check the network (or WANDB_BASE_URL), or set logging.wandb_mode: offline"
    ), e.value
    # A server that listens: no error (the check only connects; nothing is sent).
    with socket.create_server(("127.0.0.1", 0)) as server:
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        check_tracking(_online())
    assert time.perf_counter() - t0 < 5.0


def test_wandb_login_in_netrc_for_the_settings_server_counts(no_login: Path, monkeypatch) -> None:
    """`wandb login --host URL` writes the key to ~/.netrc under URL's host and URL to wandb's settings file: that
    login is found, for that server (a key for another host is not)."""
    import socket

    from train.errors import UserError
    from train.tracking import check_tracking

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        (no_login / ".config" / "wandb").mkdir(parents=True)
        (no_login / ".config" / "wandb" / "settings").write_text(f"[default]\nbase_url = http://127.0.0.1:{port}\n")
        (no_login / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
        with pytest.raises(UserError, match=f"no entry for 127.0.0.1 in {no_login / '.netrc'}"):
            check_tracking(_online())
        (no_login / ".netrc").write_text(f"machine 127.0.0.1:{port}\n  login user\n  password " + "k" * 40 + "\n")
        check_tracking(_online())


def test_wandb_unresolvable_host_is_said_fast(no_login: Path, monkeypatch) -> None:
    import time

    from train.errors import UserError
    from train.tracking import check_tracking

    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.invalid")  # .invalid never resolves (RFC 2606)
    t0 = time.perf_counter()
    with pytest.raises(
        UserError, match=r"https://wandb.invalid \(WANDB_BASE_URL\) cannot be reached: wandb.invalid:443"
    ):
        check_tracking(_online())
    assert time.perf_counter() - t0 < 5.0


# --- metrics.jsonl and wandb/logged.json (train/metrics.py MetricsLogger) -------------------------------------------


class _Accelerator:
    """What MetricsLogger uses of accelerate's Accelerator, recording the steps sent to wandb."""

    is_main_process = True

    def __init__(self) -> None:
        self.sent: list[int] = []

    def init_trackers(self, project, config, init_kwargs) -> None:
        self.init_kwargs = init_kwargs

    def get_tracker(self, name, unwrap):
        return type("Run", (), {"define_metric": lambda *a, **k: None})()

    def log(self, metrics, step) -> None:
        self.sent.append(step)


def _logger(out: Path, mode: str = "offline", accelerator=None):
    from train.config import LoggingConfig
    from train.metrics import MetricsLogger

    return MetricsLogger(accelerator or _Accelerator(), out, {}, LoggingConfig(wandb_mode=mode), "t", run_id="r1")


@pytest.mark.parametrize("damage", ["not json {", "[3]", '{"id": "r1", "last_step": "3"}', '{"last_step": 3}', "dir"])
def test_a_damaged_wandb_state_is_rebuilt_with_a_warning(tmp_path: Path, capsys, damage: str) -> None:
    """wandb/logged.json only records the last step sent to wandb (so a resume does not send it twice): damaged, it is
    rebuilt from metrics.jsonl (written before wandb at each step: its last step is the most wandb holds) with a
    warning, and the resume goes on: the steps after it go to wandb, none before it twice."""
    out = _fake_run(tmp_path, steps=4)
    state = out / "wandb" / "logged.json"
    state.parent.mkdir()
    if damage == "dir":
        state.mkdir()
        (state / "x").touch()
    else:
        state.write_text(damage)
    if damage == "dir":  # cannot be rewritten: one line with the fix (remove it), not a traceback
        from train.errors import UserError

        with pytest.raises(UserError, match=r"logged.json is damaged \(IsADirectoryError.*cannot be rewritten.*remove"):
            _logger(out)
        return
    metrics = _logger(out)
    assert metrics.before == 4 and json.loads(state.read_text()) == {"id": "r1", "last_step": 4}
    err = capsys.readouterr().err
    assert err.startswith(f"warning: {state} was damaged (") and err.rstrip().endswith(
        "rebuilt from metrics.jsonl: wandb gets the steps after step 4 (its last line)"
    ), err
    metrics.truncate_after(2)  # resumed from step 2: steps 3 and 4 are computed again
    for step in (3, 4, 5):
        metrics.log(_step(step))
    assert metrics.accelerator.sent == [5]
    assert json.loads(state.read_text()) == {"id": "r1", "last_step": 5}
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_a_wandb_state_of_this_run_and_of_another_are_read(tmp_path: Path, capsys) -> None:
    out = _fake_run(tmp_path, steps=4)
    (out / "wandb").mkdir()
    (out / "wandb" / "logged.json").write_text(json.dumps({"id": "r1", "last_step": 3}))
    assert _logger(out).before == 3
    (out / "wandb" / "logged.json").write_text(json.dumps({"id": "other", "last_step": 3}))
    assert _logger(out).before == 0
    assert capsys.readouterr().err == ""


def _full_disk(monkeypatch, path: Path) -> None:
    """Appending to `path` fails as a full disk does."""
    import errno

    real = Path.open

    def open_(self, *args, **kwargs):
        if self == path:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)


def test_metrics_write_on_a_full_disk_is_one_user_error(tmp_path: Path, monkeypatch) -> None:
    """In a 1-rank gloo group: the OS error, the last complete checkpoint and --resume; no checkpoint: no --resume."""
    from tests.harness import one_rank_group
    from train.errors import UserError

    out = _fake_run(tmp_path / "run")
    metrics = _logger(out, mode="disabled")
    _full_disk(monkeypatch, out / "metrics.jsonl")
    with one_rank_group(tmp_path):
        with pytest.raises(UserError) as e:
            metrics.log(_step(4))
        assert str(e.value) == (
            f"step 4: cannot write {out / 'metrics.jsonl'} (no space left on device, ENOSPC); no complete checkpoint "
            "exists, so the steps trained so far are lost: free space (or fix the folder), then start the run again"
        )
        assert "--resume" not in str(e.value)
        for step in (2, 3):
            (out / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
            (out / "checkpoints" / f"step_{step:06d}" / "COMPLETE").touch()
        (out / "checkpoints" / "step_000004").mkdir()  # not complete: not the one to resume
        with pytest.raises(UserError) as e:
            metrics.log(_step(4))
    assert str(e.value) == (
        f"step 4: cannot write {out / 'metrics.jsonl'} (no space left on device, ENOSPC); the latest complete "
        f"checkpoint is {out / 'checkpoints' / 'step_000003'}: free space (or fix the folder), then rerun with --resume"
    )


def _log_on_two_ranks(rank: int, tmp: str, errors) -> None:
    """A spawned rank of a 2-rank gloo group: rank 0's metrics append fails with ENOSPC; each rank's error goes into
    `errors` (a manager dict)."""
    import torch.distributed as dist

    from train.errors import UserError

    out = Path(tmp) / "run"
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2)
    try:
        accelerator = _Accelerator()
        accelerator.is_main_process = rank == 0
        metrics = _logger(out, mode="disabled", accelerator=accelerator)
        metrics.log(_step(1))  # a line written (the ranks agree: nothing failed)
        if rank == 0:
            _full_disk(pytest.MonkeyPatch(), out / "metrics.jsonl")
        try:
            metrics.log(_step(2))
            errors[rank] = None
        except UserError as e:
            errors[rank] = str(e)
        dist.barrier()  # both ranks got here: nobody is left in a collective
    finally:
        dist.destroy_process_group()


def test_metrics_write_failing_on_rank_0_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    out = _fake_run(tmp_path / "run", steps=0)
    (out / "checkpoints" / "step_000001").mkdir(parents=True)
    (out / "checkpoints" / "step_000001" / "COMPLETE").touch()
    with mp.Manager() as manager:
        errors = manager.dict()
        mp.spawn(_log_on_two_ranks, args=(str(tmp_path), errors), nprocs=2, join=True)
        errors = dict(errors)
    expected = (
        f"step 2: cannot write {out / 'metrics.jsonl'} (no space left on device, ENOSPC); the latest complete "
        f"checkpoint is {out / 'checkpoints' / 'step_000001'}: free space (or fix the folder), then rerun with --resume"
    )
    assert errors == {0: expected, 1: expected}
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == [1]
