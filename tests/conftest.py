"""Session fixtures of the one test harness (tests/harness.py) and the tiers.

Tiers: `pytest -m "not slow"` is the fast tier (seconds to minutes: no trainer launch, no process group); the full
suite is plain `pytest`. A test is `slow` when it launches the trainer or spawns processes: the fixtures `runs`,
`group` and `launcher` mark it so by themselves, a test that spawns directly carries `@pytest.mark.slow`.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness import EARLY, WARM, Groups, Runs, session_dir

SLOW_FIXTURES = {"runs", "group", "launcher"}

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# What the session started, counted where it happens (not by the harness's own bookkeeping): every child process
# through a `subprocess.Popen` audit hook (a trainer launch is one whose command runs train.launch or the trainer
# script), every gloo process group through train.tools.spawn.run_distributed (tests, check_plan, bench); and what
# the warm process forked (tests/harness.py `WarmRanks`: its trainer runs and its process groups). The warm process
# itself is one "other process"; the one real 2-rank launch it makes to read the launcher's environment is not counted.
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
    session_dir()  # before the warm process starts: its ranks share the session's folder
    config.addinivalue_line("markers", "slow: launches the trainer or spawns processes (left out of the fast tier)")
    import train.tools.spawn

    train.tools.spawn.run_distributed = _count_groups(train.tools.spawn.run_distributed)
    sys.addaudithook(_count_processes)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.get_closest_marker("slow") for item in session.items):
        WARM.start()  # its imports overlap the first tests; the slow tests fork from it
    modules = {item.module.__name__ for item in session.items if item.get_closest_marker("slow")}
    for scenario in (s for owner in sorted(modules & set(EARLY)) for s in EARLY[owner]):
        scenario.start()  # its waits overlap the tests before its module's (tests/harness.py `Early`)


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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for scenario in (s for scenarios in EARLY.values() for s in scenarios):
        scenario.stop()
    WARM.close()
    shutil.rmtree(session_dir(), ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """What the session started, and the shared groups' time per job (rank 0), so `pytest --durations` users see
    what a group spends where."""
    if STARTED or WARM.runs or WARM.groups:
        terminalreporter.section("processes started")
        warm = {"runs on forked warm ranks (trainer, prepare)": WARM.runs} if WARM.runs else {}
        warm |= {f"process groups of {w} on forked warm ranks": n for w, n in WARM.groups.items()}
        for what, n in sorted({**STARTED, **warm}.items()):
            terminalreporter.write_line(f"{n:5d}  {what}")
    rows = [row for g in GROUPS for row in g.timings()]
    if rows:
        terminalreporter.section("shared process groups (seconds, rank 0)")
        for world, job, seconds in sorted(rows, key=lambda r: (r[0], r[1] != "*", -r[2])):
            terminalreporter.write_line(f"{seconds:8.1f}  world {world}  {'start to results' if job == '*' else job}")


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_pipeline(family)`: the family's tiny pipeline folder, built once per session."""
    from train.models import build_tiny_pipeline

    root = tmp_path_factory.mktemp("tiny_pipelines")
    return functools.cache(lambda family: build_tiny_pipeline(family, root / family))


@pytest.fixture
def launcher() -> None:
    """Marks a test that launches the trainer itself (through tests/harness.py `train`)."""
