"""The job's life on the machine: one run per output_dir, process-group timeout, a hang watchdog, no orphans.

- `die_with_launcher()`: a rank started by a launcher (`accelerate launch`, `torchrun`) is SIGKILLed by the kernel
  when the launcher dies, SIGKILL included (Linux `PR_SET_PDEATHSIG`; the watchdog thread polls the parent pid as
  the portable fallback).
- `init_process_group(backend, timeout_s)`: the default group, with `process_group_timeout(timeout_s)`.
- `lock_output_dir(out_dir, decide)`: collective; rank 0 holds `out_dir/.lock` (JSON: host, pid, start) until the
  process exits, and decides under it what the run may do with the folder (train/rundir.py). A second run into the
  same output_dir fails with a UserError naming the holder; a stale lock (same host, process gone or its pid reused,
  or the machine rebooted) is taken over with a one-line message. A lock from another host cannot be checked: it is
  refused, naming the holder and the file to delete if that job is dead.
- `Watchdog.start(timeout_s)`: a daemon thread per rank. The training loop marks its phases (`watchdog.phase(
  "backward", step)`); when a rank stays in one phase longer than `timeout_s`, it reads every rank's heartbeat from
  the launcher's TCPStore and prints one line naming the phase, the collective the main thread waits in and the
  ranks that did not arrive, then exits (the launcher tears the job down).
- `check_ranks_agree(job)`: collective; the resolved recipe, flags and code digest of every rank must be equal, else
  one line naming the differing fields and the ranks.
- `exit(code)`: leave without the interpreter's teardown, after the exit hooks (the lock's release) ran.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from train.errors import UserError

LOCK_NAME = ".lock"
PG_GRACE_S = 30  # the group's own timeout trails the watchdog's by this much: the watchdog names the ranks first
_STORE_PREFIX = "ctxtrain/watchdog"
_ACTIVE: Watchdog | None = None  # this process's watchdog (Watchdog.start), for keep_alive()
_REPO = str(Path(__file__).resolve().parent.parent) + os.sep

# Cleanups run at the process's end, like `atexit` (also registered there, for exits by exception) but also from
# `exit()` and from the watchdog, which leave through `os._exit` (gloo's threads can abort the interpreter teardown).
# Per process by nature: a process has one set of exit hooks.
_exit_hooks: list[Callable[[], None]] = []


def at_exit(fn: Callable[[], None]) -> None:
    if not _exit_hooks:
        atexit.register(_run_exit_hooks)
    _exit_hooks.append(fn)


def _run_exit_hooks() -> None:
    while _exit_hooks:
        try:
            _exit_hooks.pop()()
        except Exception as e:  # a failed cleanup must not hide the exit code
            print(f"warning: exit cleanup failed: {e}", file=sys.stderr, flush=True)


def exit(code: int) -> None:  # noqa: A001 (mirrors sys.exit)
    """Run the exit hooks, flush, and leave now with `code` (no interpreter teardown)."""
    _run_exit_hooks()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- no orphans -------------------------------------------------------------------------------------------------------


# Set by `python -m train.launch` to its own pid (the agent runs in it: it is its ranks' parent), so a rank can tell
# that its launcher died before the rank could arm the death signal (during its ~10 s of imports).
LAUNCHER_PID_ENV = "CTXTRAIN_LAUNCHER_PID"


def launcher_pid() -> int | None:
    """The pid of the launcher that started this rank (torchrun's agent, inside `python -m train.launch` or
    `accelerate launch`), else None. From train.launch's variable when set: `os.getppid()` is already another
    process's once the launcher has died."""
    if os.environ.get(LAUNCHER_PID_ENV, "").isdigit():
        return int(os.environ[LAUNCHER_PID_ENV])
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


def die_with_launcher() -> None:
    """Have the kernel SIGKILL this rank when its launcher dies (Linux); exit at once when it died already. A process
    started by hand keeps living when its shell goes (`nohup python train/finetune.py ...`): only launcher-started
    ranks are tied."""
    parent = launcher_pid()
    if parent is None or not sys.platform.startswith("linux"):
        return  # elsewhere the watchdog thread polls the parent pid
    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        print(f"warning: prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): the watchdog polls instead",
              file=sys.stderr, flush=True)  # fmt: skip
    if os.getppid() != parent:  # the launcher died before the signal was armed
        os._exit(1)


# --- process group ----------------------------------------------------------------------------------------------------


def process_group_timeout(timeout_s: float) -> timedelta:
    """The process group's own collective timeout: `parallel.timeout_s` plus a grace, so that inside a watched phase
    the watchdog (which names the phase, the collective and the missing ranks) reports first; outside one (startup,
    a phase the loop does not mark) the group's timeout still turns a stuck collective into an error."""
    return timedelta(seconds=timeout_s + PG_GRACE_S)


def launcher_env() -> bool:
    """Whether a launcher set up `env://` rendezvous (torchrun, `accelerate launch`, srun with exported vars)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_process_group(backend: str, timeout_s: float) -> None:
    """The default group with the recipe's timeout: `env://` under a launcher, else a 1-rank group on a free port."""
    timeout = process_group_timeout(timeout_s)
    if launcher_env():
        dist.init_process_group(backend, timeout=timeout)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout)


# --- one run per output_dir -------------------------------------------------------------------------------------------


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid, an identity
    that survives pid reuse. None where /proc is missing or the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])  # fields after "(comm)": state is field 3, start is 22


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder_alive(holder: dict) -> bool | None:
    """True/False for a lock written on this host; None (cannot tell) for another host's."""
    if holder.get("host") != socket.gethostname():
        return None
    boot = _boot_id()
    if boot is not None and holder.get("boot_id") not in (None, boot):
        return False  # written before this machine rebooted
    pid = int(holder["pid"])
    start = _proc_start(pid)
    if start is not None and holder.get("proc_start") is not None:
        return start == holder["proc_start"]  # the same process, not a reused pid
    return _pid_exists(pid)


def _describe(holder: dict) -> str:
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"


class OutputLock:
    """`out_dir/.lock`, held by this process (rank 0) until `release()` (run at exit)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        pid = os.getpid()
        self.record = {"host": socket.gethostname(), "pid": pid,
                       "started": datetime.now(UTC).isoformat(timespec="seconds"), "boot_id": _boot_id(),
                       "proc_start": _proc_start(pid), "token": uuid.uuid4().hex}  # fmt: skip

    def _read(self, path: Path) -> dict | None:
        try:
            holder = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) and "pid" in holder and "host" in holder else None

    def acquire(self) -> str | None:
        """Take the lock; returns the takeover message (None when the lock was free). Raises UserError when held.

        Created atomically (a complete file hard-linked into place, which fails when one exists). A stale lock is
        renamed aside, checked to be the one judged stale (not a lock another run just took over), then replaced."""
        note = None
        for _ in range(5):
            tmp = self.path.with_name(f"{LOCK_NAME}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.record))
            try:
                os.link(tmp, self.path)
                return note
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
            holder = self._read(self.path)
            if holder is None:
                if not self.path.exists():
                    continue  # released meanwhile
                raise UserError(f"output_dir {self.path.parent} has a lock file {self.path} that is not a lock this "
                                "trainer wrote (unreadable): delete it if no run uses that output_dir")  # fmt: skip
            alive = _holder_alive(holder)
            if alive:
                raise UserError(f"output_dir {self.path.parent} is in use by another run ({_describe(holder)}): "
                                "wait for it to end, stop it, or choose another output_dir")  # fmt: skip
            if alive is None:
                raise UserError(f"output_dir {self.path.parent} is locked by a run on another host "
                                f"({_describe(holder)}) whose liveness cannot be checked from here: if that job has "
                                f"ended, delete {self.path} and relaunch; else choose another output_dir")  # fmt: skip
            aside = self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                continue
            moved = self._read(aside)
            if moved != holder:  # another run replaced the stale lock between our read and rename: give it back
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
            aside.unlink()
            if moved == holder:
                note = (f"output_dir {self.path.parent}: took over the stale lock of a run that is gone "
                        f"({_describe(holder)})")  # fmt: skip
        raise UserError(f"output_dir {self.path.parent}: could not take {self.path} (other runs keep taking it): "
                        "choose another output_dir")  # fmt: skip

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        holder = self._read(self.path)
        if holder is not None and holder.get("token") == self.record["token"]:
            self.path.unlink(missing_ok=True)


def lock_output_dir(out_dir: Path, decide: Callable[[], Any] = lambda: None) -> Any:
    """Collective: rank 0 takes `out_dir/.lock` (released at exit) and runs `decide()` under it (train/rundir.py
    `claim`: what this run may do with the folder's state); every rank gets decide()'s result, or the same one-line
    error, so that a refused run fails as one line on every rank instead of hanging the others."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        lock = OutputLock(Path(out_dir) / LOCK_NAME)
        try:
            note = lock.acquire()
            at_exit(lock.release)
            if note:
                print(note, flush=True)
            box = [{"ok": decide()}]
        except UserError as e:
            box = [{"error": str(e)}]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if "error" in box[0]:
        raise UserError(box[0]["error"])  # the same message on every rank: printed once
    return box[0]["ok"]


# --- every rank runs the same job ------------------------------------------------------------------------------------

CODE_ROOT = Path(__file__).resolve().parent  # the train/ package: its sources are the code version


def code_digest() -> str:
    """sha256 of the train/ package's Python sources (paths and bytes): equal on ranks that run the same code."""
    h = hashlib.sha256()
    for path in sorted(CODE_ROOT.rglob("*.py")):
        h.update(path.relative_to(CODE_ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def check_ranks_agree(job: dict[str, Any], shown: int = 6) -> None:
    """Collective, the job's first: every rank's `job` (the resolved recipe, the command-line flags, the code
    digest) must be equal. A mismatch (a different `--set` or recipe file on one node, another checkout) is a
    UserError on every rank, the same line: the differing fields, each with its values and the ranks holding them.
    Without it one rank trains silently with another lr, or a different max_steps ends in a collective timeout."""
    if dist.get_world_size() == 1:
        return
    text = json.dumps(job, sort_keys=True, default=str)
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha256(text.encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    jobs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(jobs, text)
    flat = [_flat(json.loads(j)) for j in jobs]
    fields = sorted({k for f in flat for k in f if len({json.dumps(g.get(k, "<unset>")) for g in flat}) > 1})
    said = []
    for key in fields[:shown]:
        by_value: dict[str, list[int]] = {}
        for rank, f in enumerate(flat):
            by_value.setdefault(json.dumps(f.get(key, "<unset>")), []).append(rank)
        said.append(f"{key}: " + ", ".join(f"{v} on ranks {r}" for v, r in by_value.items()))
    more = f"; and {len(fields) - shown} more" if len(fields) > shown else ""
    raise UserError(
        f"the ranks were started with different jobs: {'; '.join(said)}{more}. Start every rank with the same "
        "recipe, --set options, flags and checkout of this repository"
    )


# --- hang watchdog ----------------------------------------------------------------------------------------------------


def _store_client(timeout_s: float) -> dist.Store | None:
    """A client of the launcher's TCPStore (the rendezvous store), owned by the watchdog thread, with its own short
    timeout: a store op must never block the watchdog for long. None without env:// rendezvous."""
    if not launcher_env() or int(os.environ["WORLD_SIZE"]) == 1:
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)  # fmt: skip


def main_thread_site() -> str:
    """Where the main thread waits: the innermost public torch.distributed collective on its stack (else the
    innermost torch.distributed function: an FSDP wait, say) and the innermost frame of this repository's code,
    e.g. `all_to_all_single from train/cp/ulysses.py:88`."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    public, inner, site = None, None, None
    while frame is not None and (public is None or site is None):
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if f"torch{os.sep}distributed{os.sep}" in path:
            inner = inner or name
            if public is None and not name.startswith("_") and callable(getattr(dist, name, None)):
                public = name
        elif site is None and path.startswith(_REPO) and "site-packages" not in path:
            site = f"{path[len(_REPO) :]}:{frame.f_lineno}"
        frame = frame.f_back
    return " from ".join(x for x in (public or inner, site) if x) or "unknown"


def diagnose(rank: int, world: int, seq: int, first: dict[int, dict], second: dict[int, dict]) -> list[int]:
    """The ranks that did not arrive where `rank` (at phase number `seq`) waits: no record, no heartbeat between two
    reads of the store (stopped or dead), or an earlier phase (hung elsewhere)."""
    late = []
    for r in range(world):
        if r == rank:
            continue
        a, b = first.get(r), second.get(r)
        if a is None or b is None or a["beat"] == b["beat"] or b["seq"] < seq:
            late.append(r)
    return late


def keep_alive() -> None:
    """Re-arm this process's watchdog within its current phase (no-op without one): long phases made of many units
    (an export's tensors, a checkpoint's files) call it per unit, so that only one unit must fit parallel.timeout_s."""
    if _ACTIVE is not None:
        _ACTIVE.keep_alive()


class Watchdog:
    """Per-rank hang detector. The training loop calls `phase(name, step)` at the start of each phase (forward,
    backward, optimizer, checkpoint, ...) in the same order on every rank, and `idle()` when it leaves the watched
    part. A daemon thread publishes this rank's heartbeat and phase number to the store every `poll_s`; when the
    phase has not changed for `timeout_s`, it names the ranks that did not arrive, prints one line and exits."""

    def __init__(self, timeout_s: float, rank: int, world: int, store: dist.Store | None, parent: int | None) -> None:
        self.timeout_s, self.rank, self.world, self.store, self.parent = timeout_s, rank, world, store, parent
        self.poll_s = min(5.0, max(0.5, timeout_s / 20))
        self._state: tuple[int, str | None, int, float] = (0, None, 0, time.monotonic())  # seq, phase, step, since
        self._beat = 0
        self._thread = threading.Thread(target=self._run, name="ctxtrain-watchdog", daemon=True)

    @classmethod
    def start(cls, timeout_s: float) -> Watchdog:
        global _ACTIVE
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        wd = cls(timeout_s, rank, world, _store_client(min(10.0, timeout_s)), launcher_pid())
        wd._publish()
        wd._thread.start()
        _ACTIVE = wd
        return wd

    def keep_alive(self) -> None:
        """A unit of work of the current phase is done (a tensor exported, a file hashed): its deadline starts
        again. The phase's number stays, so the hang diagnosis across ranks is unchanged."""
        seq, name, step, _ = self._state
        self._state = (seq, name, step, time.monotonic())

    def phase(self, name: str, step: int) -> None:
        """Enter phase `name` of step `step` (0-based optimizer step); ends the previous phase."""
        self._state = (self._state[0] + 1, name, step, time.monotonic())

    def idle(self) -> None:
        """Leave the watched part (no deadline until the next `phase`)."""
        self._state = (self._state[0] + 1, None, self._state[2], time.monotonic())

    def _key(self, rank: int) -> str:
        return f"{_STORE_PREFIX}/{rank}"

    def _publish(self) -> None:
        if self.store is None:
            return
        seq, name, step, _ = self._state
        self._beat += 1
        try:
            self.store.set(self._key(self.rank), json.dumps({"beat": self._beat, "seq": seq, "phase": name,
                                                             "step": step, "pid": os.getpid()}))  # fmt: skip
        except Exception:  # the store's host is gone or stopped: the deadline check below still runs
            pass

    def _records(self) -> dict[int, dict]:
        out = {}
        for r in range(self.world):
            try:
                if self.store.check([self._key(r)]):
                    out[r] = json.loads(self.store.get(self._key(r)))
            except Exception:
                pass
        return out

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            if self.parent is not None and os.getppid() != self.parent:
                self._fail(f"rank {self.rank}: the launcher (pid {self.parent}) is gone; exiting")
            self._publish()
            seq, name, step, since = self._state
            stuck = time.monotonic() - since
            if name is not None and stuck > self.timeout_s:
                self._report(seq, name, step, stuck)

    def _report(self, seq: int, name: str, step: int, stuck: float) -> None:
        where = main_thread_site()
        line = f"rank {self.rank}: stuck for {stuck:.0f} s in {name} at step {step} ({where})"
        first_to_report = True
        if self.store is not None:
            first = self._records()
            time.sleep(2 * self.poll_s + 0.5)  # a rank that published nothing in two polls is stopped or dead
            self._publish()
            second = self._records()
            late = diagnose(self.rank, self.world, seq, first, second)
            if late:
                line += f"; ranks {late} did not arrive (stopped, hung or dead)"
                silent = [r for r in late if r not in second or first.get(r, {}).get("beat") == second[r]["beat"]]
                behind = [r for r in late if r not in silent]
                if silent:
                    line += f": no heartbeat from {silent}"
                if behind:
                    where = ", ".join(f"{r} in {second[r]['phase']} at step {second[r]['step']}" for r in behind[:4])
                    line += f"{',' if silent else ':'} still in an earlier phase: {where}"
            else:
                line += ("; every rank reached this phase and is alive: a collective mismatch (ranks calling different "
                         "collectives) or a deadlock inside it")  # fmt: skip
            try:  # the first rank to report speaks for the job; the others exit quietly
                first_to_report = self.store.add(f"{_STORE_PREFIX}/reported", 1) == 1
            except Exception:
                pass
        self._fail(line, report=first_to_report)

    def _fail(self, line: str, report: bool = True) -> None:
        if report:
            try:  # stderr may be a pipe to a dead launcher
                print(f"error: {line}", file=sys.stderr, flush=True)
            except OSError:
                pass
            path = os.environ.get("TORCHELASTIC_ERROR_FILE")
            if path:  # torchrun's failure summary shows this line as the root cause
                with open(path, "w") as f:
                    json.dump({"message": f"error: {line}", "timestamp": int(time.time()) - 1}, f)
        exit(1)
