"""Run a function on N real gloo processes (CPU) and collect what each rank returns.

Results come back through files, not `mp.Queue` (a queue can hang when the producer exits first). A timeout on the
process group turns a mismatched collective into an error instead of a hang. Used by the tests (tests/harness.py)
and the plan checker (`python -m train.tools.check_plan`).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_entry(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    """One rank: joins the gloo group on `port`, runs `fn(rank, world, *args)`, writes its result (or failure) to
    `out_dir/rank<r>.pt` and leaves the process."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # N ranks share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # nobody tears the group down while a peer still has a collective in flight
    except BaseException as e:  # report the failure of every rank, not only the first
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()},
                   Path(out_dir) / f"rank{rank}.pt")  # fmt: skip
        raise
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's background threads were seen to abort the process there
    # ("terminate called without an active exception") after all work was done and reported.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankError(RuntimeError):
    pass


def run_distributed(fn: Callable[..., Any], world: int, *args: Any, raise_on_error: bool = True) -> list[Any]:
    """Spawn `world` gloo processes running `fn(rank, world, *args)`; return each rank's result (rank order).

    With `raise_on_error=False`, a failed rank's entry is `{"error": ..., "tb": ...}` instead of raising.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(rank_entry, args=(world, _free_port(), out_dir, fn, args), nprocs=world,
                               start_method="spawn", join=True)  # fmt: skip
        except mp.ProcessRaisedException:
            if raise_on_error:
                pass  # the per-rank files below carry the full story
        except mp.ProcessExitedException as e:
            raise RankError(f"a rank died: {e}") from e
        return collect(out_dir, world, raise_on_error)


def collect(out_dir: str | Path, world: int, raise_on_error: bool = True) -> list[Any]:
    """Each rank's result from `out_dir` (rank order); a failed or silent rank raises, or with `raise_on_error=False`
    gives `{"error": ..., "tb": ...}`."""
    results = []
    for r in range(world):
        f = Path(out_dir) / f"rank{r}.pt"
        rec = torch.load(f, weights_only=False) if f.exists() else {"ok": False, "error": "no result", "tb": ""}
        if not rec["ok"] and raise_on_error:
            raise RankError(f"rank {r} failed: {rec['error']}\n{rec['tb']}")
        results.append(rec["result"] if rec["ok"] else {"error": rec["error"], "tb": rec["tb"]})
    return results
