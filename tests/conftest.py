"""Session fixtures of the one test harness (tests/harness.py) and the tiers.

Tiers: `pytest -m "not slow"` is the fast tier (seconds to minutes: no trainer launch, no process group); the full
suite is plain `pytest`. A test is `slow` when it launches the trainer or spawns processes: the fixtures `runs`,
`group` and `launcher` mark it so by themselves, a test that spawns directly carries `@pytest.mark.slow`.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness import Groups, Runs

SLOW_FIXTURES = {"runs", "group", "launcher"}

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# What the session started, counted where it happens (not by the harness's own bookkeeping): every child process
# through a `subprocess.Popen` audit hook (a trainer launch is one whose command runs train.launch or the trainer
# script), every gloo process group through train.tools.spawn.run_distributed (tests, check_plan, bench).
STARTED: Counter = Counter()
TRAINER_ARGS = ("train.launch", "train/finetune.py", "train.finetune")


def _count_processes(event: str, args: tuple) -> None:
    if event == "subprocess.Popen":
        argv = [str(a) for a in (args[1] if isinstance(args[1], list | tuple) else [args[1]])]
        trainer = any(a in TRAINER_ARGS for a in argv) and "--dry-run" not in argv
        STARTED["trainer launches" if trainer else "other processes"] += 1


def _count_groups(run_distributed: Callable) -> Callable:
    @functools.wraps(run_distributed)
    def counted(fn, world, *args, **kwargs):
        STARTED[f"process groups of {world}"] += 1
        return run_distributed(fn, world, *args, **kwargs)

    return counted


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: launches the trainer or spawns processes (left out of the fast tier)")
    import train.tools.spawn

    train.tools.spawn.run_distributed = _count_groups(train.tools.spawn.run_distributed)
    sys.addaudithook(_count_processes)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Finished trainer launches, one per distinct (recipe, overrides, nproc), shared by the whole session."""
    return Runs(tmp_path_factory.mktemp("runs"))


GROUPS: list[Groups] = []  # the session's shared groups, for the timing summary


@pytest.fixture(scope="session")
def group(request: pytest.FixtureRequest) -> Groups:
    """`group(fn, world)`: the per-rank results of `fn`, a `rank_job` of the shared `world`-rank group (one spawn
    per world size for every job of the selected test modules)."""
    modules = {item.module.__name__ for item in request.session.items if getattr(item, "module", None) is not None}
    GROUPS.append(Groups(modules))
    return GROUPS[-1]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """What the session started, and the shared groups' time per job (rank 0), so `pytest --durations` users see
    what a group spends where."""
    if STARTED:
        terminalreporter.section("processes started")
        for what, n in sorted(STARTED.items()):
            terminalreporter.write_line(f"{n:5d}  {what}")
    rows = [row for g in GROUPS for row in g.timings()]
    if rows:
        terminalreporter.section("shared process groups (seconds, rank 0)")
        for world, job, seconds in sorted(rows, key=lambda r: (r[0], r[1] != "*", -r[2])):
            terminalreporter.write_line(f"{seconds:8.1f}  world {world}  {'spawn to results' if job == '*' else job}")


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_pipeline(family)`: the family's tiny pipeline folder, built once per session."""
    from train.models import build_tiny_pipeline

    root = tmp_path_factory.mktemp("tiny_pipelines")
    return functools.cache(lambda family: build_tiny_pipeline(family, root / family))


@pytest.fixture
def launcher() -> None:
    """Marks a test that launches the trainer itself (through tests/harness.py `train`)."""
