"""Run monitoring: `<output_dir>/metrics.jsonl` (one JSON line per optimizer step) and wandb through Accelerate.

wandb needs no account: mode "offline" writes `<output_dir>/wandb/offline-run-*/` that `wandb sync` uploads later.
Settings are passed as init arguments (wandb ignores environment variables changed after its first init).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch


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


class MetricsLogger:
    """Writes metrics on rank 0 only; every rank calls it (so the call sites stay free of rank checks).

    One wandb run per run of the output_dir: its id is the run's (run.json, train/rundir.py), so a resumed run continues
    the same wandb run (online: wandb's resume; offline: `wandb sync` of its folders fills one run). The last step sent
    to wandb is kept in `wandb/logged.json`; a resumed run recomputes the steps after its checkpoint (identically) and
    sends wandb only the steps after that one, so no step is logged twice. No credential is read or written here:
    online mode uses the user's own `wandb login` (or WANDB_API_KEY)."""

    def __init__(self, accelerator, output_dir: Path, run_config: dict, logging_cfg, run_name: str,
                 run_id: str | None = None) -> None:  # fmt: skip
        self.accelerator, self.is_main = accelerator, accelerator.is_main_process
        self.path = output_dir / "metrics.jsonl"
        self.use_wandb = logging_cfg.wandb_mode != "disabled"
        self.last_step: int | None = None  # the last step logged to wandb by this process
        self.state = output_dir / "wandb" / WANDB_STATE
        self.run_id, self.before = run_id, -1  # wandb holds this run's steps up to here (an earlier process of the run)
        if self.is_main and self.use_wandb:
            if run_id is not None and self.state.exists():
                saved = json.loads(self.state.read_text())
                self.before = saved["last_step"] if saved.get("id") == run_id else 0
            self.state.parent.mkdir(parents=True, exist_ok=True)
            wandb = {"mode": logging_cfg.wandb_mode, "dir": str(output_dir), "name": logging_cfg.wandb_run or run_name,
                     **({"id": run_id, "resume": "allow"} if run_id is not None else {})}  # fmt: skip
            accelerator.init_trackers(logging_cfg.wandb_project, config=run_config, init_kwargs={"wandb": wandb})
            run = accelerator.get_tracker("wandb", unwrap=True)
            run.define_metric("step")  # charts against the optimizer step (also the end-of-run report's images)
            run.define_metric("*", step_metric="step")

    def _to_wandb(self, step: int) -> bool:
        return self.is_main and self.use_wandb and step > self.before

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        step = metrics["step"]
        if self._to_wandb(step):
            self.accelerator.log(metrics, step=step)
            self.last_step = step
            tmp = self.state.with_suffix(".tmp")  # after the log: a kill in between repeats one step at most
            tmp.write_text(json.dumps({"id": self.run_id, "last_step": step}))
            tmp.rename(self.state)

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
