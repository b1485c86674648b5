"""The one test harness: launch the trainer, spawn gloo process groups, check a LoRA export, wait for an event.

A test states what differs, never how to launch:

    run = train(tmp_path / "cp2", "recipes/tiny/wan.yaml", "parallel.cp=2", nproc=2)   # 2 ranks, warm
    assert_same_steps(run.metrics, serial.metrics, "CP 2 vs 1")
    results = spawn(fn, 3, *args)                                                     # fn(rank, world, *args)
    check_lora_reload("wan", pipeline_dir, run.out / "lora")

A run's ranks are forked from the session's warm process (`WarmRanks`), which imported the trainer once: each rank runs
train/finetune.py as the interpreter runs a script (runpy: its preflight, `run_rank`) with the environment `python -m
train.launch` gives its ranks (captured from a real launch), so a tiny run costs seconds, not ~10 s of imports per rank.
`launcher=True` runs the real `python -m train.launch` (what launch/*.sh run: the rank's exit code, one error line, no
launcher traceback) with configs/accelerate/cpu.yaml: the launch-path tests (tests/test_bad_inputs.py, test_runtime.py,
test_launch.py, test_guards.py's signal to the launcher) and per-process memory use it. `Runs` (the `runs` fixture,
tests/conftest.py) memoises runs per distinct command for the whole session, so two tests that need the same run share
one.

Process groups: `spawn` runs a function on N real gloo processes. Tests whose rank functions can share a group
register them with `@rank_job(world, ...)`; the `group` fixture then forks ONE group per world size from the warm
process (real gloo processes, without each rank's imports) for every such job of the selected test modules and hands
each test its job's per-rank results (a failed job raises in its own tests only).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import train.tools.spawn as spawning
from train.tools.spawn import COLLECTIVE_TIMEOUT_S, RankError

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = "configs/accelerate/cpu.yaml"
REL_TOL = 1e-5  # trainer-level CP vs single process: per-step loss and grad norm, relative
# Seconds a launch may take before the test fails: generous for a loaded 2-core machine (a tiny run takes 10-30 s).
LAUNCH_TIMEOUT_S = 600
ENV = {"OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false"}
QUIET = ("logging.wandb_mode=disabled", "logging.progress_bar=false")

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "REPO",
    "Run",
    "Runs",
    "RankError",
    "assert_same_steps",
    "check_lora_reload",
    "first_step",
    "launch_command",
    "load_lora",
    "load_pipeline",
    "rank_job",
    "session_dir",
    "shared_tmpdir",
    "spawn",
    "train",
    "wait_until",
]


# ------------------------------------------------------------------------------------------------------- trainer


def launch_command(
    out: Path | None,
    recipe: str | Path = "recipes/tiny/wan.yaml",
    *overrides: str,
    nproc: int = 1,
    resume: bool = False,
    extra: Iterable[str] = (),
) -> list[str]:
    """The trainer's command line: `python -m train.launch` with accelerate's arguments, the recipe, `--set`s. wandb is
    off and the progress bar too unless an override says otherwise (later `--set`s win). Each launch gets a free port
    of its own: launches started at the same moment (the early scenarios) otherwise race for accelerate's default
    29500, and the one that loses exits before starting its ranks."""
    sets = [*([f"output_dir={out}"] if out is not None else []), *QUIET, *overrides]
    return [sys.executable, "-m", "train.launch", "--config_file", CPU_CONFIG, "--num_processes", str(nproc),
            "--main_process_port", str(spawning._free_port()), "train/finetune.py",
            "--recipe", str(recipe), *[a for s in sets for a in ("--set", s)], *(["--resume"] if resume else []),
            *extra]  # fmt: skip


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, **ENV, **extra}


@dataclass
class Run:
    """One finished launch."""

    out: Path | None
    rc: int
    stdout: str
    stderr: str
    cmd: list[str] = field(repr=False, default_factory=list)

    @property
    def log(self) -> str:
        return self.stdout + self.stderr

    @property
    def metrics(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def errors(self) -> list[str]:
        """The one-line user errors the run printed (`error: ...`)."""
        return [line for line in self.stderr.splitlines() if line.startswith("error")]

    def ok(self) -> Run:
        assert self.rc == 0, (
            f"launch failed ({self.rc}): {' '.join(self.cmd)}\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"
        )
        return self


def train(
    out: Path | None,
    recipe: str | Path = "recipes/tiny/wan.yaml",
    *overrides: str,
    nproc: int = 1,
    resume: bool = False,
    extra: Iterable[str] = (),
    check: bool = True,
    timeout: float = LAUNCH_TIMEOUT_S,
    environ: dict[str, str] | None = None,
    launcher: bool = False,
    rank_extra: dict[int, list[str]] | None = None,
) -> Run:
    """Run the trainer and wait for it; `check`: fail the test unless it exited 0. By default its ranks are forked
    from the session's warm process (`WarmRanks`: the ranks' own code and environment, without ~10 s of imports per
    rank); `launcher=True` starts it through `python -m train.launch` itself, for the claims about the launch path
    (exit codes and lines, signals, launcher death, nodes) and for anything measured per process (memory).
    `rank_extra`: arguments added for some ranks only (warm ranks: a node started with another `--set`)."""
    cmd = launch_command(out, recipe, *overrides, nproc=nproc, resume=resume, extra=extra)
    if launcher or environ is not None:
        assert rank_extra is None, "rank_extra: warm ranks only"
        proc = subprocess.run(cmd, cwd=REPO, env=environ or env(), capture_output=True, text=True, timeout=timeout)
        run = Run(out, proc.returncode, proc.stdout, proc.stderr, cmd)
    else:
        run = Run(out, *WARM.run(cmd[cmd.index("train/finetune.py") :], nproc, timeout, rank_extra), cmd)
    return run.ok() if check else run


# ----------------------------------------------------------------------------------------------------- warm ranks
# A trainer launch spends ~10 s per rank importing torch, diffusers, peft and the trainer before its first line of
# work; a tiny test run then trains for 2-5 s. The warm process imports the trainer once per session and forks each
# run's ranks from it. A forked rank runs what a launched rank runs (the script as `__main__`, through runpy),
# with the environment the real launcher gives its ranks: captured once per session from a real `python -m
# train.launch` of a script that prints it, then per run only the rank, the world size and a free port differ.
# What a fork cannot show is the launcher's own behaviour, and per-process memory: those tests pass launcher=True.

PER_RANK = ("RANK", "LOCAL_RANK", "ROLE_RANK")
PER_WORLD = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE")
# torchrun's agent hosts the rendezvous store and writes error files; without it rank 0 hosts the store (env://)
AGENT_ONLY = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "MASTER_PORT")
GROUP_TIMEOUT_S = 1800  # a shared group runs many jobs (~3 min at world 4 on 2 cores)
PEER_GRACE_S = 2.0  # after a rank fails, its peers' time to exit by themselves before they are killed (as torchrun)


def launcher_environment() -> dict[str, str]:
    """What `python -m train.launch --config_file configs/accelerate/cpu.yaml` adds to rank 0's environment (read
    from a real 2-rank launch), less the agent-only keys; per-rank and per-world keys are set per run."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "print_env.py"
        dump = "open(f\"{sys.argv[1]}.{os.environ['RANK']}\", 'w').write(json.dumps(dict(os.environ)))"
        script.write_text(f"import json, os, sys\n{dump}\n")
        cmd = [sys.executable, "-m", "train.launch", "--config_file", CPU_CONFIG, "--num_processes", "2", str(script),
               f"{tmp}/env"]  # fmt: skip
        subprocess.run(cmd, cwd=REPO, env=env(), check=True, capture_output=True, timeout=LAUNCH_TIMEOUT_S)
        ranks = [json.loads(Path(f"{tmp}/env.{r}").read_text()) for r in range(2)]
    base = env()
    added = {k: v for k, v in ranks[0].items() if base.get(k) != v and k not in AGENT_ONLY}
    differ = {k for k in ranks[0].keys() | ranks[1].keys() if ranks[0].get(k) != ranks[1].get(k)}
    assert differ <= set(PER_RANK) | {"TORCHELASTIC_ERROR_FILE"}, f"the launcher sets per-rank keys {differ}"
    assert all(added[k] == "2" for k in PER_WORLD) and {"RANK", "MASTER_ADDR"} <= added.keys(), added
    return added


def serve() -> None:
    """The warm process (`python -m tests.harness serve`): one JSON request per line on stdin, one JSON reply per
    line on stdout; it ends with its stdin."""
    launched = launcher_environment()
    import train.config
    import train.finetune  # noqa: F401 — the ranks' imports, done once

    protocol = sys.stdout

    def reply(**fields: Any) -> None:
        protocol.write(json.dumps(fields) + "\n")
        protocol.flush()

    for line in sys.stdin:
        reply(rc=_fork_ranks(json.loads(line), launched, reply))


def _fork_ranks(req: dict, launched: dict[str, str], reply: Callable[..., None]) -> int:
    """Fork the request's ranks and wait for them: the first failed rank's exit code (as train.launch), 124 on
    timeout. A trainer run (`argv`) gets the launcher's environment; a process group (`call`) the test's, as
    `train.tools.spawn.run_distributed` gives it."""
    import signal
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    n, pids = req["nproc"], {}
    # torchrun's agent gives each rank an error file in a folder of the run's own (train/errors.py marks there which
    # rank reported a user error first: that rank prints it, whatever the others are still doing when it exits)
    attempt = Path(tempfile.mkdtemp(prefix="ctxtrain-warm-run-")) / "attempt_0"
    for rank in range(n):
        (attempt / str(rank)).mkdir(parents=True)
        per_rank = {**dict.fromkeys(PER_RANK, str(rank)), **dict.fromkeys(PER_WORLD, str(n)), "MASTER_PORT": port,
                    "CTXTRAIN_LAUNCHER_PID": str(os.getpid()),  # this process is their launcher
                    "TORCHELASTIC_ERROR_FILE": str(attempt / str(rank) / "error.json")}  # fmt: skip
        rank_env = {**req["env"], **launched, **per_rank} if "argv" in req else req["env"]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _rank(req, rank_env, rank, int(port))
        pids[rank] = pid
    reply(pids=list(pids.values()))  # the ranks' pids, in rank order, before they end (a test may signal one)
    codes: dict[int, int] = {}
    deadline, failed_at = time.monotonic() + req["timeout"], None
    while len(codes) < n:
        for rank, pid in pids.items():
            if rank not in codes and (done := os.waitpid(pid, os.WNOHANG))[0]:
                codes[rank] = os.waitstatus_to_exitcode(done[1])
                failed_at = failed_at or (codes[rank] != 0 and (rank, time.monotonic()))
        late = failed_at and time.monotonic() - failed_at[1] > PEER_GRACE_S
        if late or time.monotonic() > deadline:
            for rank in set(pids) - set(codes):
                os.kill(pids[rank], signal.SIGKILL)
            if not late:
                shutil.rmtree(attempt.parent, ignore_errors=True)
                return 124
        time.sleep(0.02)
    shutil.rmtree(attempt.parent, ignore_errors=True)
    if not failed_at:
        return 0
    rank, code = failed_at[0], codes[failed_at[0]]
    with open(req["stderr"], "a") as f:
        print(f"launch: rank {rank} exited with code {code} (its error is above)", file=f)
    return code if code > 0 else 1


def _rank(req: dict, rank_env: dict[str, str], rank: int, port: int) -> None:
    """In the forked child: the rank's files, directory and environment, then a trainer rank's entry point (its
    argv, preflight, `run_rank`) or a process group's (`train.tools.spawn.rank_entry` running the call)."""
    try:
        for fd, path in ((1, req["stdout"]), (2, req["stderr"]), (0, os.devnull)):
            os.dup2(os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
        os.chdir(REPO)
        os.environ.clear()
        os.environ.update(rank_env)
        if "call" in req:  # (fn, args), pickled: fn by its importable name
            fn, args = torch.load(req["call"], weights_only=False)
            if req["init_group"]:
                spawning.rank_entry(rank, req["nproc"], port, req["out_dir"], fn, args)
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(req["nproc"]))  # fmt: skip
            torch.save({"ok": True, "result": fn(rank, req["nproc"], *args)}, f"{req['out_dir']}/rank{rank}.pt")
            sys.stdout.flush()
            os._exit(0)
        _run_main(req.get("rank_argv", {}).get(str(rank), req["argv"]))
    except BaseException:  # noqa: BLE001 — a crash of the rank, as the interpreter would print it
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(1)


def _run_main(argv: list[str]) -> None:
    """`python <script> args` or `python -m <module> args` in this process, as the interpreter runs them (runpy, as
    `__main__`; train/finetune.py's own preflight and `run_rank`); leaves with the exit code."""
    import runpy

    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:  # as the interpreter exits: None 0, an int itself, anything else printed, 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else (print(e.code, file=sys.stderr), 1)[1]
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class WarmRanks:
    """The session's warm process, started on first use."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.runs, self.groups = 0, Counter()
        self.pending: WarmRun | None = None  # a run started by `begin`, not yet ended

    def start(self) -> None:
        """Start the warm process now (it imports while the session's first tests run); a no-op when it runs."""
        import tempfile

        if self.proc is not None and self.proc.poll() is None:
            return
        self.log = tempfile.NamedTemporaryFile(prefix="ctxtrain-warm-", suffix=".log", delete=False)
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.harness", "serve"], cwd=REPO, env=env(),
                                     stdin=pipe, stdout=pipe, stderr=self.log, text=True)  # fmt: skip

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the warm process ended: {Path(self.log.name).read_text()[-3000:]}"
        return json.loads(line)

    def _send(self, req: dict, stdout: str, stderr: str) -> list[int]:
        """Send one request (after a background run's end: one run at a time); the ranks' pids (rank order) once
        they are forked."""
        if self.pending is not None:
            self.pending.wait()
        self.start()
        for path in (stdout, stderr):
            Path(path).touch()
        self.proc.stdin.write(json.dumps({**req, "env": env(), "stdout": stdout, "stderr": stderr}) + "\n")
        self.proc.stdin.flush()
        return self._reply()["pids"]

    def _request(self, req: dict, tmp: str) -> tuple[int, str, str]:
        self._send(req, f"{tmp}/stdout", f"{tmp}/stderr")
        rc = self._reply()["rc"]
        return rc, Path(f"{tmp}/stdout").read_text(), Path(f"{tmp}/stderr").read_text()

    def begin(self, argv: list[str], nproc: int, log: Path, timeout: float = LAUNCH_TIMEOUT_S) -> WarmRun:
        """`run` in the background, stdout and stderr into `log`: the ranks' pids now, the exit code later."""
        pids = self._send({"argv": argv, "nproc": nproc, "timeout": timeout}, str(log), str(log))
        self.runs += 1
        self.pending = WarmRun(self, pids)
        return self.pending

    def run(
        self, argv: list[str], nproc: int, timeout: float, rank_extra: dict[int, list[str]] | None = None
    ) -> tuple[int, str, str]:
        """`argv` (a script and its arguments, or `-m module ...`: what `torchrun --nproc_per_node <nproc>` would be
        given) on `nproc` forked ranks with the launcher's environment: (exit code, stdout, stderr). `rank_extra`:
        {rank: arguments appended to that rank's argv}."""
        import tempfile

        req = {"argv": argv, "nproc": nproc, "timeout": timeout}
        req["rank_argv"] = {str(r): [*argv, *more] for r, more in (rank_extra or {}).items()}
        with tempfile.TemporaryDirectory() as tmp:
            rc, out, err = self._request(req, tmp)
        self.runs += 1
        if rc == 124:
            raise subprocess.TimeoutExpired(argv, timeout, out, err)
        return rc, out, err

    def spawn(
        self, fn: Callable, world: int, *args: Any, timeout: float = GROUP_TIMEOUT_S, init_group: bool = True
    ) -> list[Any]:
        """`fn(rank, world, *args)` on `world` gloo ranks forked from the warm process (what
        `train.tools.spawn.run_distributed` runs, without each rank's imports): each rank's result, in rank order.
        `init_group=False`: no group is made; `fn` finds `env://` rendezvous (MASTER_ADDR/PORT, RANK, WORLD_SIZE)."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            torch.save((fn, args), f"{tmp}/call.pt")
            req = {"call": f"{tmp}/call.pt", "nproc": world, "timeout": timeout, "out_dir": tmp}
            req["init_group"] = init_group
            rc, out, err = self._request(req, tmp)
            self.groups[world] += 1
            try:
                return spawning.collect(tmp, world)
            except RankError as e:
                raise RankError(f"{e}\nexit code {rc}; the ranks' output:\n{out[-2000:]}\n{err[-4000:]}") from e

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@dataclass
class WarmRun:
    """A trainer run on warm ranks, started by `WarmRanks.begin`: `pids` (rank order), `poll()` and `wait()` as a
    `subprocess.Popen` has them. One at a time: the warm process answers nothing else until it ends."""

    warm: WarmRanks
    pids: list[int]
    returncode: int | None = None

    def poll(self) -> int | None:
        import select

        if self.returncode is None and select.select([self.warm.proc.stdout], [], [], 0)[0]:
            self.returncode = self.warm._reply()["rc"]
            self.warm.pending = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else LAUNCH_TIMEOUT_S)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("warm run", timeout)
            time.sleep(0.05)
        return self.returncode


WARM = WarmRanks()


class Runs:
    """Session memo of finished runs: one run per distinct (recipe, overrides, nproc)."""

    def __init__(self, root: Path) -> None:
        self.root, self.done = root, {}

    def __call__(self, recipe: str | Path = "recipes/tiny/wan.yaml", *overrides: str, nproc: int = 1) -> Run:
        key = (str(recipe), overrides, nproc)
        if key not in self.done:
            self.done[key] = train(self.root / f"run{len(self.done)}", recipe, *overrides, nproc=nproc)
        return self.done[key]


def assert_same_steps(a: list[dict], b: list[dict], what: str, steps: int | None = None, tol: float = REL_TOL) -> None:
    """The same optimizer steps with per-step loss and grad norm within `tol` relative."""
    steps = steps or len(b)
    assert len(a) >= steps and len(b) >= steps, (what, a, b)
    for x, y in zip(a[:steps], b[:steps]):
        assert x["step"] == y["step"], (what, x, y)
        for key in ("loss", "grad_norm"):
            rel = abs(x[key] - y[key]) / max(abs(y[key]), 1e-12)
            assert rel <= tol, f"{what}, step {x['step']}: {key} {x[key]} vs {y[key]} (rel {rel:.2e})"


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 180, alive: Callable[[], bool] = None):
    """Poll `predicate` (the event) until true; fail naming `what` after `timeout_s`, or at once when `alive()`
    (the process that should cause it) says it ended."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert alive is None or alive(), f"ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.05)


def first_step(
    recipe: str | Path,
    *overrides: str,
    dtype: torch.dtype | None = None,
    dp: int = 1,
    model: torch.nn.Module = None,
    step: int = 0,
) -> dict[str, float]:
    """The serial reference of a run's FIRST optimizer step, in this process, with the trainer's own pieces and no
    CP, FSDP or launcher: the whole model as one process starts it (`train.modeling.whole_model`), each data-parallel
    rank's batches (`make_batches(dp_rank=r, dp_size=dp)`: CP peers share one stream, so CP changes nothing), the
    step's micro-batches and generators (`micro_batches`), the one step (`train.step.micro_batch_loss`), each
    micro-batch's loss scaled by 1 / (grad_accum × dp) so the gradients accumulate to the trainer's MEAN over data
    parallelism. Returns its loss (the mean over micro-batches and groups, as logged) and the global norm of the
    gradients of every trainable parameter (before clipping, as logged). `dtype` (float64) casts the model and the
    batches: the exact reference. `model`: another serial model in its place (its trainable parameters: those with
    requires_grad), e.g. a pipeline's transformer with a LoRA loaded by diffusers. `step`: that optimizer step's
    batches and generators instead of the first's (the earlier steps' batches drawn and left), on the same weights."""
    from train.config import load_recipe
    from train.data.batches import build_dataset, make_batches
    from train.finetune import autocast_dtype, micro_batches
    from train.modeling import family_spec, whole_model
    from train.models import cache_reads
    from train.step import Objective, micro_batch_loss

    r = load_recipe(REPO / recipe if not Path(recipe).is_absolute() else recipe, list(overrides))
    t, spec, cpu = r.train, family_spec(r.model), torch.device("cpu")
    model = model if model is not None else whole_model(r, spec)
    dataset = build_dataset(r, spec, cache_reads(spec.name))
    if dtype is not None:
        model.to(dtype)
    objective, amp, loss = Objective.of(r, spec), None if dtype else autocast_dtype(t.mixed_precision, cpu), 0.0
    for rank in range(dp):
        batches = make_batches(dataset, r, dp_rank=rank, dp_size=dp, device=cpu)
        for skipped in range(step):
            list(micro_batches(batches, t, skipped, rank))
        for _, batch, _, gen in micro_batches(batches, t, step, rank):
            if dtype is not None:
                batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
            micro = micro_batch_loss(model, spec, batch, objective, gen, amp) / (t.grad_accum * dp)
            micro.backward()
            loss += micro.item()
    grads = [p.grad.double() for p in model.parameters() if p.requires_grad and p.grad is not None]
    return {"loss": loss, "grad_norm": torch.sqrt(sum(g.square().sum() for g in grads)).item()}


# ------------------------------------------------------------------------------------------------- process groups


@contextlib.contextmanager
def one_rank_group(tmp: Path):
    """A 1-rank gloo group in this process, standing in for the job's where code under test runs collectives."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(dir=tmp) as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/pg", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def full_disk(where: Callable[[str], bool], room: int = 512):
    """DCP's shard streams whose path satisfies `where` take `room` bytes, then fail with ENOSPC, as a full disk does
    under torch's serializer (which raises its own RuntimeError "unexpected pos" with the OSError as context)."""
    import errno
    from io import RawIOBase

    from torch.distributed.checkpoint.filesystem import FileSystem

    class Full(RawIOBase):
        def __init__(self, stream) -> None:
            self.stream, self.taken = stream, 0

        def write(self, data) -> int:
            self.taken += len(data)
            if self.taken > room:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.stream.write(data)

        def writable(self) -> bool:
            return True

        def tell(self) -> int:
            return self.stream.tell()

        def seek(self, *args) -> int:
            return self.stream.seek(*args)

    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield Full(stream) if "w" in mode and where(str(path)) else stream

    FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        FileSystem.create_stream = real


def spawn(fn: Callable[..., Any], world: int, *args: Any, init_group: bool = True) -> list[Any]:
    """`fn(rank, world, *args)` on `world` gloo processes forked from the warm process (`fn` importable by name,
    `args` picklable); each rank's result, in rank order. `init_group=False`: `fn` makes the process group itself
    (env:// rendezvous is set). A rank's resident memory includes the warm process's imports: a test of a process's
    memory starts processes of its own (`train.tools.spawn.run_distributed`)."""
    return WARM.spawn(fn, world, *args, init_group=init_group)


# world size -> the registering test module -> the jobs ("module:function") it registered for that world
JOBS: dict[int, dict[str, list[str]]] = {}


def rank_job(*worlds: int) -> Callable:
    """Register `fn(rank, world) -> result` to run in the shared group of each of `worlds` (see the module
    docstring), on behalf of the test module that calls this. `fn` must be importable by name (module level of a
    test module or of the package). Jobs that measure a process's resident memory need processes of their own
    (`train.tools.spawn.run_distributed`)."""
    owner = sys._getframe(1).f_globals["__name__"]

    def register(fn: Callable) -> Callable:
        for world in worlds:
            names = JOBS.setdefault(world, {}).setdefault(owner, [])
            if f"{fn.__module__}:{fn.__name__}" not in names:
                names.append(f"{fn.__module__}:{fn.__name__}")
        return fn

    return register


def _run_jobs(rank: int, world: int, jobs: list[str]) -> dict[str, dict]:
    """Every job in order, in one process group; a job that raises is reported, and the next ones still run once
    every rank has finished it (a barrier), so one failure is seen in its own tests."""
    import torch.distributed as dist

    results = {}
    for job in jobs:
        module, name = job.split(":")
        t0 = time.perf_counter()
        try:
            results[job] = {"ok": getattr(importlib.import_module(module), name)(rank, world)}
        except BaseException as e:  # noqa: BLE001 — reported to the test that asked for it
            results[job] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
        results[job]["seconds"] = time.perf_counter() - t0
        dist.barrier()
    return results


class Groups:
    """The session's shared groups (the `group` fixture): forked on first use per world size, running the jobs
    registered by the selected test modules."""

    def __init__(self, modules: set[str]) -> None:
        self.modules, self.results, self.spawn_seconds = modules, {}, {}

    def timings(self) -> list[tuple[int, str, float]]:
        """(world, job, seconds on rank 0) of every job run, and each group's spawn-to-results time as job "*"."""
        rows = [(w, job, r["seconds"]) for w, ranks in self.results.items() for job, r in ranks[0].items()]
        return rows + [(w, "*", s) for w, s in self.spawn_seconds.items()]

    def __call__(self, fn: Callable, world: int) -> list[Any]:
        key = f"{fn.__module__}:{fn.__name__}"
        if world not in self.results:
            jobs = [j for owner, names in JOBS.get(world, {}).items() if owner in self.modules for j in names]
            t0 = time.perf_counter()
            self.results[world] = WARM.spawn(_run_jobs, world, list(dict.fromkeys(jobs)))
            self.spawn_seconds[world] = time.perf_counter() - t0
        ranks = [r.get(key) for r in self.results[world]]
        assert all(r is not None for r in ranks), f"{key} is not a rank_job({world}) of a selected test module"
        failed = [(i, r) for i, r in enumerate(ranks) if "error" in r]
        if failed:
            i, r = failed[0]
            raise RankError(f"{key}: rank {i} failed: {r['error']}\n{r['tb']}")
        return [r["ok"] for r in ranks]


# ------------------------------------------------------------------------------------ scenarios started early

# the registering test module -> its early scenarios
EARLY: dict[str, list[Early]] = {}


class Early:
    """A scenario that mostly waits (a timeout running out, a grace period): `fn(root, started)` runs in a thread
    from the start of the session (tests/conftest.py starts those of the selected test modules), so its idle time
    overlaps the tests before its module's; it appends what it starts to `started` (`subprocess.Popen`s and
    `psutil.Process`es), and whatever is still running is killed when it returns or the session ends. Its module's
    tests read `result()`, which waits for it and raises what it raised."""

    def __init__(self, fn: Callable[[Path, list], Any], owner: str) -> None:
        self.fn, self.owner = fn, owner
        self.started: list = []
        self.thread: Any = None
        self.value: Any = None
        self.error: BaseException | None = None

    def start(self) -> None:
        import tempfile
        import threading

        root = Path(tempfile.mkdtemp(prefix=f"ctxtrain-{self.fn.__name__}-", dir=session_dir()))
        self.thread = threading.Thread(target=self._run, args=(root,), daemon=True, name=self.fn.__name__)
        self.thread.start()

    def _run(self, root: Path) -> None:
        try:
            self.value = self.fn(root, self.started)
        except BaseException as e:  # noqa: BLE001 — raised again in the tests that read it
            self.error = e
        finally:
            self.stop()

    def stop(self) -> None:
        """Continue (a stopped process) and kill what is still running, by process object (never a reused pid); a
        `Popen` started in a session of its own (`start_new_session=True`) with its whole process group."""
        import signal

        for proc in reversed(self.started):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    if isinstance(proc, subprocess.Popen) and os.getpgid(proc.pid) == proc.pid:
                        os.killpg(proc.pid, sig)
                    else:
                        proc.send_signal(sig)
                except Exception:  # noqa: BLE001 — it has ended (ProcessLookupError, psutil.NoSuchProcess)
                    break
            if isinstance(proc, subprocess.Popen):
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass

    def result(self, timeout_s: float = LAUNCH_TIMEOUT_S) -> Any:
        if self.thread is None:
            self.start()  # its module's tests were selected after collection (a plugin): run it now
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the early scenario {self.fn.__name__} still runs after {timeout_s} s"
        if self.error is not None:
            raise self.error
        return self.value


def early(fn: Callable[[Path, list], Any]) -> Early:
    """Register `fn(root, started) -> result` as an early scenario of the calling test module (see `Early`)."""
    scenario = Early(fn, sys._getframe(1).f_globals["__name__"])
    EARLY.setdefault(scenario.owner, []).append(scenario)
    return scenario


SESSION_DIR = "CTXTRAIN_TEST_SESSION_DIR"  # set by tests/conftest.py; the warm ranks inherit it


def session_dir() -> Path:
    """A folder for the whole test session (results computed once and read by later groups); inside a rank job the
    session's own; a job run by hand makes one (in a process group: the same on every rank)."""
    import tempfile

    import torch.distributed as dist

    if SESSION_DIR not in os.environ:
        path = shared_tmpdir() if dist.is_initialized() else tempfile.mkdtemp(prefix="ctxtrain-session-")
        os.environ[SESSION_DIR] = str(path)
    return Path(os.environ[SESSION_DIR])


def shared_tmpdir() -> Path:
    """Inside a rank job: one fresh temporary folder, the same on every rank (rank 0 makes it)."""
    import tempfile

    import torch.distributed as dist

    path = [tempfile.mkdtemp(prefix="ctxtrain-job-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return Path(path[0])


# ----------------------------------------------------------------------------------------------------------- LoRA


# musubi-tuner's Wan layer names -> diffusers' (musubi writes Wan-AI's own module names with "_" for ".")
MUSUBI_WAN = {"self_attn_q": "attn1.to_q", "self_attn_k": "attn1.to_k", "self_attn_v": "attn1.to_v",
              "self_attn_o": "attn1.to_out.0", "cross_attn_q": "attn2.to_q", "cross_attn_k": "attn2.to_k",
              "cross_attn_v": "attn2.to_v", "cross_attn_o": "attn2.to_out.0", "ffn_0": "ffn.net.0.proj",
              "ffn_2": "ffn.net.2"}  # fmt: skip


def musubi_wan_lora(path: Path, model: torch.nn.Module, rank: int, alpha: float, seed: int = 0) -> Path:
    """Someone else's adapter for a Wan `model`: a musubi-tuner / kohya LoRA file (`lora_unet_blocks_0_self_attn_q`
    `.lora_down.weight`, `.lora_up.weight`, `.alpha`) of every block's attention and FFN layers, random values,
    written key by key in that tool's layout (not by our exporter)."""
    from safetensors.torch import save_file

    gen, state = torch.Generator().manual_seed(seed), {}
    for i in range(len(model.blocks)):
        for theirs, ours in MUSUBI_WAN.items():
            layer = model.get_submodule(f"blocks.{i}.{ours}")
            key = f"lora_unet_blocks_{i}_{theirs}"
            state[f"{key}.lora_down.weight"] = torch.randn(rank, layer.in_features, generator=gen) * 0.2
            state[f"{key}.lora_up.weight"] = torch.randn(layer.out_features, rank, generator=gen) * 0.2
            state[f"{key}.alpha"] = torch.tensor(alpha)
    save_file(state, str(path))
    return path


def load_pipeline(family: str, path: Path):
    """The family's diffusers pipeline from a folder, as a user of diffusers 0.42.1 loads it: with the components its
    data encoder passes to `from_pretrained` (Qwen-Image-Edit: its processor, which does not load without
    torchvision); a modular pipeline (MiniMax-H3) then loads its transformer (it loads nothing until asked)."""
    import diffusers

    from train.models import get_encoder, get_family

    cls = getattr(diffusers, get_family(family).pipeline_class)
    pipe = cls.from_pretrained(path, **get_encoder(family).pipeline_components(str(path), None))
    if isinstance(pipe, diffusers.ModularPipeline):
        pipe.load_components(names=["transformer"])
    return pipe


def load_lora(pipe, lora_dir: Path, **load) -> None:
    """A LoRA export into a pipeline, as a user loads it: its `load_lora_weights`, or where the pipeline has none
    (HunyuanVideo 1.5 in diffusers 0.42.1) its transformer's own `load_lora_adapter` (a PeftAdapterMixin)."""
    if hasattr(pipe, "load_lora_weights"):
        pipe.load_lora_weights(lora_dir, **load)
    else:
        weights = "pytorch_lora_weights.safetensors"
        pipe.transformer.load_lora_adapter(lora_dir, prefix="transformer", weight_name=weights)


def check_lora_reload(family: str, pipeline_dir: Path, lora_dir: Path, rank: int = 4, alpha: float = 8.0, **load):
    """The exported LoRA loads into the family's diffusers pipeline as a user loads it (`load_pipeline`, `load_lora`,
    with `load`'s arguments, e.g. `load_into_transformer_2=True`): every exported tensor lands on its module with the
    trained value, nothing else is loaded but zeros (diffusers pads Wan I2V's image K/V projections with zero
    adapters), and an adapted layer computes W x + (alpha / rank) B A x with the trained, non-zero B. Returns the
    loaded pipeline."""
    from safetensors.torch import load_file

    pipe = load_pipeline(family, pipeline_dir)
    load_lora(pipe, lora_dir, **load)
    target = pipe.transformer_2 if load.get("load_into_transformer_2") else pipe.transformer
    exported = load_file(Path(lora_dir) / "pytorch_lora_weights.safetensors")
    loaded = {n: p for n, p in target.named_parameters() if ".lora_" in n}
    assert exported and loaded, (len(exported), len(loaded))
    matched = set()
    for name, value in exported.items():  # transformer.<module>.lora_A.weight -> <module>.lora_A.<adapter>.weight
        module, kind = name.split(".", 1)[1].rsplit(".lora_", 1)
        hits = [n for n in loaded if n.startswith(f"{module}.lora_{kind.split('.')[0]}.")]
        assert len(hits) == 1 and torch.equal(loaded[hits[0]], value), name
        matched.add(hits[0])
    assert all(not loaded[n].any() for n in set(loaded) - matched), sorted(set(loaded) - matched)
    a_name = next(n for n in exported if n.endswith(".lora_A.weight"))
    a, b = exported[a_name], exported[a_name.replace(".lora_A.", ".lora_B.")]
    layer = target.get_submodule(a_name.split(".", 1)[1].removesuffix(".lora_A.weight"))
    assert b.abs().max() > 0  # trained away from peft's B = 0
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer.base_layer(x) + alpha / rank * (x @ a.T @ b.T))
    return pipe


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
