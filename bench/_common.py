"""Helpers shared by the CPU benchmarks: parallel configs, markdown tables, a header line."""

from __future__ import annotations

import datetime
import os
import platform

import torch
import torch.distributed as dist


def code_version() -> str:
    """HEAD commit, and whether the CP core (train/cp, cp_plans) differs from it in the working tree."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "train/cp", "cp_plans"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "code: unknown (no git)"
    return f"code: HEAD {head}" + (", train/cp or cp_plans modified in the working tree" if dirty else "")


def header(title: str) -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    import diffusers

    return (
        f"## {title}\n\n{now}, {platform.machine()} CPU ({os.cpu_count()} cores), torch {torch.__version__}, "
        f"diffusers {diffusers.__version__}, gloo; {code_version()}\n"
    )


def table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def parallel_config(world: int, anything: bool):
    """A config for op-level calls (works on CPU). Ulysses-Anything: a `ContextParallelState` as
    `enable_context_parallel` makes (its `.layout` and `.transport.stats` are the benchmark's to drive and read);
    even Ulysses: diffusers' plain `ParallelConfig`."""
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import ContextParallelState

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    if anything:
        return ContextParallelState.on_mesh(mesh, scope="bench")
    cp = ContextParallelConfig(ring_degree=1, ulysses_degree=world, ulysses_anything=False, mesh=mesh)
    cfg = ParallelConfig(context_parallel_config=cp)
    cfg.setup(dist.get_rank(), world, torch.device("cpu"), mesh=mesh)
    return cfg


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
