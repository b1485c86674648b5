"""The one test harness: launch the trainer, spawn gloo process groups, check a LoRA export, wait for an event.

A test states what differs, never how to launch:

    run = train(tmp_path / "cp2", "recipes/tiny/wan.yaml", "parallel.cp=2", nproc=2)   # python -m train.launch
    assert_same_steps(run.metrics, serial.metrics, "CP 2 vs 1")
    results = spawn(fn, 3, *args)                                                     # fn(rank, world, *args)
    check_lora_reload("wan", pipeline_dir, run.out / "lora")

Launches go through `python -m train.launch` (what launch/*.sh run: the rank's exit code, one error line, no
launcher traceback) with configs/accelerate/cpu.yaml. `Runs` (the `runs` fixture, tests/conftest.py) memoises
launches per distinct command for the whole session, so two tests that need the same run share one launch.

Process groups: `spawn` runs a function on N real gloo processes. Tests whose rank functions can share a group
register them with `@rank_job(world, ...)`; the `group` fixture then spawns ONE group per world size for every such
job of the selected test modules and hands each test its job's per-rank results (a failed job raises in its own
tests only).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import traceback
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
    script: str = "train/finetune.py",
) -> list[str]:
    """The trainer's command line: `python -m train.launch` with accelerate's arguments, the recipe, `--set`s. wandb is
    off and the progress bar too unless an override says otherwise (later `--set`s win)."""
    sets = [*([f"output_dir={out}"] if out is not None else []), *QUIET, *overrides]
    return [sys.executable, "-m", "train.launch", "--config_file", CPU_CONFIG, "--num_processes", str(nproc), script,
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
    script: str = "train/finetune.py",
) -> Run:
    """Launch the trainer and wait for it; `check`: fail the test unless it exited 0."""
    cmd = launch_command(out, recipe, *overrides, nproc=nproc, resume=resume, extra=extra, script=script)
    proc = subprocess.run(cmd, cwd=REPO, env=environ or env(), capture_output=True, text=True, timeout=timeout)
    run = Run(out, proc.returncode, proc.stdout, proc.stderr, cmd)
    return run.ok() if check else run


class Runs:
    """Session memo of finished launches: one launch per distinct (recipe, overrides, nproc)."""

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


def first_step(recipe: str | Path, *overrides: str, dtype: torch.dtype | None = None, dp: int = 1) -> dict[str, float]:
    """The serial reference of a run's FIRST optimizer step, in this process, with the trainer's own pieces and no
    CP, FSDP or launcher: the whole model as one process starts it (`train.modeling.whole_model`), each data-parallel
    rank's batches (`make_batches(dp_rank=r, dp_size=dp)`: CP peers share one stream, so CP changes nothing), the
    step's micro-batches and generators (`micro_batches`), the one step (`train.step.micro_batch_loss`), each
    micro-batch's loss scaled by 1 / (grad_accum × dp) so the gradients accumulate to the trainer's MEAN over data
    parallelism. Returns its loss (the mean over micro-batches and groups, as logged) and the global norm of the
    gradients of every trainable parameter (before clipping, as logged). `dtype` (float64) casts the model and the
    batches: the exact reference."""
    from train.config import load_recipe
    from train.data.batches import build_dataset, make_batches
    from train.finetune import autocast_dtype, micro_batches
    from train.modeling import family_spec, whole_model
    from train.models import cache_reads
    from train.step import Objective, micro_batch_loss

    r = load_recipe(REPO / recipe if not Path(recipe).is_absolute() else recipe, list(overrides))
    t, spec, cpu = r.train, family_spec(r.model), torch.device("cpu")
    model, dataset = whole_model(r, spec), build_dataset(r, spec, cache_reads(spec.name))
    if dtype is not None:
        model.to(dtype)
    objective, amp, loss = Objective.of(r, spec), None if dtype else autocast_dtype(t.mixed_precision, cpu), 0.0
    for rank in range(dp):
        batches = make_batches(dataset, r, dp_rank=rank, dp_size=dp, device=cpu)
        for _, batch, _, gen in micro_batches(batches, t, 0, rank):
            if dtype is not None:
                batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
            micro = micro_batch_loss(model, spec, batch, objective, gen, amp) / (t.grad_accum * dp)
            micro.backward()
            loss += micro.item()
    grads = [p.grad.double() for p in model.parameters() if p.requires_grad and p.grad is not None]
    return {"loss": loss, "grad_norm": torch.sqrt(sum(g.square().sum() for g in grads)).item()}


# ------------------------------------------------------------------------------------------------- process groups


def spawn(fn: Callable[..., Any], world: int, *args: Any, raise_on_error: bool = True) -> list[Any]:
    """`fn(rank, world, *args)` on `world` gloo processes; each rank's result, in rank order."""
    return spawning.run_distributed(fn, world, *args, raise_on_error=raise_on_error)


# world size -> the registering test module -> the jobs ("module:function") it registered for that world
JOBS: dict[int, dict[str, list[str]]] = {}


def rank_job(*worlds: int) -> Callable:
    """Register `fn(rank, world) -> result` to run in the shared group of each of `worlds` (see the module
    docstring), on behalf of the test module that calls this. `fn` must be importable by name (module level of a
    test module or of the package). Jobs that measure a process's memory need processes of their own: `spawn`."""
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
    """The session's shared groups (the `group` fixture): spawned on first use per world size, running the jobs
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
            self.results[world] = spawn(_run_jobs, world, list(dict.fromkeys(jobs)))
            self.spawn_seconds[world] = time.perf_counter() - t0
        ranks = [r.get(key) for r in self.results[world]]
        assert all(r is not None for r in ranks), f"{key} is not a rank_job({world}) of a selected test module"
        failed = [(i, r) for i, r in enumerate(ranks) if "error" in r]
        if failed:
            i, r = failed[0]
            raise RankError(f"{key}: rank {i} failed: {r['error']}\n{r['tb']}")
        return [r["ok"] for r in ranks]


def shared_tmpdir() -> Path:
    """Inside a rank job: one fresh temporary folder, the same on every rank (rank 0 makes it)."""
    import tempfile

    import torch.distributed as dist

    path = [tempfile.mkdtemp(prefix="ctxtrain-job-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return Path(path[0])


# ----------------------------------------------------------------------------------------------------------- LoRA


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
