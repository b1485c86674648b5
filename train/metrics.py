"""Run monitoring: `<output_dir>/metrics.jsonl` (one JSON line per optimizer step) and wandb through Accelerate.

wandb needs no account: mode "offline" writes `<output_dir>/wandb/offline-run-*/` that `wandb sync` uploads later.
Settings are passed as init arguments (wandb ignores environment variables changed after its first init).
"""

from __future__ import annotations

import errno as errnos
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from train.errors import UserError
from train.tracking import check_tracking


def device_memory(device: torch.device) -> dict[str, int]:
    """On a GPU, what the device holds beyond the allocated peak: the caching allocator's reserved peak and its reserve
    now, and the device's used memory now (total - free: the reserve, the CUDA context and NCCL's buffers included).
    The step's true peak is `peak_reserved + device_used - reserved`: what must fit, what train.estimate predicts.
    Nothing on CPU (the peak RSS says it all)."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
            "reserved_bytes": torch.cuda.memory_reserved(device), "device_used_bytes": total - free}  # fmt: skip


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # CPU: the process's peak resident set
    return rss if sys.platform == "darwin" else rss * 1024


WANDB_STATE = "logged.json"  # <output_dir>/wandb/logged.json: the run's wandb id and the last step it logged
UNKNOWN_ERRNO = 1 << 20  # the flag of an OSError without an errno (errnos are small positive ints)
STATE_FILE = 1 << 21  # added to the flag when the write that failed was wandb/logged.json's


class MetricsLogger:
    """Writes metrics on rank 0 only; every rank calls it (so the call sites stay free of rank checks).

    One wandb run per run of the output_dir: its id is the run's (run.json, train/rundir.py), so a resumed run continues
    the same wandb run (online: wandb's resume; offline: `wandb sync` of its folders fills one run). The last step sent
    to wandb is kept in `wandb/logged.json`; a resumed run recomputes the steps after its checkpoint (identically) and
    sends wandb only the steps after that one, so no step is logged twice; a damaged logged.json is rebuilt from
    metrics.jsonl with a warning (`_logged_before`). No credential is read or written here: online mode uses the
    user's own `wandb login` (or WANDB_API_KEY), which `check_tracking` looks for at startup.

    A metrics write that fails on rank 0 (a full disk) is one UserError on every rank (`log`): what failed, and where
    the run's last complete checkpoint is."""

    def __init__(self, accelerator, output_dir: Path, run_config: dict, logging_cfg, run_name: str,
                 run_id: str | None = None) -> None:  # fmt: skip
        self.accelerator, self.is_main = accelerator, accelerator.is_main_process
        self.out, self.path = output_dir, output_dir / "metrics.jsonl"
        self.use_wandb = logging_cfg.wandb_mode != "disabled"
        self.last_step: int | None = None  # the last step logged to wandb by this process
        self.state = output_dir / "wandb" / WANDB_STATE
        self.run_id, self.before = run_id, -1  # wandb holds this run's steps up to here (an earlier process of the run)
        if self.is_main and self.use_wandb:
            if run_id is not None and (self.state.exists() or self.state.is_symlink()):
                self.before = self._logged_before(run_id)
            self.state.parent.mkdir(parents=True, exist_ok=True)
            wandb = {"mode": logging_cfg.wandb_mode, "dir": str(output_dir), "name": logging_cfg.wandb_run or run_name,
                     **({"id": run_id, "resume": "allow"} if run_id is not None else {})}  # fmt: skip
            accelerator.init_trackers(logging_cfg.wandb_project, config=run_config, init_kwargs={"wandb": wandb})
            run = accelerator.get_tracker("wandb", unwrap=True)
            run.define_metric("step")  # charts against the optimizer step (also the end-of-run report's images)
            run.define_metric("*", step_metric="step")

    check_tracking = staticmethod(check_tracking)  # train/tracking.py: online wandb's login and server, at startup

    def _logged_before(self, run_id: str) -> int:
        """The last step an earlier process of this run sent wandb, from logged.json (0: the file is another wandb
        run's). The file only spares wandb steps it holds already, so a damaged one is rebuilt, with a warning, not a
        reason to refuse the resume: metrics.jsonl gets each line before wandb does, so its last step is what wandb
        holds, give or take: one step fewer if a kill fell between the two writes (that step stays missing in wandb);
        more if an earlier resume was cut short after truncating metrics.jsonl (those steps are sent again, and wandb
        drops a step below the one it holds, with a warning). Nothing of the run's training state is involved."""
        try:
            saved = json.loads(self.state.read_text())
            ours = isinstance(saved, dict) and saved.get("id") == run_id
            if isinstance(saved, dict) and "id" in saved and not ours:
                return 0
            last = saved.get("last_step") if ours else None
            if isinstance(last, int) and not isinstance(last, bool) and last >= -1:
                return last
            why = f"last_step is {last!r}" if ours else "not an {id, last_step} object"
        except (OSError, ValueError) as e:  # unreadable, a folder, not UTF-8 or not JSON
            why = f"{type(e).__name__}: {e}"
        from train.report import read_metrics

        lines = read_metrics(self.path)[0] if self.path.is_file() else []
        before = max((ln["step"] for ln in lines), default=-1)
        try:
            self._save_state(before)
        except OSError as e:
            raise UserError(
                f"{self.state} is damaged ({why}) and cannot be rewritten ({e.strerror or e}): remove it "
                "(it records only the last step sent to wandb), then rerun with --resume"
            ) from None
        print(f"warning: {self.state} was damaged ({why}); rebuilt from {self.path.name}: wandb gets the steps after "
              f"step {before}" + (" (its last line)" if lines else " (no metrics line: every step)"),
              file=sys.stderr, flush=True)  # fmt: skip
        return before

    def _save_state(self, step: int) -> None:
        tmp = self.state.with_suffix(".tmp")  # atomic: a kill leaves the old file or the new one
        tmp.write_text(json.dumps({"id": self.run_id, "last_step": step}))
        tmp.rename(self.state)

    def _to_wandb(self, step: int) -> bool:
        return self.is_main and self.use_wandb and step > self.before

    def log(self, metrics: dict[str, Any]) -> None:
        """Rank 0 appends the line to metrics.jsonl (and sends it to wandb). Every rank calls it at the same steps: a
        write that fails on rank 0 (a full disk) raises the same UserError on every rank."""
        failure = self._write(metrics) if self.is_main else 0
        # The cost: one all_reduce of one int per logged line (every logging.every_n_steps steps), next to a step's
        # own collectives. What it buys: every rank stops with the same line, not rank 0 with a traceback and the
        # others with gloo's "connection closed" in their next collective.
        if dist.is_available() and dist.is_initialized():
            gpu = dist.get_backend() == "nccl"  # (a "cuda:nccl,cpu:gloo" group takes the CPU tensor through gloo)
            flag = torch.tensor([failure], dtype=torch.int64,
                                device=torch.device("cuda", torch.cuda.current_device()) if gpu else "cpu")  # fmt: skip
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            failure = int(flag.item())
        if failure:
            raise UserError(self._unwritable(failure, metrics["step"]))

    def _write(self, metrics: dict[str, Any]) -> int:
        """Rank 0's writes; 0, or the failed write's flag: its errno (UNKNOWN_ERRNO without one), plus STATE_FILE for
        wandb/logged.json. A number, so that one int all_reduce tells every rank which error to name."""
        try:
            with self.path.open("a") as f:  # (close flushes: inside the try too)
                f.write(json.dumps(metrics) + "\n")
        except OSError as e:
            return e.errno if e.errno and 0 < e.errno < UNKNOWN_ERRNO else UNKNOWN_ERRNO
        step = metrics["step"]
        if self._to_wandb(step):
            self.accelerator.log(metrics, step=step)
            self.last_step = step
            try:
                self._save_state(step)  # after the log: a kill in between repeats one step at most
            except OSError as e:
                return STATE_FILE | (e.errno if e.errno and 0 < e.errno < UNKNOWN_ERRNO else UNKNOWN_ERRNO)
        return 0

    def _unwritable(self, failure: int, step: int) -> str:
        """The one line every rank raises for `failure` (`_write`'s flag): the file, the OS error, where the run's
        state is and how to continue."""
        from train.checkpoint import kept, latest_checkpoint

        path = self.state if failure & STATE_FILE else self.path
        code = failure & ~STATE_FILE
        why = "an OS error" if code == UNKNOWN_ERRNO else os.strerror(code).lower()
        name = errnos.errorcode.get(code)
        return (
            f"step {step}: cannot write {path} ({why}{f', {name}' if name else ''}); "
            f"{kept(latest_checkpoint(self.out))}"
        )

    def log_images(self, paths: list[Path]) -> None:
        """The report's charts (train/report.py) as wandb images under `report/<name>`, at the last logged step."""
        if self.is_main and self.use_wandb and paths and self.last_step is not None:
            import wandb

            images = {f"report/{p.stem}": wandb.Image(str(p), caption=p.stem) for p in paths}
            self.accelerator.log({"step": self.last_step, **images}, step=self.last_step)

    def log_media(self, step: int, items: list[tuple[Path, str]]) -> None:
        """Validation samples (train/validation.py) under `validation/<i>` at `step`: mp4 as wandb.Video, images as
        wandb.Image, each with its prompt as caption."""
        if self._to_wandb(step) and items:  # samples of a step logged before the resume are there already
            import wandb

            media = {f"validation/{i}": wandb.Video(str(p), caption=text, format="mp4") if p.suffix == ".mp4"
                     else wandb.Image(str(p), caption=text) for i, (p, text) in enumerate(items)}  # fmt: skip
            self.accelerator.log({"step": step, **media}, step=step)

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps after the checkpoint (they will be logged again, identically), and a torn
        last line (the run was killed while writing it)."""
        from train.report import read_metrics

        if not self.is_main or not self.path.exists():
            return
        lines, note = read_metrics(self.path)
        if note:
            print(f"resume: {note}")
        self.path.write_text("".join(json.dumps(ln) + "\n" for ln in lines if ln["step"] <= step))

    def close(self) -> None:
        if self.is_main and self.use_wandb:
            self.accelerator.end_training()
