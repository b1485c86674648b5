"""train/runtime.py: one run per output_dir, the process-group timeout, the hang watchdog and no orphans.

The fault cases run the real entry point (`python -m train.launch ... train/finetune.py`, the harness's command line,
~10-25 s each on 2 cores) in the background: SIGKILL of the launcher, SIGSTOP of one rank. A second run into a running
run's output_dir is refused by the trainer itself (its ranks forked by the harness: a UserError on every rank after the
process group exists, the delivery path tests/test_bad_inputs.py launches as `cache_sample_truncated`). Every wait is on
the event (a logged step, a pid gone: `wait_until`), never a fixed sleep.

Two long runs (one launch each) serve the three job tests. The stopped run (`stopped_rank`, an early scenario) starts
with the session: once it has logged a step its rank 1 is SIGSTOPped, and its watchdog timeout and torchrun's 30 s
teardown grace run out (idle waits) while the session's other tests run. The other long run (`jobs`) is the one a second
run is refused by and whose launcher is SIGKILLed. That run is also the startup memory check's and bf16 autocast's:
`memory_check: warn` with a tiny device, `mixed_precision: bf16`, its first 4 steps compared with
tests/test_finetune.py's fp32 serial run (the same recipe and seed; the constant schedule ignores max_steps).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.harness import REPO, early, env, launch_command, rank_job, spawn, train, wait_until
from train import runtime
from train.errors import UserError
from train.runtime import LOCK_NAME, OutputLock, diagnose

TINY = "recipes/tiny/wan.yaml"
# tests/test_finetune.py's serial tiny-wan LoRA run (4 steps, a checkpoint after each): identical overrides, one run
SERIAL = ("parallel.cp=1", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3")
# the long run's memory check (a prediction far over a 0.0001 GiB device: warned, not refused) and bf16 autocast
MEMORY_BF16 = ("parallel.device_memory_gib=0.0001", "parallel.memory_check=warn", "train.mixed_precision=bf16")


def start(out_dir: Path, log: Path, *overrides: str) -> subprocess.Popen:
    """A long 2-rank run of the tiny recipe in the background (its own session: the test can always clean it up)."""
    cmd = launch_command(out_dir, TINY, "train.max_steps=1000000", *overrides, nproc=2)
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _lines(path: Path) -> list[dict]:
    """metrics.jsonl's complete lines while a run writes it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines()[: text.count("\n")]]


def wait_training(proc: subprocess.Popen, out_dir: Path, log: Path, steps: int = 1, timeout_s: float = 300) -> None:
    """Until the run has logged `steps` steps (so its lock is taken and its ranks are in the loop)."""
    metrics = out_dir / "metrics.jsonl"
    try:
        wait_until(lambda: len(_lines(metrics)) >= steps, f"{steps} logged steps", timeout_s,
                   alive=lambda: proc.poll() is None)  # fmt: skip
    except AssertionError as e:
        raise AssertionError(f"{e} ({proc.poll()}):\n{log.read_text()[-4000:]}") from None


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], timeout_s: float) -> float:
    """Seconds until none of `pids` runs (zombies count as gone); fails past `timeout_s` naming the survivors."""
    t0 = time.monotonic()
    try:
        wait_until(lambda: not any(alive(p) for p in pids), f"end of pids {pids}", timeout_s)
    except AssertionError:
        raise AssertionError(f"pids {[p for p in pids if alive(p)]} still run after {timeout_s} s") from None
    return time.monotonic() - t0


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_lock_refuses_live_and_foreign_holders_and_takes_over_stale_ones(tmp_path: Path) -> None:
    path = tmp_path / LOCK_NAME
    stale = {"host": socket.gethostname(), "pid": dead_pid(), "started": "2020-01-01T00:00:00+00:00"}
    path.write_text(json.dumps(stale))
    lock = OutputLock(path)
    note = lock.acquire()
    assert note is not None and f"pid {stale['pid']}" in note and "stale" in note
    assert json.loads(path.read_text())["pid"] == os.getpid()

    with pytest.raises(UserError, match=rf"in use by another run \(host {socket.gethostname()}, pid {os.getpid()}"):
        OutputLock(path).acquire()  # this process holds it: alive
    lock.release()
    assert not path.exists()

    reused = {**OutputLock(path).record, "proc_start": -1}  # a live pid, but another process's start time
    path.write_text(json.dumps(reused))
    assert "stale" in OutputLock(path).acquire()
    path.write_text(json.dumps({"host": "node-17", "pid": 1234, "started": "x"}))
    with pytest.raises(UserError, match=r"another host \(host node-17, pid 1234.*delete .*\.lock"):
        OutputLock(path).acquire()
    assert not list(tmp_path.glob(f"{LOCK_NAME}.*"))  # no temporary files left behind


def test_diagnose_names_silent_and_late_ranks() -> None:
    def rec(beat: int, seq: int) -> dict:
        return {"beat": beat, "seq": seq, "phase": "train_step", "step": 3}

    first = {0: rec(5, 7), 1: rec(9, 7), 2: rec(4, 6), 3: rec(2, 7)}
    second = {0: rec(6, 7), 1: rec(9, 7), 2: rec(5, 6), 3: rec(3, 7)}  # 1 silent, 2 behind, 3 waits with 0
    assert diagnose(0, 5, 7, first, second) == [1, 2, 4]  # 4 never published


def test_long_phases_re_arm_the_watchdog_per_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real watchdog with a 1 s deadline: a held-out evaluation of 4 samples at 0.4 s each (1.6 s, no hang) and a
    long phase of 4 units of 0.4 s that calls runtime.keep_alive per unit (an export's tensors, a checkpoint's files)
    are never reported; the same 1.6 s without re-arming is (the deadline is live)."""
    import torch

    from train import heldout

    reports: list[str] = []
    monkeypatch.setattr(runtime.Watchdog, "_report", lambda self, seq, name, step, stuck: reports.append(name))
    wd = runtime.Watchdog(1.0, rank=0, world=1, store=None, parent=None)
    wd._thread.start()
    monkeypatch.setattr(runtime, "_ACTIVE", wd)

    def slow_loss(*args, **kwargs) -> torch.Tensor:
        time.sleep(0.4)
        return torch.ones(())

    monkeypatch.setattr(heldout, "micro_batch_loss", slow_loss)
    held = object.__new__(heldout.HeldOutLoss)  # the per-sample loop only; its collectives are not under test
    held.mine, held.device, held.seed, held.amp = [(i, 1.0) for i in range(4)], torch.device("cpu"), 0, None
    held.dataset, held.spec, held.objective = [{"latents": torch.zeros(1)}] * 4, None, None
    total = torch.zeros((), dtype=torch.float64)
    held._evaluate(torch.nn.Identity(), total, 3, wd)
    assert float(total) == 4.0 and reports == []
    wd.phase("export", 3)
    for _ in range(4):
        time.sleep(0.4)
        runtime.keep_alive()
    assert reports == []
    wd.phase("checkpoint", 3)
    time.sleep(1.6)
    assert reports and set(reports) == {"checkpoint"}
    wd.idle()


def _timeout_rank(rank: int, world: int, done: str) -> str | None:
    """init_processes' group with parallel.timeout_s=3 (no grace); rank 1's all-reduce, which rank 0 never joins
    (it waits for rank 1's `done` file instead)."""
    import torch
    import torch.distributed as dist

    from train.config import load_recipe
    from train.finetune import init_processes

    runtime.PG_GRACE_S = 0  # the grace only orders the watchdog before the group; the recipe's value must arrive
    init_processes(load_recipe(REPO / "recipes/tiny/wan.yaml", ["parallel.timeout_s=3", "logging.wandb_mode=disabled"]))
    if dist.get_rank() == 0:
        wait_until(lambda: Path(done).exists(), "rank 1's end", 300)
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        said = "no error"
    except Exception as e:  # noqa: BLE001 — what the test reads
        said = f"failed after {time.monotonic() - t0:.1f} s: {e}"
    Path(done).touch()
    return said


def test_process_group_timeout_reaches_gloo(tmp_path: Path, launcher) -> None:
    """init_processes' group (adopted by accelerate) carries parallel.timeout_s: a collective a peer never joins
    fails after that time instead of hanging (2 ranks, env:// rendezvous, forked from the harness's warm process)."""
    said = spawn(_timeout_rank, 2, str(tmp_path / "done"), init_group=False)[1]
    assert said.startswith("failed after"), said
    # 3 s, not torch's 30 min nor accelerate's 10: generous above for a loaded machine
    assert 2.5 <= float(said.split()[2]) <= 30, said


# The stopped run's watchdog timeout: > 5 × the slowest step seen (the first, 1.3 s on a 2-core machine at load 8; the
# run starts with the session, under its heaviest load); it reports ~2 polls (1 s) later. Its bound: that timeout plus
# torchrun's 30 s grace plus a generous allowance for a loaded 2-core machine.
STOP_TIMEOUT_S = 15
STOP_LIMIT_S = 90 + STOP_TIMEOUT_S


@early
def stopped_rank(root: Path, started: list) -> dict:
    """The stopped run (`parallel.timeout_s` `STOP_TIMEOUT_S`): rank 1 SIGSTOPped after the first logged step, then
    the job awaited to its end (~45 s, nearly all of it idle waits: it runs from the start of the session)."""
    out, log = root / "stopped", root / "stopped.log"
    job = start(out, log, f"parallel.timeout_s={STOP_TIMEOUT_S}")
    started.append(job)
    wait_training(job, out, log)
    ranks = psutil.Process(job.pid).children(recursive=True)
    started += ranks
    rank0 = json.loads((out / LOCK_NAME).read_text())["pid"]
    t0 = time.monotonic()
    next(p for p in ranks if p.pid != rank0).send_signal(signal.SIGSTOP)
    rc = job.wait(timeout=STOP_LIMIT_S + 30)
    wait_gone([p.pid for p in ranks], max(1.0, STOP_LIMIT_S - (time.monotonic() - t0)))
    return {"rc": rc, "elapsed": time.monotonic() - t0, "out": out, "log": log.read_text()}


def _launched_ranks(root: Path, name: str, started: list) -> tuple[subprocess.Popen, Path, list[psutil.Process]]:
    """The long 2-rank run started into `root/name`, once its launcher has both ranks (still importing): the
    launcher, its log, the ranks (all appended to `started`)."""
    log = root / f"{name}.log"
    job = start(root / name, log)
    started.append(job)
    launcher = psutil.Process(job.pid)
    try:
        wait_until(lambda: len(launcher.children(recursive=True)) >= 2, "the launcher's 2 ranks", 120,
                   alive=lambda: job.poll() is None)  # fmt: skip
    except AssertionError as e:  # a launcher that exited at once: why, from its log
        raise AssertionError(f"{e} (launcher exit code {job.poll()}):\n{log.read_text()[-3000:]}") from None
    ranks = launcher.children(recursive=True)
    started += ranks
    return job, log, ranks


@early
def launcher_killed_early(root: Path, started: list) -> dict:
    """A 2-rank launch whose launcher is SIGKILLed while its ranks still import (~10 s, before a rank can arm its
    death signal): the ranks' seconds to be gone, and whether the log had a rank's first line yet."""
    job, log, ranks = _launched_ranks(root, "early", started)
    importing = "recipe:" not in log.read_text()  # a rank prints the recipe after its imports and the group
    os.kill(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    return {"importing": importing, "gone_s": wait_gone([r.pid for r in ranks], 90), "log": log.read_text()}


@early
def interrupted_early(root: Path, started: list) -> dict:
    """Ctrl-C while a 2-rank launch's ranks import torch (past the interpreter's own start, ~0.2 s, where no handler
    of ours can run yet: resident memory over 150 MB): SIGINT to the launch's whole process group (what a terminal
    sends), then the launch awaited (~10 s)."""
    job, log, ranks = _launched_ranks(root, "interrupted", started)
    wait_until(lambda: all(r.memory_info().rss > 150 * 2**20 for r in ranks), "the ranks importing torch", 120)
    importing = "recipe:" not in log.read_text()
    os.killpg(job.pid, signal.SIGINT)
    rc = job.wait(timeout=90)
    return {"rc": rc, "importing": importing, "gone_s": wait_gone([r.pid for r in ranks], 60), "log": log.read_text()}


def test_ctrl_c_during_startup_is_one_line_and_exit_130(launcher) -> None:
    """Ctrl-C before the loop has nothing to checkpoint: each rank exits 130 without a traceback
    (train/errors.py `quiet_interrupt`), and the launcher says so in one line (it printed three tracebacks)."""
    r = interrupted_early.result()
    print(f"Ctrl-C during the ranks' imports: exit {r['rc']}, ranks gone in {r['gone_s']:.1f} s")
    assert r["importing"], r["log"][-3000:]
    assert r["rc"] == 130, r["log"][-3000:]
    assert "Traceback" not in r["log"], r["log"][-3000:]
    said = [line for line in r["log"].splitlines() if line.startswith(("launch:", "error:"))]
    assert len(said) == 1 and "SIGINT" in said[0], said


def test_launcher_killed_while_its_ranks_import_leaves_no_rank(launcher) -> None:
    """The launcher (`python -m train.launch`) dies before its ranks could tie themselves to it: each rank sees
    that its parent is no longer the launcher named in its environment (`CTXTRAIN_LAUNCHER_PID`) and exits once its
    imports are done, instead of waiting for a rendezvous that never comes."""
    r = launcher_killed_early.result()
    print(f"launcher SIGKILLed during the ranks' imports: ranks gone in {r['gone_s']:.1f} s")
    assert r["importing"], r["log"][-3000:]


def _end(launchers: list[subprocess.Popen], ranks: list[psutil.Process]) -> None:
    """Kill what is still running, by process object: never a reused pid."""
    for proc in ranks:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    for launcher in launchers:
        launcher.kill()  # a no-op once it has been waited for
        launcher.wait(timeout=30)


@pytest.fixture(scope="module")
def jobs(runs, tmp_path_factory) -> Iterator[dict]:
    """The long 2-rank run (`MEMORY_BF16`) into an output_dir holding a stale lock, once it has logged 4 steps, with
    its launcher, ranks, folder and log, and the serial run (the bf16 reference: a memoised launch). Ended here at the
    latest."""
    root = tmp_path_factory.mktemp("jobs")
    started: list[subprocess.Popen] = []
    children: list[psutil.Process] = []
    try:
        serial = runs(TINY, *SERIAL)
        out, log = root / "long", root / "long.log"
        out.mkdir()
        stale = {"host": socket.gethostname(), "pid": dead_pid(), "started": "2020-01-01T00:00:00+00:00"}
        (out / LOCK_NAME).write_text(json.dumps(stale))
        first = start(out, log, *MEMORY_BF16)
        started.append(first)
        wait_training(first, out, log, steps=4)
        children += (more := psutil.Process(first.pid).children(recursive=True))
        ranks = [c.pid for c in more]
        long = {"proc": first, "ranks": ranks, "out": out, "log": log, "stale": stale}
        yield {"long": long, "serial": serial}
    finally:
        _end(started, children)


def test_memory_warning_and_bf16_autocast(jobs) -> None:
    """`train.estimate` runs at startup: with `memory_check: warn` a prediction over the device memory is printed and
    the run trains (refused by default: tests/test_bad_inputs.py `startup_memory_refused`). The same CP 2
    run autocasts in bf16 (`mixed_precision: bf16`, CPU too): its loss differs from the fp32 serial run by bf16
    rounding, not more (so autocast did run), at each of the first 4 steps."""
    run = jobs["long"]
    log = run["log"].read_text()
    warned = [line for line in log.splitlines() if line.startswith("memory: warning: predicted peak per rank")]
    assert len(warned) == 1 and "over by more than" in warned[0], log[-3000:]
    metrics = _lines(run["out"] / "metrics.jsonl")[:4]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    layout = json.loads((run["out"] / "layout.json").read_text())
    assert layout["mixed_precision"] == "bf16: bf16 autocast, fp32 master weights"
    rel = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(metrics, jobs["serial"].metrics, strict=True)]
    assert 1e-5 < max(rel) < 5e-2, rel


def test_second_run_refused_and_launcher_death_leaves_no_rank(jobs, launcher) -> None:
    first, ranks, out, log, stale = (jobs["long"][k] for k in ("proc", "ranks", "out", "log", "stale"))
    holder = json.loads((out / LOCK_NAME).read_text())
    assert holder["pid"] in ranks and len(ranks) == 2, (holder, ranks)
    assert f"took over the stale lock of a run that is gone (host {stale['host']}, pid {stale['pid']}" in (
        log.read_text()
    )

    t0 = time.monotonic()
    # the second run's ranks (the harness's warm ranks): the refusal is the trainer's (see the module docstring)
    second = train(out, TINY, "train.max_steps=1000000", nproc=2, check=False, timeout=180)
    errors = second.errors
    assert second.rc == 2 and len(errors) == 1, second.log[-4000:]
    assert f"in use by another run (host {holder['host']}, pid {holder['pid']}" in errors[0], errors
    print(f"second run refused in {time.monotonic() - t0:.1f} s: {errors[0]}")
    assert first.poll() is None and all(alive(p) for p in ranks)  # the refused run did not disturb the first

    os.kill(first.pid, signal.SIGKILL)  # the launcher (train.launch: accelerate launch, torchrun's agent)
    gone = wait_gone(ranks, 60)  # the ranks die with it (runtime.die_with_launcher), not at the next collective
    print(f"launcher SIGKILLed: ranks gone in {gone:.1f} s")


def test_stopped_rank_ends_the_job_naming_it(launcher) -> None:
    """SIGSTOP of rank 1 mid-run (`stopped_rank`): rank 0's watchdog (`parallel.timeout_s`, a few tiny steps' worth
    here) names the stopped rank in one line and exits, the launcher ends the job within `STOP_LIMIT_S` of the
    SIGSTOP, and rank 0 has released the lock. Most of that time is torchrun's: it SIGTERMs rank 1, which a stopped
    process cannot act on, and SIGKILLs it 30 s later (torch 2.13's agent passes no shutdown_timeout on this path:
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT does not reach it)."""
    job = stopped_rank.result()
    text = job["log"]
    lines = [x for x in text.splitlines() if x.startswith("error:")]
    print(f"rank 1 SIGSTOPped: job gone in {job['elapsed']:.1f} s (timeout_s {STOP_TIMEOUT_S}): {lines}")
    assert job["rc"] != 0 and job["elapsed"] <= STOP_LIMIT_S, text[-4000:]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: stuck for "), text[-4000:]
    assert "in train_step at step" in lines[0] and "ranks [1] did not arrive" in lines[0], lines
    assert " from train/" in lines[0], lines  # the collective and where the trainer called it
    assert not (job["out"] / LOCK_NAME).exists()  # rank 0 released the lock on its way out


def _ranks_agree(rank: int, world: int) -> dict:
    """`check_ranks_agree` on 3 ranks: equal jobs pass; unequal ones raise on every rank."""
    runtime.check_ranks_agree({"recipe": {"train": {"lr": 1e-3, "max_steps": 4}}, "code": "abc"})
    job = {"recipe": {"train": {"lr": 1e-3 * (rank + 1), "max_steps": 5 if rank == 2 else 4}}, "code": "abc"}
    try:
        runtime.check_ranks_agree(job)
    except UserError as e:
        return {"said": str(e), "same": e.same_on_every_rank}
    return {"said": None}


rank_job(3)(_ranks_agree)


def test_every_rank_checks_it_runs_the_same_job(group) -> None:
    """The differing fields, each with its values and the ranks holding them, in the same line on every rank."""
    said = group(_ranks_agree, 3)
    assert all(s == said[0] for s in said) and said[0]["same"], said
    line = said[0]["said"]
    assert "recipe.train.lr: 0.001 on ranks [0], 0.002 on ranks [1], 0.003 on ranks [2]" in line, line
    assert "recipe.train.max_steps: 4 on ranks [0, 1], 5 on ranks [2]" in line, line


@pytest.mark.slow
def test_a_rank_started_with_another_set_is_refused_at_startup(tmp_path: Path) -> None:
    """A different `--set` on one rank (a wrapper, a node with another recipe file): one line naming the field, exit
    2, before the run writes anything (it trained silently with two learning rates)."""
    out = tmp_path / "differ"
    run = train(out, TINY, "parallel.cp=2", nproc=2, check=False, rank_extra={1: ["--set", "train.lr=0.01"]})
    assert run.rc == 2 and len(run.errors) == 1, run.log[-4000:]
    assert "recipe.train.lr: 0.001 on ranks [0], 0.01 on ranks [1]" in run.errors[0], run.errors
    assert not (out / "metrics.jsonl").exists() and not (out / LOCK_NAME).exists()
