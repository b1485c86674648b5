"""train/runtime.py: one run per output_dir, the process-group timeout, the hang watchdog and no orphans.

The fault cases run the real entry point (`accelerate launch ... train/finetune.py`, ~10-25 s each on 2 cores): a
second run into a running run's output_dir, SIGKILL of the launcher, SIGSTOP of one rank.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from train.errors import UserError
from train.runtime import LOCK_NAME, OutputLock, diagnose

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


def start(out_dir: Path, log: Path, *overrides: str) -> subprocess.Popen:
    """A long 2-rank run of the tiny recipe in the background (its own session: the test can always clean it up)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu.yaml",
           "--num_processes", "2", "train/finetune.py", "--recipe", "recipes/tiny/wan.yaml",
           "--set", f"output_dir={out_dir}", "--set", "logging.progress_bar=false",
           "--set", "logging.wandb_mode=disabled", "--set", "train.max_steps=1000000",
           *[a for o in overrides for a in ("--set", o)]]  # fmt: skip
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def wait_training(proc: subprocess.Popen, out_dir: Path, log: Path, timeout_s: float = 180) -> None:
    """Until the run has logged a step (so its lock is taken and its ranks are in the loop)."""
    deadline = time.monotonic() + timeout_s
    metrics = out_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, f"the run ended early ({proc.returncode}):\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no step after {timeout_s} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], timeout_s: float) -> float:
    """Seconds until none of `pids` runs (zombies count as gone); inf past `timeout_s`."""
    t0 = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - t0 > timeout_s:
            return float("inf")
        time.sleep(0.2)
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


def test_process_group_timeout_reaches_gloo(tmp_path: Path) -> None:
    """init_processes' group (adopted by accelerate) carries parallel.timeout_s: a collective a peer never joins
    fails after that time instead of hanging."""
    code = textwrap.dedent("""
        import os, sys, time, torch, torch.distributed as dist
        from train import runtime
        from train.config import load_recipe
        from train.finetune import init_processes
        runtime.PG_GRACE_S = 0  # the grace only orders the watchdog before the group; the recipe's value must arrive
        init_processes(load_recipe("recipes/tiny/wan.yaml", ["parallel.timeout_s=3", "logging.wandb_mode=disabled"]))
        if dist.get_rank() == 0:
            time.sleep(15)
        else:
            t0 = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1))
                print("no error")
            except Exception as e:
                print(f"failed after {time.monotonic() - t0:.1f} s: {e}")
        sys.stdout.flush()
        os._exit(0)
    """)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "PYTHONPATH": str(REPO)}
    run = [sys.executable, "-c", code]
    envs = [{**env, "RANK": str(r)} for r in (0, 1)]
    procs = [
        subprocess.Popen(run, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for e in envs
    ]
    try:
        out = procs[1].communicate(timeout=120)[0]
    finally:
        kill_all([p.pid for p in procs])
    line = [x for x in out.splitlines() if x.startswith(("failed after", "no error"))]
    assert line and line[0].startswith("failed after"), out[-3000:]
    assert 2.5 <= float(line[0].split()[2]) <= 8, line[0]


def test_second_run_refused_and_launcher_death_leaves_no_rank(tmp_path: Path) -> None:
    out, log = tmp_path / "run", tmp_path / "first.log"
    out.mkdir()
    stale = {"host": socket.gethostname(), "pid": dead_pid(), "started": "2020-01-01T00:00:00+00:00"}
    (out / LOCK_NAME).write_text(json.dumps(stale))
    first = start(out, log)
    ranks: list[int] = []
    try:
        wait_training(first, out, log)
        ranks = [c.pid for c in psutil.Process(first.pid).children(recursive=True)]
        holder = json.loads((out / LOCK_NAME).read_text())
        assert holder["pid"] in ranks and len(ranks) == 2, (holder, ranks)
        assert f"took over the stale lock of a run that is gone (host {stale['host']}, pid {stale['pid']}" in (
            log.read_text()
        )

        t0 = time.monotonic()
        second = start(out, tmp_path / "second.log")
        rc = second.wait(timeout=180)
        second_log = (tmp_path / "second.log").read_text()
        errors = [x for x in second_log.splitlines() if x.startswith("error:")]
        assert rc != 0 and len(errors) == 1, second_log[-4000:]
        assert f"in use by another run (host {holder['host']}, pid {holder['pid']}" in errors[0], errors
        print(f"second run refused in {time.monotonic() - t0:.1f} s: {errors[0]}")
        assert first.poll() is None and all(alive(p) for p in ranks)  # the refused run did not disturb the first

        os.kill(first.pid, signal.SIGKILL)  # the `accelerate launch` process
        gone = wait_gone(ranks, 30)
        print(f"launcher SIGKILLed: ranks gone in {gone:.1f} s")
        assert gone <= 30, f"ranks {[p for p in ranks if alive(p)]} survived the launcher by 30 s"
    finally:
        kill_all([first.pid, *ranks])
        first.wait(timeout=30)


def test_stopped_rank_ends_the_job_naming_it(tmp_path: Path) -> None:
    timeout_s = 20
    out, log = tmp_path / "run", tmp_path / "run.log"
    job = start(out, log, f"parallel.timeout_s={timeout_s}")
    ranks: list[int] = []
    try:
        wait_training(job, out, log)
        ranks = [c.pid for c in psutil.Process(job.pid).children(recursive=True)]
        rank0 = json.loads((out / LOCK_NAME).read_text())["pid"]
        rank1 = next(p for p in ranks if p != rank0)
        t0 = time.monotonic()
        os.kill(rank1, signal.SIGSTOP)
        rc = job.wait(timeout=60 + timeout_s + 30)
        gone = wait_gone(ranks, max(1.0, 60 + timeout_s - (time.monotonic() - t0)))
        elapsed = time.monotonic() - t0
        text = log.read_text()
        lines = [x for x in text.splitlines() if x.startswith("error:")]
        print(f"rank 1 SIGSTOPped: job gone in {elapsed:.1f} s (timeout_s {timeout_s}): {lines}")
        assert rc != 0 and gone < float("inf") and elapsed <= 60 + timeout_s, text[-4000:]
        assert len(lines) == 1 and lines[0].startswith("error: rank 0: stuck for "), text[-4000:]
        assert "in train_step at step" in lines[0] and "ranks [1] did not arrive" in lines[0], lines
        assert " from train/" in lines[0], lines  # the collective and where the trainer called it
        assert not (out / LOCK_NAME).exists()  # rank 0 released the lock on its way out
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        kill_all([job.pid, *ranks])
        job.wait(timeout=30)
