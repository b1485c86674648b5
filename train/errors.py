"""The one error type for user mistakes: a recipe, path, data, cache, plan, degree or shape the user can fix.

Raised before any collective, it is printed as one line with cause and fix, exit code 2, no traceback (`--debug`
shows it). `same_on_every_rank=True` (the default) when every rank sees the same input and raises the same error:
then one rank alone prints it; False when only this rank saw it (its own data shard, its own file): that rank prints
it, naming itself.

Under a launcher (`accelerate launch`, `torchrun`), a failed rank makes the launcher print its own ChildFailedError
traceback and failure summary after our line, and the launcher exits 1 whatever the rank's code. `report` also
writes the message to the error file torchrun gives each rank (`TORCHELASTIC_ERROR_FILE`), so that summary's last
lines, under "Root Cause", read `traceback : error: <cause and fix>` instead of a link to torch's docs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

EXIT_CODE = 2  # a user error (argparse's code for bad arguments too)


class UserError(ValueError):
    def __init__(self, message: str, *, same_on_every_rank: bool = True) -> None:
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank


def report(error: UserError, rank: int | None = None) -> int:
    """Print `error: <message>` once and hand it to the launcher; returns the exit code (2). `rank` defaults to the
    launcher's RANK (0 without one).

    Once: a rank-local error is printed by its rank. An error every rank raises is printed by the first rank of
    this machine to get here, not by rank 0: the launcher kills the other ranks as soon as one exits, so rank 0 may
    never get to print. Which rank is first is settled by creating a marker file in the launcher's run folder (the
    folder holding each local rank's error file); without a launcher, rank 0 prints.
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    marker = _reported_marker()
    if not error.same_on_every_rank:
        first = True
        if marker:  # the peers it leaves inside a collective then exit quietly (peer_reported)
            with contextlib.suppress(OSError):
                marker.touch()
    elif marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            first = True
        except FileExistsError:
            first = False
        except OSError:
            first = rank == 0
    else:
        first = rank == 0
    if first:
        where = "" if error.same_on_every_rank or int(os.environ.get("WORLD_SIZE", "1")) == 1 else f"rank {rank}: "
        print(f"error: {where}{error}", file=sys.stderr, flush=True)
    if error_file:  # torchrun's failure summary shows the earliest failure's file: every raising rank writes the line
        # One second early: ranks the launcher then terminates are stamped with the second it notices them, and the
        # summary breaks ties by rank order; the cause must win over "Signal 15 received".
        with open(error_file, "w") as f:
            json.dump({"message": f"error: {error}", "timestamp": int(time.time()) - 1}, f)
    return EXIT_CODE


def _reported_marker() -> Path | None:
    """The file whose existence says a rank of this launch has reported a user error (in the launcher's run folder,
    which holds each local rank's error file); None without a launcher."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return Path(error_file).parents[1] / "user_error_reported" if error_file else None


def peer_reported() -> bool:
    """Whether a rank of this launch has reported a user error: then this rank's own failure (gloo's "connection
    closed by peer" inside the collective that rank left) is its consequence, not a second error to print."""
    marker = _reported_marker()
    return marker is not None and marker.exists()


def quiet_interrupt() -> None:
    """Ctrl-C before the training loop (imports, loading, compiling: nothing to checkpoint yet) ends this rank at once
    with exit code 130 and no traceback: the terminal sends SIGINT to the launcher and every rank at once, and the
    launcher says it in one line (train/launch.py). The loop's own handler (finetune.py `StopRequest`) replaces
    this one: from then on a signal finishes the step and checkpoints."""

    def stop(signum: int, frame) -> None:
        # Leave at once, unwinding nothing: an exception raised here lands inside whatever import or load is running
        # (numpy's lazy attributes turned one into a RecursionError traceback). The exit hooks (the output_dir lock)
        # run when train.runtime is loaded; a lock left by an earlier exit names a dead pid and is taken over.
        if "LOCAL_RANK" not in os.environ:  # no launcher to say it
            print(f"stopped by {signal.Signals(signum).name} before the first step: nothing to checkpoint",
                  file=sys.stderr)  # fmt: skip
        runtime = sys.modules.get("train.runtime")
        if runtime is not None:
            runtime.exit(128 + signum)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, stop)
