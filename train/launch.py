"""`accelerate launch` with the job's real outcome as its exit code, and no launcher traceback on top of ours.

    python -m train.launch --config_file configs/accelerate/cpu.yaml --num_processes 2 train/finetune.py \
        --recipe recipes/tiny/wan.yaml [--set key=value ...]

Takes exactly `accelerate launch`'s arguments (the launch scripts in launch/ call it). A plain `accelerate launch`
always exits 1 when a rank fails and prints torchrun's ChildFailedError traceback after the rank's own one-line error,
so the last lines on screen never name the cause; and it exits 1 with a SignalException traceback when SIGTERM (SLURM
preemption) stops a job that checkpointed cleanly. Here:

- a rank failed: exit with the first failed rank's exit code (2 for a user error, whose one line the rank printed)
  and one closing line naming the rank, instead of the traceback;
- SIGINT/SIGTERM: exit 0 when the trainer stopped cleanly (it wrote `<output_dir>/stopped.json` at the step it
  checkpointed, or at the end of a run it completed, after this launch began), else 128 + the signal number and one
  line (Ctrl-C before the first step: the ranks exit 130 without a traceback, train/errors.py `quiet_interrupt`);
- its pid in the ranks' environment (`CTXTRAIN_LAUNCHER_PID`): a rank whose launcher was killed while the rank was
  still importing exits as soon as it can tell (train/runtime.py `die_with_launcher`), never left running.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _output_dir(argv: list[str]) -> Path | None:
    """The trained recipe's output_dir (recipe file + --set overrides), without importing torch."""
    try:
        script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        import argparse

        from train.config import add_recipe_args, recipe_from_args

        parser = argparse.ArgumentParser(add_help=False)
        add_recipe_args(parser)
        args, _ = parser.parse_known_args(argv[script + 1 :])
        return Path(recipe_from_args(args).output_dir)
    except Exception:  # noqa: BLE001 — the trainer itself reports a bad recipe
        return None


def main(argv: list[str] | None = None) -> int:
    try:
        return _launch(argv)
    except KeyboardInterrupt:  # Ctrl-C before torchrun's agent handles signals (its imports, the ranks' start)
        print("launch: interrupted (SIGINT) before the ranks started training; nothing to checkpoint", file=sys.stderr)
        return 128 + 2


def _launch(argv: list[str] | None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from train.runtime import LAUNCHER_PID_ENV

    argv = sys.argv[1:] if argv is None else argv
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the ranks' parent: a rank whose launcher died exits at once
    started = time.time()
    try:
        launch_command(launch_command_parser().parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode == 128 + 2:  # the rank's Ctrl-C exit (train/errors.py quiet_interrupt) came first
            print(f"launch: stopped by SIGINT (rank {rank} first) before the trainer could checkpoint", file=sys.stderr)
        else:
            print(f"launch: rank {rank} exited with code {failure.exitcode} (its error is above)", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as e:
        out = _output_dir(argv)
        marker = out / "stopped.json" if out else None
        if marker and marker.exists() and json.loads(marker.read_text()).get("time", 0) >= started:
            return 0  # the trainer finished its step, checkpointed and said where
        print(f"launch: stopped by {e.sigval.name} before the trainer could checkpoint", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
